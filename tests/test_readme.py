"""The README's commands run as written and its sample outputs are what they print, and so do the commands, code and
figures of the docs/ pages that the README sends a user to, so none can go stale unnoticed."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
PLANNING = open(os.path.join(ROOT, "docs", "planning.md")).read()
MEMORY = open(os.path.join(ROOT, "docs", "memory.md")).read()


def _section(title, text=README):
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _block_starting(text, first):
    """The fenced block of `text` whose first line starts with `first`."""
    blocks = [b.split("```", 1)[0] for b in text.split("```\n")[1:]]
    found = [b for b in blocks if b.startswith(first)]
    assert found, f"no block starting {first!r}"
    return found[0]


def _first_cluster():
    return _section("Describing a cluster", PLANNING).split("```yaml", 1)[1].split("```", 1)[0]


def _hexiseq(args, cwd):
    return subprocess.run([sys.executable, "-m", "hexiseq", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_sample_output_is_what_plan_prints(tmp_path):
    sample = _block_starting(_section("Start here"), "strategy")
    lines = [line for line in sample.splitlines() if line.strip()]
    assert lines and lines[0].startswith("strategy"), sample
    out = _hexiseq(["plan"], tmp_path)
    assert out.returncode == 0, out.stderr
    printed = [line.rstrip() for line in out.stdout.splitlines()]
    for line in lines:
        assert line.rstrip() in printed, f"README line not in `hexiseq plan` output:\n{line}\n---\n{out.stdout}"


def test_command_line_examples_run(tmp_path):
    """Every command of planning.md's command-line block exits 0, cluster.yaml being its first cluster."""
    (tmp_path / "cluster.yaml").write_text(_first_cluster())
    block = _section("The command line", PLANNING).split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) >= 4, block
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "hexiseq", command
        redirect = None
        if ">" in argv:
            argv, redirect = argv[:argv.index(">")], argv[argv.index(">") + 1]
        if "--plot" in argv and importlib.util.find_spec("matplotlib") is None:
            continue  # the plot needs matplotlib (an optional extra); every other command still runs
        out = _hexiseq(argv[1:], tmp_path)
        assert out.returncode == 0, (command, out.stderr)
        if redirect:
            (tmp_path / redirect).write_text(out.stdout)
    assert "hexiseq-plan" in (tmp_path / "plan.json").read_text()


def test_the_70b_sentences_are_what_the_planner_says(tmp_path):
    first_cluster = _first_cluster()
    (tmp_path / "cluster.yaml").write_text(first_cluster)
    assert yaml.safe_load(first_cluster)["nodes"][2]["gpu"] == "L40S"
    out = _hexiseq(["plan", "cluster.yaml", "--model", "70b", "--seq-len", "64k", "--checkpointing"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "shared by memory, 2.86-5.55% of the full-sharded states per device (even: 5.00%)" in out.stdout
    words = " ".join((PLANNING + MEMORY).split())
    assert "2.86% on an L40S and 5.52-5.55% on the 80 GB devices" in words and "(5.00% each" in words
    even = _hexiseq(["plan", "cluster.yaml", "--model", "70b", "--seq-len", "64k", "--checkpointing",
                     "--state-shares", "even"], tmp_path)
    assert even.returncode == 1 and "L40S, 45.0 GiB" in even.stderr, even.stderr
    out = _hexiseq(["plan", "cluster.yaml", "--model", "70b", "--seq-len", "1m", "--checkpointing"], tmp_path)
    assert out.returncode == 1
    assert "device 8 (A100-80G, 80.0 GiB) is short by 2.18 GiB" in out.stderr, out.stderr
    assert "the longest sequence that fits is 760k tokens with the memory features" in out.stderr, out.stderr
    assert "an A100 is short by 2.18 GiB" in words and "longest sequence that fits is 760k tokens" in words
    none = _hexiseq(["plan", "cluster.yaml", "--model", "70b", "--seq-len", "1m", "--checkpointing",
                     "--memory-features", "none"], tmp_path)
    assert none.returncode == 1 and "the longest sequence that fits is 89k tokens;" in none.stderr, none.stderr
    assert "without them the longest sequence is 89k" in words
    out = _hexiseq(["plan", "cluster.yaml", "--model", "70b", "--seq-len", "512k", "--checkpointing"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "20 device(s) fit their memory with them" in out.stdout
    step = float(re.search(r"step time\s+([0-9.]+) s", out.stdout).group(1))
    tiling = dict(re.findall(r"\((H100-SXM|L40S)\): checkpoints offloaded to host memory, tiled MLP, tiled loss "
                             r"\(adds up to ([0-9.]+) s", out.stdout))
    assert "(A100-80G): checkpoints offloaded to host memory, tiled loss (adds up to" in out.stdout
    assert round(step) == 495 and {k: round(float(x), 1) for k, x in tiling.items()} == {"H100-SXM": 9.7, "L40S": 5.1}
    assert "adding up to 9.7 s on an H100 and 5.1 s on an L40S to a 495 s step" in words


def test_python_block_runs():
    block = _section("Python", PLANNING).split("```python", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(block, "docs/planning.md (Python)", "exec"), scope)
    assert scope["same"].fingerprint == scope["plan"].fingerprint and scope["mine"].fits


def test_quickstart_prints_what_the_readme_shows(tmp_path):
    """Step 3's command, as printed, runs to OK, and prints the README's plan and device table."""
    start = _section("Start here")
    command = start.split("**3. Run a plan under torchrun.**", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command == "torchrun --nproc_per_node 4 examples/quickstart.py", command
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
            str(29500 + os.getpid() % 1000), os.path.join(ROOT, "examples", "quickstart.py")]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    shown = _block_starting(start.split("**3. Run a plan under torchrun.**", 1)[1], "HexiSeq plan")
    printed = [line.rstrip() for line in out.stdout.splitlines()]
    # the timing and the rounding of the differences belong to the machine; everything else is printed as shown
    for line in shown.splitlines():
        if line.strip() and not line.startswith(("forward + backward", "out:", "dq:", "dk:", "dv:")):
            assert line.rstrip() in printed, f"README line not printed:\n{line}\n---\n{out.stdout}"
    assert printed[-1] == "OK"


def test_paths_the_docs_name_exist():
    # Every repository path the README and docs/ name in backticks (or in a markdown link) is there: a file moved
    # without its mentions fails here. Globs and placeholders (`*`, `<`) are not paths.
    import glob
    import re

    roots = ("csrc/", "kernels/", "hexiseq/", "tests/", "benchmarks/", "docs/", "examples/")
    missing = []
    for doc in ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(os.path.join(ROOT, doc)).read()
        for path in re.findall(r"`([A-Za-z0-9_./-]+)`|\]\(([A-Za-z0-9_./-]+)\)", text):
            path = next(p for p in path if p)
            path = path.split("#")[0]
            if doc != "README.md" and path.startswith(("../", "./")):
                path = os.path.normpath(os.path.join("docs", path))
            if path.startswith(roots) and "*" not in path and "<" not in path:
                if not os.path.exists(os.path.join(ROOT, path)):
                    missing.append(f"{os.path.basename(doc)}: {path}")
    assert not missing, missing


def test_the_doors_the_readme_names_exist():
    # Every hexiseq.<name>[.<name>...] the "Which door" table names resolves to a module or an attribute, found
    # without a DeprecationWarning (no door may be a name the root only forwards).
    import importlib
    import warnings

    table = _section("Which door for which job")
    names = sorted(set(re.findall(r"\bhexiseq(?:\.\w+)+", table)))
    assert len(names) >= 12, names
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in names:
            parts = name.split(".")
            obj, at = None, len(parts)
            while obj is None:
                try:
                    obj = importlib.import_module(".".join(parts[:at]))
                except ImportError:
                    at -= 1
            for attr in parts[at:]:
                assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:parts.index(attr)])} has no {attr}"
                obj = getattr(obj, attr)
