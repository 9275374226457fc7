"""Stragglers: hexiseq.rebalance.Rebalancer moves token shares off a rank that runs slower than planned, inside the
plan's structure, with no new process group, the same new plan on every rank, and the layer on it exact against
one process (float64, 1e-10)."""

import re

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dist_worker  # noqa: E402
import rebalance_worker  # noqa: E402

import hexiseq  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def expected():
    """The one-process reference every rank of every test here checks its layer against (the same inputs and
    length in all of them), computed once instead of on each of the three ranks of each test."""
    return rebalance_worker.reference()


def test_a_slow_rank_gets_fewer_tokens(tmp_path, expected):
    out = dist_worker.spawn(rebalance_worker.straggler_rebalance, 3, ("ring", False, expected), tmp_path,
                            timeout_s=120)
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


def test_rebalanced_heads_follow_the_attention_rates():
    """Plan.rebalanced(heads=True) hands a head-parallel group's heads out again by its members' attention rates
    (same members, same group), where heads=False keeps them: one group of two devices, one of them with half the
    attention rate; the predicted step is never worse, and every head is still held once."""
    fast = {"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0}
    slow = dict(fast, attn_eff=0.15)  # half the catalog's 0.30
    cluster = hexiseq.Cluster.from_dict({"nodes": [fast, slow], "inter_node_gbps": 300.0})
    even = hexiseq.evaluate(cluster, model="llama-tiny", seq_len=8192, layout={"groups": [
        {"devices": [0, 1], "seq": 8192, "tokens": [4096, 4096], "heads": [4, 4]}]})
    kept = even.rebalanced()
    moved = even.rebalanced(heads=True)
    heads = lambda p: [int(p.devices.head_count[p._slot(r)]) for r in range(2)]  # noqa: E731
    assert heads(kept) == [4, 4]
    assert heads(moved)[0] > heads(moved)[1] and sum(heads(moved)) == 8, heads(moved)
    assert [len(g["devices"]) for g in moved.layout.to_dict()["groups"]] == [2]
    assert moved.step_time_s <= kept.step_time_s * (1 + 1e-12) and moved.step_time_s < even.step_time_s


@pytest.mark.parametrize("structure,replan", [("ulysses", False), ("ring", True)])
def test_heads_and_fresh_plans_under_a_slow_rank(tmp_path, expected, structure, replan):
    """One head-parallel group of the three ranks, rank 2 reporting twice the others' attention time: the
    Rebalancer moves heads off rank 2 (same group, no process group made), and the layer stays exact. With
    replan=True on the ring, the scheduler's plan of the slowed cluster is taken when predicted faster (it may make
    process groups): every rank takes the same one, and the layer on it is exact against one process (float64)."""
    out = dist_worker.spawn(rebalance_worker.straggler_rebalance, 3, (structure, replan, expected), tmp_path,
                            timeout_s=120)
    reports = {}
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        reports[rank] = report
    r0 = reports[0]
    assert r0["event"] is not None
    if structure == "ulysses":
        assert r0["heads_before"] == [3, 3, 2] and r0["heads_after"][2] < 2 and sum(r0["heads_after"]) == 8, r0
        assert r0["structure"] == [3] and r0["groups_made"] == 0
    else:  # the fresh plan gives the slow rank less (here: nothing, it parks it)
        after = r0["event"][1]
        assert after[2] < 0.7 * min(after[0], after[1]), after
    for rank, r in reports.items():
        assert r["event"] == r0["event"] and r["same_plan"] == r0["same_plan"] and r["quiet"] is None, (rank, r)
        for what, e in zip(("out", "dq", "dk", "dv"), r["errors"]):
            assert e <= 1e-10, f"rank {rank}: {what} relative error {e:.3g}"


REFUSALS = [  # (scenario, the class every rank raises, words its message holds)
    ("threshold_differs", "RankMismatchError", ["threshold", "rank 0: 0.1", "rank 1: 0.5"]),
    ("patience_differs", "RankMismatchError", ["patience", "rank 2: 1", "rank 0: 3"]),
    ("threshold_negative", "InvalidArgumentError", ["1 of 3 ranks", "rank 1: threshold must be in (0, 10), got -1"]),
    ("threshold_text", "InvalidArgumentError", ["rank 2: threshold must be a number, got '0.2'"]),
    ("measured_nan", "InvalidArgumentError", ["rank 1: measured_s must be a finite number, got nan"]),
    ("measured_text", "InvalidArgumentError", ["rank 0: measured_s must be a number, got 'fast'"]),
]


def test_rebalancers_that_differ_or_are_bad_on_one_rank_fail_together(tmp_path):
    """Settings that differ between ranks (one rank would re-balance alone, make a context alone and abort) and bad
    settings or measurements on one rank (it would raise alone while the others wait in the next collective): the
    same error on every rank, within seconds (the group's timeout is 20 s); then a good check still runs."""
    out = dist_worker.spawn(rebalance_worker.rebalancer_refusals, 3, (), tmp_path, timeout_s=120)
    for rank, (status, report) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        for name, cls, words in REFUSALS:
            kind, message, seconds = report[name]
            assert kind == cls, (name, rank, kind, message)
            assert message == out[0][1][name][1], (name, "the ranks' messages differ")
            for w in words:
                assert w in message, f"{name}: the message lacks {w!r}: {message}"
            assert seconds < 10, f"{name} took {seconds:.1f} s"
        assert report["good_after"][0] == "ok", report["good_after"]
