"""A script that closes its HexiSeq contexts and calls destroy_process_group() ends cleanly: no Gloo thread outlives
destroy_process_group(), so none is left to abort the process at interpreter shutdown.

The abort this guards against ("terminate called without an active exception", SIGABRT, after all work was done):
a Gloo worker still holding the last collective's work when the interpreter finalises needs the GIL to drop the
tensor's Python object and is ended by Python mid-unwind (backtrace: ProcessGroupGloo::runLoop -> ~AsyncWork ->
TensorImpl::decref_pyobject -> gil_scoped_acquire -> PyThread_exit_thread -> std::terminate). It can only happen
while the world group outlives destroy_process_group(): torch.distributed.nn.functional imported after
init_process_group binds it as a default argument, and contexts held by a script's globals kept it. Left to the
scheduler it comes and goes with the machine's load (reported in 1 run of 3 of the 4-rank training example on a
loaded 2-core machine, seen in none of 25 runs, 13 of one sequence and 12 of batches, on a quieter one);
tests/workers/teardown_worker.py --squeeze makes it happen on every run of the code before the fix (3 of 3, 1 to 3
ranks aborting in each)."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"),
                                 reason="counts threads in /proc and schedules them with SCHED_IDLE (Linux)")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_four_ranks_tear_down_cleanly():
    # one run: --squeeze makes the race happen on every run of the code before the fix
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests" / "workers" / "teardown_worker.py"), "--squeeze"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out and proc.returncode == 0, out[-3000:]
    left = {int(r): int(n) for r, n in re.findall(r"rank (\d+): (\d+) Gloo thread\(s\) left", out)}
    assert left == {0: 0, 1: 0, 2: 0, 3: 0}, out[-3000:]
