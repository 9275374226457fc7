"""The training example runs under torchrun on 4 CPU processes and its losses match the single-process run.

One run of each kind goes through torchrun as a user runs it (the launcher, the script's exit status as its
verdict, the processes' shutdown); the other variants (float32, a long-tail batch per step, ranks left idle) run the
same script's main() in 4 ranks forked from the test's fork server (tests/workers/script_worker.py), with
torchrun's environment: the same code from argument parsing to the verdict, its status and output checked the same
way, without four fresh interpreters importing torch for each."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import dist_worker  # noqa: E402
import script_worker  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype,batch,launch", [("float64", False, "torchrun"), ("float32", False, "forked"),
                                                ("float64", True, "forked")])
def test_train_llama_matches_single_process(dtype, batch, launch, tmp_path):
    """One sequence per step on the example's plan; with --batch, a long-tail batch per step on groups the batch
    planner chooses, against every document trained on its own. Every rank holds tokens (in every step), and the
    script ends with a plain return: its exit status is its verdict (under torchrun; in forked ranks, what main()
    returns on every rank)."""
    args = ("--steps", "3", "--dtype", dtype, *(["--batch"] if batch else []))
    out = run_example(*args) if launch == "torchrun" else run_forked(tmp_path, *args)
    m = re.search(r"max relative loss difference (\S+) \(OK", out)
    assert m, out[-3000:]
    assert float(m.group(1)) <= 1e-5
    assert len(re.findall(r"^step \d+:", out, re.M)) == 3
    if batch:
        steps = re.findall(r"^step of 7 sequences: groups .*, tokens per rank \[(.*)\]: (.*)$", out, re.M)
        assert len(steps) == 3, out[-3000:]
        for tokens, said in steps:
            assert said == "every rank holds tokens" and all(int(n) > 0 for n in tokens.split(", ")), out[-3000:]
    else:
        m = re.search(r"^tokens per rank \[(.*)\], query heads per rank \[(.*)\]: every rank holds tokens$", out, re.M)
        assert m, out[-3000:]
        assert [int(n) for n in m.group(1).split(", ")] == [103, 51, 58, 45]
        assert [int(n) for n in m.group(2).split(", ")] == [5, 3, 8, 8]


def test_train_llama_batch_says_which_ranks_sit_out(tmp_path):
    """At 257 tokens the batch planner leaves both A100s idle (one pass on either costs more before its first token
    than the H100s take for the whole batch): the example says so, and why, and still matches."""
    out = run_forked(tmp_path, "--steps", "1", "--batch", "--seq-len", "257")
    m = re.search(r"^step of 7 sequences: .*, tokens per rank \[(.*)\]: ranks \[2, 3\] idle: a pass on any group of "
                  r"them costs at least (\S+) s even for the shortest sequence, more than the step's slowest group "
                  r"\((\S+) s\) takes", out, re.M)
    assert m, out[-3000:]
    assert [int(n) for n in m.group(1).split(", ")][2:] == [0, 0] and float(m.group(2)) > float(m.group(3))
    assert re.search(r"max relative loss difference (\S+) \(OK", out), out[-3000:]


def run_example(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "examples" / "train_llama.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-3000:]
    return out


def run_forked(tmp_path, *args):
    """The example's main() on 4 forked ranks with torchrun's environment: every rank returns status 0; rank 0's
    output (where the example prints)."""
    got = dist_worker.spawn(script_worker.run_main, 4, (str(ROOT / "examples" / "train_llama.py"), list(args),
                                                        free_port()), tmp_path, timeout_s=300)
    assert all(status == 0 for status, _ in got.values()), {r: (s, out[-3000:]) for r, (s, out) in got.items()}
    return got[0][1]
