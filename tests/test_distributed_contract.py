"""The distributed contract: ranks that disagree about a call, or one rank whose input is bad, make every rank
raise the same HexiseqError naming the field and each rank's value, quickly, never an abort inside a collective
or a hang; afterwards the ranks are still in step. One spawn of three processes runs every scenario in turn
(tests/workers/dist_worker.contract_scenarios), with a deadline."""

import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dist_worker  # noqa: E402
from dist_plans import layout_plan, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

# (scenario, exception class every rank raises, words its message must hold)
MISMATCHES = [
    ("batch", "RankMismatchError", ["batch", "rank 0: 1", "rank 1: 2", "rank 2: 1"]),
    ("head_dim", "RankMismatchError", ["head_dim", "rank 1: 8", "rank 2: 4"]),
    ("dtype", "RankMismatchError", ["dtype", "rank 0: float32", "rank 1: float64"]),
    ("bad_input", "InvalidArgumentError", ["rank 2", "q must be [batch, 15, 6, head_dim]", "got [1, 16, 6, 8]"]),
    ("requires_grad", "RankMismatchError", ["backward", "rank 1: False", "rank 0: True"]),
    ("phase", "RankMismatchError", ["phase", "rank 0: forward", "rank 1: backward"]),
    ("causal", "RankMismatchError", ["causal", "rank 1: False", "rank 0: True"]),
    ("softmax_scale", "RankMismatchError", ["softmax_scale", "rank 2: 0.5", "rank 0: default"]),
    ("documents", "RankMismatchError", ["documents", "rank 0: lengths digest", "rank 1: lengths digest"]),
    ("documents_none", "RankMismatchError", ["documents", "rank 0: lengths digest", "rank 2: none"]),
    ("documents_sum", "InvalidArgumentError", ["1 of 3 ranks", "rank 2", "documents must add up to seq_len=45, "
                                                                      "they add up to 40"]),
    ("documents_type", "InvalidArgumentError", ["3 of 3 ranks", "documents[0] must be an integer, got 10.5"]),
    ("documents_zero", "InvalidArgumentError", ["rank 0", "documents[0] must be in [1, ", "got 0"]),
    ("documents_rows", "InvalidArgumentError", ["documents has 2 lists (one per batch row) but the batch has 1"]),
    ("documents_noncausal", "InvalidArgumentError", ["documents", "need a causal context"]),
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    # an HP group of two (ranks 0 and 1, unequal tokens and heads) and a ring of two groups
    plan = layout_plan((2, 1), tiny_model(6, 2), 45, [
        {"devices": [0, 1], "seq": 30, "tokens": [20, 10], "heads": [4, 2]},
        {"devices": [2], "seq": 15, "tokens": [15], "heads": [6]}])
    t0 = time.monotonic()
    out = dist_worker.spawn(dist_worker.contract_scenarios, 3, (plan.to_json(),), tmp_path_factory.mktemp("c"),
                            timeout_s=120)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
    return {rank: report for rank, (_, report, _) in out.items()}, time.monotonic() - t0


@pytest.mark.parametrize("name,cls,words", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_every_rank_raises_the_same_error(reports, name, cls, words):
    by_rank, _ = reports
    raised = {rank: by_rank[rank][name] for rank in by_rank}
    for rank, (kind, message, seconds) in sorted(raised.items()):
        assert kind == cls, f"{name}: rank {rank} raised {kind}: {message}"
        for w in words:
            assert w in message, f"{name}: rank {rank}'s message lacks {w!r}: {message}"
        assert seconds < 8, f"{name}: rank {rank} took {seconds:.1f} s (the group timeout is 10 s: it waited)"
    assert len({message for _, message, _ in raised.values()}) == 1, f"{name}: messages differ between ranks"


def test_ranks_stay_in_step_after_failures(reports):
    by_rank, elapsed = reports
    for rank, report in sorted(by_rank.items()):
        assert report["good"][0] == "ok" and report["good_after"][0] == "ok", (rank, report["good"],
                                                                               report["good_after"])


def test_subgroups_inherit_the_group_timeout(reports):
    """torch gives a new group its 30-minute default unless told; the HP subgroup must wait no longer than the
    10 s the world was created with."""
    by_rank, _ = reports
    assert by_rank[0]["hp_timeout"][0] == "0:00:10" and by_rank[1]["hp_timeout"][0] == "0:00:10"
    assert by_rank[2]["hp_timeout"][0] is None  # alone in its group: no subgroup


def test_documents_call_runs_on_every_rank(reports):
    """A call with packed documents that every rank agrees on runs (before the failing document scenarios)."""
    by_rank, _ = reports
    for rank, report in sorted(by_rank.items()):
        assert report["documents_good"][0] == "ok", (rank, report["documents_good"])


def test_one_rank_refuses_without_a_collective(tmp_path):
    """A one-rank group agrees with no one: its calls skip the agreement's collective (paid on every call), and a
    bad input still raises the error the ranks of a larger group raise, worded the same way."""
    plan = layout_plan((1,), tiny_model(6, 2), 45, [{"devices": [0], "seq": 45, "tokens": [45], "heads": [6]}])
    out = dist_worker.spawn(dist_worker.contract_scenarios, 1, (plan.to_json(),), tmp_path, timeout_s=60)
    status, report, _ = out[0]
    assert status == "ok", report
    for name in ("good", "batch", "dtype", "documents_good", "good_after"):
        assert report[name][0] == "ok", (name, report[name])
    kind, message, _ = report["bad_input"]
    assert kind == "InvalidArgumentError" and "invalid input on 1 of 1 ranks (rank 0: q must be [batch, 45, 6, " \
        "head_dim]" in message, message
    kind, message, _ = report["documents_type"]
    assert kind == "InvalidArgumentError" and "1 of 1 ranks" in message and "documents[0] must be an integer" in \
        message, message
