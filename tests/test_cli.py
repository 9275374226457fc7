"""The `hexiseq` command line, run as `python -m hexiseq` in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

import hexiseq
from hexiseq import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hexiseq", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd or ROOT)


def assert_clean_error(proc, *needles):
    """Exit 1, one `hexiseq: error: ...` line on stderr naming the problem, no traceback, nothing on stdout."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hexiseq: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def default_run():
    return run("plan")


def test_plan_defaults(default_run):
    proc = default_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert proc.stderr == ""
    # the explanation, the per-device table (16 example devices) and the strategies side by side
    for word in ("step time", "token-parallel", "all-to-all", "attention+ring", "lower bound", "fingerprint"):
        assert word in out, word
    header = next(line for line in out.splitlines() if line.split()[:2] == ["dev", "gpu"])
    assert "mem GiB" in header
    rows = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()
            and len(line.split()) > 1 and line.split()[1] in ("H100-SXM", "A100-80G")]
    assert len(rows) == 16
    assert "strategies side by side" in out
    table = out.split("strategies side by side")[1]
    for name in ("ring", "ulysses", "usp"):
        assert any(line.startswith(name) for line in table.splitlines()), name
    assert "<- chosen" in table


def test_plan_matches_api(default_run):
    expected = hexiseq.plan(hexiseq.Cluster.example(), model="7b", seq_len="128k")
    assert f"fingerprint {expected.fingerprint}" in default_run.stdout


def test_plan_yaml_cluster_model_seq_strategy(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n  - {gpu: H100-SXM, count: 8, intra_gbps: 450}\n"
                    "  - {gpu: A100-80G, count: 8, intra_gbps: 300}\ninter_node_gbps: 25\n")
    proc = run("plan", str(path), "--model", "13b", "--seq-len", "64k", "--strategy", "usp")
    assert proc.returncode == 0, proc.stderr
    assert "HexiSeq plan 'usp'" in proc.stdout and "gpt-13b" in proc.stdout and "65,536" in proc.stdout
    assert "16 devices (8x H100-SXM, 8x A100-80G)" in proc.stdout


def test_plan_json_round_trips(tmp_path):
    proc = run("plan", "--model", "7b", "--seq-len", "32k", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "hexiseq-plan" and doc["seq_len"] == 32768
    p = Plan.from_json(proc.stdout)
    assert p.fingerprint == doc["fingerprint"]
    assert p.to_json(indent=2) == proc.stdout.rstrip("\n")
    assert p.step_time_s == doc["predicted"]["step_time_s"]


def test_gpus():
    proc = run("gpus")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("\n\n")[0]
    names = [line.split()[0] for line in table.splitlines()[1:] if line.strip()]
    assert names == [g["name"] for g in hexiseq.gpu_catalog()]
    # every alias is listed on the line of the model it is read as, and is read as that model
    for line in table.splitlines()[1:]:
        name, also = line.split()[0], line[11:29].strip()
        for alias in also.split(", ") if also != "-" else []:
            assert hexiseq.Cluster.from_dict({"nodes": [{"gpu": alias, "count": 1}]}).nodes[0].gpu == name
    catalog = {g["name"]: g["aliases"] for g in hexiseq.gpu_catalog()}
    assert "H100" in catalog["H100-SXM"] and "A100" in catalog["A100-80G"] and catalog["A100-40G"] == []


def test_info():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    info, built = json.loads(proc.stdout), hexiseq.build_info()
    assert info["cuda_kernels_built"] == built["cuda"] and "cuda" not in info
    assert info["cuda_devices"] == (hexiseq.cuda_device_count() if built["cuda"] else 0)
    assert {k: v for k, v in info.items() if not k.startswith("cuda_")} == {k: v for k, v in built.items()
                                                                            if not k.startswith("cuda")}
    if not built["cuda"]:  # says why the kernels are missing and how to get them
        assert built["cuda_skipped"] in info["cuda_kernels"] and "HEXISEQ_CUDA=1 pip install ." in info["cuda_kernels"]


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and hexiseq.__version__ in proc.stdout


def test_unknown_gpu_in_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("nodes:\n  - {gpu: H100-SXM, count: 4, intra_gbps: 450}\n  - {gpu: TPUv5, count: 4, intra_gbps: 300}\n"
                    "inter_node_gbps: 25\n")
    assert_clean_error(run("plan", str(path)), "nodes[1].gpu", "TPUv5", "H100-SXM")


def test_bad_seq_len():
    assert_clean_error(run("plan", "--seq-len", "abc"), "seq_len", "'abc'")
    assert_clean_error(run("plan", "--seq-len", "0"), "seq_len")


def test_missing_cluster_file(tmp_path):
    assert_clean_error(run("plan", str(tmp_path / "nope.yaml")), "nope.yaml")


def test_model_that_does_not_fit(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("nodes:\n  - {gpu: RTX3090, count: 2, intra_gbps: 32}\n")
    assert_clean_error(run("plan", str(path), "--model", "70b", "--seq-len", "1m"), "GiB")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    r = run("plan", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # a real figure, not an empty canvas


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    """Without matplotlib, --plot fails at once (before planning) with one line naming what to install."""
    from hexiseq.cli import main
    from hexiseq.planner.plotting import plot_plan

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(out)]) == 1
    got = capsys.readouterr()
    assert got.out == "" and not out.exists()
    assert got.err.startswith("hexiseq: error: plotting needs matplotlib"), got.err
    assert 'pip install "hexiseq[plot]"' in got.err and "pip install matplotlib" in got.err, got.err
    with pytest.raises(hexiseq.HexiseqError, match=r'hexiseq\[plot\]'):
        plot_plan(hexiseq.plan(hexiseq.Cluster.example(), model="7b", seq_len=8192))


def test_plot_draws_parked_devices_apart_from_their_groups():
    """A parked device (no tokens, no heads) is drawn after every group, on its own band, not as a member of the
    group it sits in; each group is named with its working devices; every busy term is stacked; the title wraps."""
    pytest.importorskip("matplotlib")
    from hexiseq.planner.plotting import plot_plan

    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 4, "intra_gbps": 450}]})
    m = {"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2, "head_dim": 8, "ffn": 128, "vocab": 97}
    layout = {"groups": [{"devices": [0, 2], "seq": 600, "tokens": [600, 0], "heads": [8, 0]},
                         {"devices": [1, 3], "seq": 424, "tokens": [212, 212], "heads": [4, 4]}]}
    p = hexiseq.evaluate(c, model=m, seq_len=1024, layout=layout)
    assert p.devices.device.tolist() == [0, 2, 1, 3] and p.devices.tokens.tolist()[1] == 0
    assert "g0: 1 device(s) 0 [H100-SXM], seq 600 (and parked 2)" in p.explain()
    fig = plot_plan(p)
    try:
        top, heads, times = fig.axes[:3]
        for ax in (top, heads, times):  # the parked device last, its number greyed
            labels = ax.get_xticklabels()
            assert [t.get_text() for t in labels] == ["0", "1", "3", "2"]
            assert labels[-1].get_color() != labels[0].get_color()
        assert [t.get_text() for t in top.texts] == ["g0: 1", "g1: 2", "parked: 1"]
        assert [b.get_height() for b in top.patches[:4]] == [600, 212, 212, 0]
        assert "1 parked" in fig._suptitle.get_text()
        names = [t.get_text() for t in times.get_legend().get_texts()]
        assert "matmuls" in names and "attention" in names and "runtime work" not in names  # terms no device has
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    # a long cluster description is wrapped to the figure, not clipped at its edges
    wide = hexiseq.Cluster.from_dict({"nodes": [{"gpu": g, "count": 1} for g in (
        "H100-SXM", "A100-80G", "L40S", "A800", "H800", "A100-40G", "RTX4090", "A6000", "V100", "L40")],
                                    "inter_node_gbps": 25})
    fig = plot_plan(hexiseq.evaluate(wide, model=m, seq_len=1000, layout={"groups": [
        {"devices": list(range(10)), "seq": 1000, "tokens": [100] * 10, "heads": [1] * 8 + [0, 0]}]}))
    try:
        fig.canvas.draw()
        title = fig._suptitle
        box = title.get_window_extent()
        assert "\n" in title.get_text() and box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox)
    finally:
        plt.close(fig)


def test_scheduler_is_the_default_and_beats_the_baselines(default_run):
    text = default_run.stdout
    assert "HexiSeq plan 'hexiseq'" in text
    line = next(l for l in text.splitlines() if l.startswith("hexiseq "))
    assert "<- chosen" in line and "1.000x" in line


def test_plan_output_explains_itself():
    """Ranges print one way (inclusive, heads like devices), the columns and the comparison are explained, and
    the output says how to run the plan."""
    proc = run("plan")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("   0 H100-SXM")]
    assert rows and rows[0][4] == "0-3" and rows[0][5] == "0-3", rows  # 4 of 32 heads: 0, 1, 2, 3
    assert "g0: 8 device(s) 0-7" in proc.stdout
    for needle in ("columns: tokens", "gemm s = token-parallel", "bound gap =",
                   "to run it:", "hexiseq.hf.patch_model", "hexiseq.nn.HexiSeqAttention(plan)",
                   # measure is a collective: the line starts one process per device of the plan's cluster
                   "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:PORT -m hexiseq measure plan.json"):
        assert needle in proc.stdout, needle
    assert "HexiSeqContext" not in proc.stdout  # one name for the module, the README's


def test_reserved_memory_and_implausible_figures(tmp_path):
    """--reserved-gib reaches the plan's training; a cluster file with a figure that looks like a unit slip (Gbit/s
    for GB/s, MiB for GiB) plans but warns on stderr, one line each, naming the field, the value and the catalog."""
    out = run("plan", "--seq-len", "8k", "--reserved-gib", "11.5", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["training"]["reserved_gib"] == 11.5
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {gpu: H100-SXM, count: 2, intra_gbps: 3600, memory_gib: 81920}\ninter_node_gbps: 25\n")
    proc = run("plan", str(path), "--seq-len", "8k")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "hexiseq: nodes[0].intra_gbps = 3600 GB/s is past any link built (NVLink 5: 900 GB/s); bandwidths are GB/s "
        "(bytes), is it Gbit/s (450 GB/s)?",
        "hexiseq: nodes[0].memory_gib = 81920 is 1029x the catalog's 79.6 GiB for H100-SXM; memory is GiB, is it MiB "
        "(80 GiB)?"], proc.stderr


def test_plan_documents_inline_and_from_a_file(tmp_path):
    lengths = [3000, 5000, 1384, 7000] * 4  # 65,536 tokens
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    inline = run("plan", "--seq-len", "64k", "--checkpointing", "--json", "--documents", ",".join(map(str, lengths)))
    from_file = run("plan", "--seq-len", "64k", "--checkpointing", "--json", "--documents", str(path))
    assert inline.returncode == 0 and from_file.returncode == 0, (inline.stderr, from_file.stderr)
    a, b = Plan.from_json(inline.stdout), Plan.from_json(from_file.stdout)
    assert a.documents.tolist() == lengths and a.layout == b.layout
    assert_clean_error(run("plan", "--seq-len", "64k", "--documents", "4096,x"), "--documents", "'x'")
    assert_clean_error(run("plan", "--seq-len", "64k", "--documents", "63488,2,048"), "--documents has '048'",
                       "write 1024, not 1,024")
    assert_clean_error(run("plan", "--seq-len", "64k", "--documents", "4096"),
                       "documents must add up to seq_len=65536, they add up to 4096 (1 length)")



def test_time_limit_compares_within_it_with_the_same_checks():
    # --time-limit shares the limit among the strategies (compare's time_limit_s), documents checked as without it
    lengths = [3000, 5000, 1384, 7000] * 4  # 65,536 tokens
    proc = run("plan", "--seq-len", "64k", "--checkpointing", "--time-limit", "60", "--json",
               "--documents", ",".join(map(str, lengths)))
    assert proc.returncode == 0, proc.stderr
    assert Plan.from_json(proc.stdout).documents.tolist() == lengths
    assert_clean_error(run("plan", "--seq-len", "64k", "--time-limit", "60", "--documents", "4096"),
                       "documents must add up to seq_len=65536")
    assert_clean_error(run("plan", "--seq-len", "64k", "--time-limit", "60", "--no-causal", "--documents", "65536"),
                       "documents need causal attention")
    assert_clean_error(run("plan", "--time-limit", "0"), "--time-limit")
    limited = hexiseq.compare(hexiseq.Cluster.example(), model="7b", seq_len="32k", time_limit_s=60)
    assert list(limited) == list(hexiseq.compare(hexiseq.Cluster.example(), model="7b", seq_len="32k"))
    with pytest.raises(hexiseq.InvalidArgumentError, match="time_limit_s must be positive"):
        hexiseq.compare(hexiseq.Cluster.example(), time_limit_s=0)

def test_plan_batch_from_a_file_and_inline(tmp_path):
    """`hexiseq plan --batch`: one sequence per line (a line of several lengths is one packed sequence's documents),
    or inline lengths; the groups, the assignment and the comparison with one packed sequence are printed, and
    --json gives the same plan as hexiseq.planner.plan_batch, in the format hexiseq.Plan.from_json reads."""
    path = tmp_path / "batch.txt"
    path.write_text("# one step\n65536\n2048\n1024, 1024, 512\n8000\n300\n")
    out = run("plan", "--batch", str(path))
    assert out.returncode == 0, out.stderr
    assert "batch plan: 5 sequences (78,444 tokens, the longest 65,536)" in out.stdout
    assert "one packed sequence" in out.stdout or "packed as documents into one sequence" in out.stdout
    assert "step (cost model, each pass scored)" in out.stdout and "this plan's scored pass by pass" in out.stdout
    js = run("plan", "--batch", str(path), "--json")
    assert js.returncode == 0, js.stderr
    got = json.loads(js.stdout)
    want = hexiseq.planner.plan_batch(hexiseq.Cluster.example(), model="7b",
                              lengths=[65536, 2048, [1024, 1024, 512], 8000, 300])
    assert got["groups"] == [list(g) for g in want.groups] and got["assignment"] == list(want.assignment)
    assert got["documents"][2] == [1024, 1024, 512]
    assert hexiseq.Plan.from_json(js.stdout).fingerprint == want.fingerprint  # the one format, read back
    inline = run("plan", "--batch", "4096,2048,1024", "--json")
    assert inline.returncode == 0 and json.loads(inline.stdout)["lengths"] == [4096, 2048, 1024], inline.stderr
    suffixed = run("plan", "--batch", "4k,2k,1024", "--json")  # k as --seq-len takes it
    assert suffixed.returncode == 0 and json.loads(suffixed.stdout)["lengths"] == [4096, 2048, 1024], suffixed.stderr
    assert_clean_error(run("plan", "--batch", "4096,x"), "--batch", "'x'")
    assert_clean_error(run("plan", "--batch", "4096", "--documents", "4096"), "--batch", "--documents")
    assert_clean_error(run("plan", "--batch", "0,5"), "sequence 1 must hold token counts", "'0'")
    # a thousands separator is not read as two sequences (1 and 24): a count with a leading zero is refused
    assert_clean_error(run("plan", "--batch", "4096,1,024"), "sequence 3 has '024'", "write 1024 (or 1k)")
    bad = tmp_path / "bad.txt"
    bad.write_text("4096\n\u00b2\n")  # a superscript digit: str.isdigit() takes it, int() does not
    assert_clean_error(run("plan", "--batch", str(bad)), "line 2 must hold token counts", "'\u00b2'")
    bad.write_text("4096\n2048 0\n")
    assert_clean_error(run("plan", "--batch", str(bad)), "line 2", "'0'")
    assert_clean_error(run("plan", "--batch", str(tmp_path / "missing.txt")), "missing.txt", "no such file")
    assert_clean_error(run("plan", "--batch", str(tmp_path)), "is not a file")
    for flag, value in (("--seq-len", "1m"), ("--strategy", "ring"), ("--plot", str(tmp_path / "x.png"))):
        assert_clean_error(run("plan", "--batch", str(path), flag, value), "--batch", "leave out " + flag)
    assert not (tmp_path / "x.png").exists()
    quick = run("plan", "--batch", str(path), "--per-step", "--json")  # the linear pricing: as plan(exact=False)
    assert quick.returncode == 0, quick.stderr
    want = hexiseq.planner.plan_batch(hexiseq.Cluster.example(), model="7b", exact=False,
                              lengths=[65536, 2048, [1024, 1024, 512], 8000, 300])
    assert json.loads(quick.stdout)["predicted"]["step_time_s"] == pytest.approx(want.step_time_s, rel=1e-9)
    assert_clean_error(run("plan", "--per-step"), "--per-step", "--batch")
    text = run("plan", "--batch", str(path), "--per-step")  # its figures named as the linear pricing throughout
    assert text.returncode == 0, text.stderr
    assert "step (priced, linear)" in text.stdout and "each pass scored" not in text.stdout, text.stdout
    assert "(its step priced linearly)" in text.stdout and "linear pricing (--per-step)" in text.stdout, text.stdout
    split = run("plan", "--batch", str(path), "--split-documents", "--json")
    assert split.returncode == 0, split.stderr
    got = json.loads(split.stdout)
    assert got["lengths"] == [65536, 2048, 1024, 1024, 512, 8000, 300]
    assert got["origin"][2:5] == [[2, 0], [2, 1], [2, 2]]
    assert_clean_error(run("plan", "--split-documents"), "--split-documents", "--batch")


def test_several_sequences_are_planned_on_groups_when_that_is_faster():
    """`hexiseq plan --sequences N`: where the batch planner's groups beat one layout over every device run N times,
    the batch plan is printed first, with how many groups and why, and the ratio to the single layout, which
    follows; with one sequence, or no faster grouping, only the single layout."""
    out = run("plan", "--sequences", "4", "--checkpointing", "--model", "8b", "--seq-len", "32k")
    assert out.returncode == 0, out.stderr
    head = out.stdout.split("HexiSeq plan 'hexiseq'")[0]
    assert head.startswith("batch plan: 4 sequences (131,072 tokens, the longest 32,768) on 16 devices"), head
    assert "why 2 groups" in head and "--sequences 4: the batch planner's groups above are predicted" in head
    ratio = float(head.split("are predicted ")[1].split("x as fast")[0])
    single = float(out.stdout.split("HexiSeq plan 'hexiseq'")[1].split("step time")[1].split("s")[0])
    batch = float(head.split("step (cost model, each pass scored) ")[1].split(" s")[0])
    assert ratio > 1 and abs(single / batch - ratio) < 0.01 * ratio, (ratio, single, batch)
    one = run("plan", "--checkpointing", "--model", "8b", "--seq-len", "32k")
    assert one.returncode == 0 and "batch plan" not in one.stdout, one.stderr


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("nodes:\n  - {gpu: H100-SXM, count: 2, intra_gbps: 450\ninter_node_gbps: 25\n")
    assert_clean_error(run("plan", str(path)),
                       f"{path}: line 3, column 16: not valid YAML: expected ',' or '}}', but got ':' "
                       "(while parsing a flow mapping at line 2, column 5)")


def test_plan_pipeline_prints_the_pipeline_beside_the_plan_without():
    """`hexiseq plan --pipeline`: the pipeline plan (stages, layers, bubble, compute floor), then the plan without
    pipelines and the ratio; --json gives plan_pipeline's to_dict; options it would ignore are refused."""
    out = run("plan", "--pipeline", "--sequences", "4", "--seq-len", "16k", "--model", "7b")
    assert out.returncode == 0, out.stderr
    assert "pipeline plan: 4 sequences of 16,384 tokens" in out.stdout and "compute floor" in out.stdout
    assert "without pipelines (hexiseq plan" in out.stdout and "x as fast (both predicted" in out.stdout
    js = run("plan", "--pipeline", "--sequences", "4", "--seq-len", "16k", "--model", "7b", "--json")
    assert js.returncode == 0, js.stderr
    got = json.loads(js.stdout)
    want = hexiseq.planner.plan_pipeline(hexiseq.Cluster.example(), model="7b", seq_len=16384,
                                         training=hexiseq.Training(sequences=4))
    assert got["predicted"]["step_time_s"] == pytest.approx(want.step_time_s, rel=1e-9)
    assert sum(s["layers"] for s in got["pipelines"][0]) == 32
    assert_clean_error(run("plan", "--pipeline", "--batch", "4096"), "--pipeline", "leave out --batch")
    assert_clean_error(run("plan", "--pipeline", "--strategy", "ring"), "--pipeline", "leave out --strategy")
