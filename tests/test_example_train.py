"""The training example runs under torchrun on 4 CPU processes and its losses match the single-process run."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype,batch", [("float64", False), ("float32", False), ("float64", True)])
def test_train_llama_matches_single_process(dtype, batch):
    """One sequence per step on the example's plan; with --batch, a long-tail batch per step on groups the batch
    planner chooses, against every document trained on its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "examples" / "train_llama.py"), "--steps", "3",
           "--dtype", dtype] + (["--batch"] if batch else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    m = re.search(r"max relative loss difference (\S+) \(OK", out)
    assert m, out[-3000:]
    assert float(m.group(1)) <= 1e-5
    assert len(re.findall(r"^step \d+:", out, re.M)) == 3
    if batch:
        assert len(re.findall(r"^step of 7 sequences: groups", out, re.M)) == 3, out[-3000:]
