"""Runs the C unit tests (tests/c/Makefile): the optimised build, and in the slow tier the ASan + UBSan build (which
also runs the emulated CUDA kernels' whole case matrix).

The optimised binaries are built in the background from the start of the session (tests/conftest.py calls
build_in_background), at the SCHED_IDLE CPU priority: the compilers run only on a core that no test process wants,
so the cores the single-process tests leave idle build them, and the tests beside it run as fast as they would
alone. test_c_units_optimised runs last; it raises what is left of that build to the normal priority, waits for it,
and runs `make test` as before, which builds whatever is missing or out of date (everything, when no background
build ran) and runs every binary. The runs themselves are never in the background: some of them time the planner."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TOOLS = shutil.which("make") is not None and shutil.which("gcc") is not None

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="make and gcc are needed to build the C unit tests")

# -j: the objects compile, and the binaries run, side by side; -O: each run's output comes out whole
JOBS = str(max(2, os.cpu_count() or 1))

_background = None  # the background build's make (a Popen; its pid is its process group's id), until waited for

# runs make at SCHED_IDLE: set here, before exec, so that make and every compiler it starts inherit it
_IDLE_EXEC = ("import os, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
              "os.execvp('make', sys.argv[1:])")


def build_in_background():
    """Start `make build` (the optimised binaries) at SCHED_IDLE in a process group of its own; Linux only (elsewhere
    the test builds them itself, as it always did)."""
    global _background
    if _background is not None or not HAVE_TOOLS or not hasattr(os, "SCHED_IDLE"):
        return
    _background = subprocess.Popen([sys.executable, "-I", "-S", "-c", _IDLE_EXEC, "make", "-C",
                                    os.path.join(ROOT, "tests", "c"), "-j", JOBS, "build"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)


def _group(pgid):
    """The pids of process group `pgid`: make first, then the compilers it runs."""
    pids = [pgid]
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != pgid:
            try:
                if os.getpgid(int(name)) == pgid:
                    pids.append(int(name))
            except OSError:  # ended meanwhile
                pass
    return pids


def finish_background_build(stop=False):
    """Wait for the background build, raised to the normal priority (make first, so the compilers it starts from
    now on inherit it); where raising is not allowed, or with stop=True (the session ends), stop it instead: make
    deletes the target it was making, `make test` makes it again."""
    global _background
    proc, _background = _background, None
    if proc is None or proc.poll() is not None:
        return
    if not stop:
        try:
            for pid in _group(proc.pid):
                try:
                    os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
                except ProcessLookupError:  # ended meanwhile
                    pass
        except PermissionError:  # an unprivileged process may not leave SCHED_IDLE (RLIMIT_NICE)
            stop = True
    if stop:
        _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10  # compilers still ending after make (at SCHED_IDLE they may wait for a core)
    while _group(proc.pid)[1:] and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _run(target):
    proc = subprocess.run(["make", "-C", "tests/c", "-j", JOBS, "-O", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"make {target} failed (rc {proc.returncode}):\n{out[-6000:]}"
    summaries = re.findall(r"^(\d+) passed, (\d+) failed$", out, flags=re.M)
    binaries = re.findall(r"^== (test_\w+)", out, flags=re.M)
    assert binaries, f"make {target} ran no test binary:\n{out[-3000:]}"
    # one summary line per binary, every one with at least one check and zero failures
    assert len(summaries) == len(binaries), f"{len(binaries)} binaries but {len(summaries)} summaries:\n{out[-3000:]}"
    for passed, failed in summaries:
        assert int(passed) > 0 and int(failed) == 0, out[-3000:]
    return binaries


def test_c_units_optimised():
    finish_background_build()
    assert "test_cost" in _run("test")


@pytest.mark.slow
def test_c_units_sanitized():
    assert "test_cost" in _run("sanitize")
