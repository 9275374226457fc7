"""Runs the C unit tests (tests/c/Makefile): the optimised build, and in the slow tier the ASan + UBSan build (which
also runs the emulated CUDA kernels' whole case matrix) and the emulated kernels' document masks in full."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None,
                                reason="make and gcc are needed to build the C unit tests")


def _run(target, *variables):
    # -j: the objects compile, and the binaries run, side by side; -O: each run's output comes out whole
    jobs = str(max(2, os.cpu_count() or 1))
    proc = subprocess.run(["make", "-C", "tests/c", "-j", jobs, "-O", target, *variables], cwd=ROOT, capture_output=True,
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
    assert "test_cost" in _run("test")


@pytest.mark.slow
def test_emulated_document_masks_in_full():
    """Every document case of the emulated CUDA kernels, optimised (the default tier runs one of each kind)."""
    assert _run("run-emu-documents", "EMU_QUICK=documents") == ["test_cuda_emu"]


@pytest.mark.slow
def test_c_units_sanitized():
    assert "test_cost" in _run("sanitize")
