"""The planner at scale: a large cluster plans in bounded time, a time limit returns the best plan so far
marked as stopped early, and Ctrl-C (SIGINT) ends a long plan promptly, in the API and the CLI.

Bounds are generous (several times what a loaded 2-core machine takes) so they only fail when planning
time returns to quadratic growth or cancellation stops working, not on a slow day."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import hexiseq
from hexiseq import InvalidArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS = [("H100-SXM", 450.0), ("A100-80G", 300.0), ("A800", 200.0), ("L40S", 32.0)]
TRAINING = hexiseq.Training(checkpointing=True)


def cluster_dict(n):
    """Nodes of 8 GPUs cycling four models, 25 GB/s between nodes (benchmarks/planner_scaling.py)."""
    return {"nodes": [{"gpu": GPUS[i % 4][0], "count": 8, "intra_gbps": GPUS[i % 4][1]} for i in range(n // 8)],
            "inter_node_gbps": 25.0}


def check_valid(plan, n):
    """A complete layout: every device once, shares that add up, and it fits."""
    layout = plan.layout
    assert sorted(layout.device.tolist()) == list(range(n))
    assert int(layout.group_seq.sum()) == plan.seq_len
    assert int(layout.tokens.sum()) == plan.seq_len
    assert plan.fits
    assert math.isfinite(plan.step_time_s) and plan.step_time_s > 0


def test_plan_16384_devices_in_bounded_time():
    """llama3-70b at 8K tokens per GPU on 16,384 GPUs: a few seconds here; 60 s allows for a loaded machine
    while the old quadratic growth (over 100 s at this size) fails."""
    n = 16384
    cluster = hexiseq.Cluster.from_dict(cluster_dict(n))
    t0 = time.perf_counter()
    plan = hexiseq.plan(cluster, model="llama3-70b", seq_len=8192 * n, strategy="hexiseq", training=TRAINING)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60.0, f"planning {n} devices took {elapsed:.1f} s"
    check_valid(plan, n)
    assert not plan.stopped_early
    assert plan.num_groups > 1


def test_time_limit_returns_valid_plan_marked_stopped_early():
    n = 4096
    cluster = hexiseq.Cluster.from_dict(cluster_dict(n))
    full = hexiseq.plan(cluster, model="llama3-70b", seq_len=8192 * n, strategy="hexiseq", training=TRAINING)
    t0 = time.perf_counter()
    cut = hexiseq.plan(cluster, model="llama3-70b", seq_len=8192 * n, strategy="hexiseq", training=TRAINING,
                       time_limit_s=0.01)
    elapsed = time.perf_counter() - t0
    check_valid(cut, n)
    assert cut.stopped_early and not full.stopped_early
    assert cut.step_time_s >= full.step_time_s  # the full search keeps every candidate the cut one saw
    assert elapsed < 0.5 * full._search["elapsed_s"] + 1.0, (elapsed, full._search)
    assert "STOPPED EARLY" in cut.explain() and "STOPPED EARLY" not in full.explain()
    # "auto" shares the limit among the strategies and marks the chosen plan too
    auto = hexiseq.plan(cluster, model="llama3-70b", seq_len=8192 * n, training=TRAINING, time_limit_s=0.01)
    check_valid(auto, n)
    assert auto.stopped_early


def test_generous_time_limit_changes_nothing():
    cluster = hexiseq.Cluster.from_dict(cluster_dict(32))
    a = hexiseq.plan(cluster, model="gpt-13b", seq_len="256k", training=TRAINING)
    b = hexiseq.plan(cluster, model="gpt-13b", seq_len="256k", training=TRAINING, time_limit_s=600)
    assert not b.stopped_early
    assert b.step_time_s == a.step_time_s and b.fingerprint == a.fingerprint


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "soon", True])
def test_time_limit_must_be_a_positive_number(bad):
    with pytest.raises(InvalidArgumentError, match="time_limit_s"):
        hexiseq.plan(cluster_dict(16), model="gpt-7b", seq_len="32k", time_limit_s=bad)


# ------------------------------------------------------------------ Ctrl-C

LONG_N = 32768  # planning takes several seconds even on a fast machine: SIGINT lands inside the C search


def interrupt(cmd, ready, env=None):
    """Start cmd, wait until it prints `ready` on stdout, let it run 0.5 s into the plan, send SIGINT; return
    (process, seconds from SIGINT to exit, stdout, stderr). Kills it and fails past a deadline."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            line = proc.stdout.readline()
            assert line, f"exited before {ready!r}: {proc.stderr.read()[-2000:]}"
            if ready in line:
                break
            assert time.monotonic() < deadline, f"no {ready!r} within 120 s"
        time.sleep(0.5)
        assert proc.poll() is None, "the plan finished before it could be interrupted"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        return proc, time.monotonic() - t0, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_ctrl_c_stops_a_long_plan_with_keyboard_interrupt():
    code = ("import sys, time, hexiseq\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_planner_scale import cluster_dict, TRAINING\n"
            f"c = hexiseq.Cluster.from_dict(cluster_dict({LONG_N}))\n"
            "print('planning', flush=True)\n"
            "try:\n"
            f"    hexiseq.plan(c, model='llama3-70b', seq_len=8192 * {LONG_N}, strategy='hexiseq', training=TRAINING)\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted', flush=True)\n"
            "    sys.exit(3)\n"
            "print('finished', flush=True)\n")
    proc, took, out, err = interrupt([sys.executable, "-c", code], "planning",
                                     env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 3, (proc.returncode, out, err[-2000:])
    assert "interrupted" in out and "finished" not in out
    assert took < 5.0, f"the plan stopped {took:.2f} s after SIGINT"


def test_ctrl_c_ends_the_cli_cleanly(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps(cluster_dict(LONG_N)))
    # the cluster file is read and checked before planning; `-u` so the readiness line is not buffered
    # hexiseq is imported before the readiness line, so that a slow import on a loaded machine does not take
    # the SIGINT meant for the planner
    code = ("import runpy, sys, hexiseq.cli\n"
            "print('planning', flush=True)\n"
            f"sys.argv = ['hexiseq', 'plan', {str(path)!r}, '--model', '70b', '--seq-len', '{8192 * LONG_N}', "
            "'--checkpointing', '--strategy', 'hexiseq']\n"
            "runpy.run_module('hexiseq', run_name='__main__')\n")
    proc, took, out, err = interrupt([sys.executable, "-u", "-c", code], "planning",
                                     env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-2000:])
    assert err.strip() == "hexiseq: interrupted", err[-2000:]
    assert "Traceback" not in err
    assert took < 5.0, f"the CLI exited {took:.2f} s after SIGINT"


def test_cli_time_limit_marks_the_plan(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cluster_dict(1024)))
    proc = subprocess.run([sys.executable, "-m", "hexiseq", "plan", str(path), "--model", "70b", "--seq-len", "8m",
                           "--checkpointing", "--time-limit", "0.01"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "STOPPED EARLY" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "hexiseq", "plan", "--time-limit", "0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert bad.returncode == 1 and "--time-limit must be positive" in bad.stderr and "Traceback" not in bad.stderr
