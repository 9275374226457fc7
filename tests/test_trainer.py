"""hexiseq.trainer.HexiSeqTrainer: the transformers Trainer over an asymmetric plan on 3 Gloo processes under torchrun,
against a plain Trainer in one process (examples/train_hf_trainer.py does both and compares).

Tolerances: every step's loss and the trained weights relative to the plain Trainer's. float64: losses 1e-9,
weights 1e-8 (the same sums in another order; observed 4e-16 and 4e-15 after four Adam steps). float32: losses
1e-5, weights 1e-4 (float32 rounding of sums in another order, which Adam's division by the square root of small
second moments amplifies; observed 1e-7 and 5e-6). Averaging the ranks' gradients instead of summing them (DDP's
default) leaves the weights off by far more after the first step, a wrong shard or position moves the first loss
by 1e-2 or more.

The float32 run (the example's default) goes through torchrun as a user runs it, its exit status its verdict. The
float64 run is the same script's main() in 3 ranks forked from the test's fork server, which has imported the
Trainer once (tests/workers/script_worker.py), with torchrun's environment; its plain Trainer runs in a fourth
forked process outside that environment, with the command line rank 0 asks for: the same code and the same checks,
without five fresh interpreters importing torch and the Trainer."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate (pip install accelerate)")

import dist_worker  # noqa: E402
import script_worker  # noqa: E402
import trainer_worker  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*extra, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "examples" / "train_hf_trainer.py"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype,launch", [("float64", "forked"), ("float32", "torchrun")])
def test_trainer_matches_plain_trainer_in_one_process(dtype, launch, tmp_path):
    args = ("--steps", "4", "--dtype", dtype)
    rc, out = run(*args) if launch == "torchrun" else run_forked(tmp_path, *args)
    assert rc == 0, out[-4000:]
    m = re.search(r"max relative loss difference (\S+) \(OK", out)
    assert m, out[-4000:]
    assert float(m.group(1)) <= (1e-9 if dtype == "float64" else 1e-5)
    assert len(re.findall(r"^step \d+: HexiSeqTrainer", out, re.M)) == 4
    drift = float(re.search(r"trained weights: max relative difference to the plain Trainer's (\S+)", out).group(1))
    assert drift <= (1e-8 if dtype == "float64" else 1e-4)
    evaluated = float(re.search(r"evaluation loss: .* relative difference (\S+)", out).group(1))
    assert evaluated <= (1e-9 if dtype == "float64" else 1e-5)


def run_forked(tmp_path, *args):
    """The example's main() on 3 forked ranks with torchrun's environment, and its reference run in a fourth: (0 if
    every rank and the reference returned 0, else the first other status; rank 0's output, where the example
    prints)."""
    requests = tmp_path / "reference"
    requests.mkdir()
    got = dist_worker.spawn(script_worker.run_main_with_a_fresh_process, 4,
                            (str(ROOT / "examples" / "train_hf_trainer.py"), list(args), free_port(), str(requests)),
                            tmp_path, timeout_s=300)
    statuses = [got[r][0] for r in range(4)]
    bad = [s for s in statuses if s != 0]
    return (bad[0] if bad else 0), got[0][1] + "".join(f"\n--- process {r}:\n{got[r][1][-2000:]}"
                                                      for r in range(1, 4) if got[r][0] != 0)


def test_trainer_refuses_a_plan_of_another_size(tmp_path):
    """A plan for 3 devices on 2 ranks: every rank says so, none trains."""
    got = dist_worker.spawn(trainer_worker.refuse_a_plan_of_another_size, 2, (free_port(),), tmp_path, timeout_s=120)
    assert all(status == "refused" for status, _ in got.values()), got
    said = "".join(message + "\n" for _, message in got.values())
    assert len(re.findall(r"refused: the plan places 3 devices but the process group has 2 ranks", said)) == 2, said
