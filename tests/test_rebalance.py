"""Stragglers: hexiseq.rebalance.Rebalancer moves token shares off a rank that runs slower than planned, inside the
plan's structure, with no new process group, the same new plan on every rank, and the layer on it exact against
one process (float64, 1e-10)."""

import re

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dist_worker  # noqa: E402
import rebalance_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_a_slow_rank_gets_fewer_tokens(tmp_path):
    out = dist_worker.spawn(rebalance_worker.straggler_rebalance, 3, (), tmp_path, timeout_s=120)
    reports = {}
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        reports[rank] = report
    r0 = reports[0]
    assert r0["before"] == [1000, 1000, 1000]
    assert r0["first"] is None, "one check over the threshold is not enough (patience 2)"
    before, after, reason = r0["event"]
    assert before == r0["before"] and sum(after) == 3000
    assert after[2] < 0.7 * after[0] and after[2] < 0.7 * after[1], after
    # 2x the others' time, over each rank's predicted time (the middle group of a zigzag ring runs its own block as
    # one call, predicted a little faster: 2.16x)
    assert re.search(r"rank 2 ran 2\.\d\dx its planned share", reason), reason
    for rank, r in reports.items():
        assert r["event"] == r0["event"] and r["same_plan"] == r0["same_plan"], rank
        assert r["groups_made"] == 0 and r["owner_updated"] and r["quiet"] is None, r
        for what, e in zip(("out", "dq", "dk", "dv"), r["errors"]):
            assert e <= 1e-10, f"rank {rank}: {what} relative error {e:.3g}"
