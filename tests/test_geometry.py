"""hexiseq.geometry: where a layout puts a sequence's tokens, from the layout's arrays alone. Checked against the
definition (a group's positions are its chunks laid end to end, its members' shares cut from them in member order)
on the distributed tests' plans (unequal groups, parked ranks, members out of device order, zigzag and contiguous
chunking), and a shard/unshard round trip; the runtime and the planner both answer through it."""

import numpy as np
import pytest

import hexiseq
from hexiseq import geometry
from hexiseq.planner.plan import Layout

import dist_plans


def _contiguous_plan():
    lay = Layout([2, 1], [70, 31], [2, 0, 1], [33, 37, 31], [0, 3, 0], [3, 3, 6], chunking="contiguous")
    return hexiseq.evaluate(dist_plans.cluster(2, 1), model=dist_plans.tiny_model(6, 2), seq_len=101, layout=lay)


PLANS = {**dist_plans.CASES, "contiguous": _contiguous_plan}


def _by_definition(plan, rank):
    lay = plan.layout
    slot = int(np.flatnonzero(lay.device == rank)[0])
    bounds = np.concatenate([[0], np.cumsum(lay.group_size)])
    g = int(np.searchsorted(bounds, slot, side="right") - 1)
    spans = [np.arange(p0, p0 + n) for p0, n in geometry.chunks(lay)[g]]
    everything = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
    start = int(lay.tokens[bounds[g]:slot].sum())
    return everything[start:start + int(lay.tokens[slot])]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_rank_holds_its_share_of_its_groups_chunks(name):
    plan = PLANS[name]()
    n = plan.cluster.num_devices
    seen = []
    for r in range(n):
        got = geometry.positions(plan.layout, r, n)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, _by_definition(plan, r))
        np.testing.assert_array_equal(plan.positions(r), got)
        assert geometry.tokens(plan.layout, r, n) == len(got) == plan.device_row(r)["tokens"]
        seen.append(got)
    # every position of the sequence is held exactly once
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(plan.seq_len))
    chunks = geometry.chunks(plan.layout)
    assert [sum(n for _, n in c) for c in chunks] == plan.layout.group_seq.tolist()
    assert all(plan.group_chunks(g) == chunks[g] for g in range(plan.num_groups))


@pytest.mark.parametrize("name", ["asymmetric", "contiguous", "scheduler-6"])
def test_shards_go_back_together(name):
    plan = PLANS[name]()
    n = plan.cluster.num_devices
    x = np.random.default_rng(0).standard_normal((2, plan.seq_len, 3))
    shards = [geometry.take(x, geometry.positions(plan.layout, r, n), 1, plan.seq_len) for r in range(n)]
    for r in range(n):
        np.testing.assert_array_equal(shards[r], plan.shard(x, 1, r))
    np.testing.assert_array_equal(geometry.unshard(plan.layout, shards, -2, n), x)
    np.testing.assert_array_equal(plan.unshard(shards, 1), x)


def test_bad_ranks_and_axes_are_named():
    plan = PLANS["asymmetric"]()
    for rank in (-1, 4, True, 1.0, "0"):
        with pytest.raises(hexiseq.InvalidArgumentError, match=r"rank must be a device id in \[0, 4\)"):
            geometry.positions(plan.layout, rank, 4)
    x = np.zeros((plan.seq_len,))
    with pytest.raises(hexiseq.InvalidArgumentError, match=r"dim must be an axis of x"):
        geometry.take(x, [0], 1, plan.seq_len)
    with pytest.raises(hexiseq.InvalidArgumentError, match="x has 96 positions along dim 0, the plan 97"):
        geometry.take(x[:-1], [0], 0, plan.seq_len)
    with pytest.raises(hexiseq.InvalidArgumentError, match=r"unshard needs one shard per rank \(4\), got 3"):
        geometry.unshard(plan.layout, [x, x, x], 0, 4)
