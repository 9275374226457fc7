"""The test files' shared code, importable by name from every test and every spawned rank: tests/helpers (the
references, the attention backends, the plans the distributed tests run) and tests/workers (what the spawned
ranks run; spawned children inherit this sys.path)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("helpers", "workers"):
    path = os.path.join(HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


# Two tiers. The default run is what a contributor needs on every change: every Python test and the C tests in
# their optimised build. Tests marked `slow` (the C tests under AddressSanitizer and UBSan, with the CUDA
# emulator's whole case matrix; the CUDA kernels compiled by nvcc) run with `--tier slow`, or with the rest under
# `--tier all`. CI runs both tiers.
TIERS = ("default", "slow", "all")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default="default",
                     help="default: every test not marked slow; slow: only those; all: both (default: default)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the second tier (sanitizer builds, nvcc builds): run with --tier slow")


def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if tier == "all":
        return
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        (keep if slow == (tier == "slow") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    tier = config.getoption("--tier")
    other = "--tier slow runs the sanitizer and nvcc builds" if tier == "default" else "--tier all runs every tier"
    return f"hexiseq test tier: {tier} ({other})"
