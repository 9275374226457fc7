"""hexiseq.schedule: every plan as the plain data the runtime runs. A plan of one sequence is the one-group, one-pass
schedule; a batch plan's schedule holds every pass's resolved layout; what the runtime reads (head counts, kv tables,
positions, fingerprints) equals what the planner made, and nothing in a schedule refers back to the planner."""

import numpy as np
import pytest

import hexiseq
from hexiseq.planner.batch import BatchPlanner
from hexiseq.schedule import PassLayout, Schedule, as_pass

import dist_plans


def _plain(value):
    """Whether a value is plain data: numbers, text, tuples of them, arrays, PassLayouts and layouts of arrays."""
    if value is None or isinstance(value, (bool, int, float, str, np.integer, np.ndarray)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, PassLayout):
        return all(_plain(getattr(value, f)) for f in PassLayout.__dataclass_fields__)
    if type(value).__name__ == "Layout":
        return all(isinstance(getattr(value, n), np.ndarray) for n in ("group_size", "group_seq", "device", "tokens"))
    return False


@pytest.mark.parametrize("name", ["asymmetric", "scheduler-6", "gqa4-three-groups"])
def test_a_plan_is_the_one_group_one_pass_schedule(name):
    plan = dist_plans.CASES[name]()
    s = plan.schedule
    n = plan.cluster.num_devices
    assert isinstance(s, Schedule) and s.groups == (tuple(range(n)),) and s.passes == (((0,),),)
    assert s.lengths == (plan.seq_len,) and s.fingerprint == plan.fingerprint and s.causal == plan.causal
    pl = s.layout_of(0, 0)
    assert pl is plan.pass_layout is as_pass(plan) is as_pass(s)
    assert (pl.num_devices, pl.seq_len, pl.heads, pl.kv_heads) == (n, plan.seq_len, plan.model.heads,
                                                                   plan.model.kv_heads)
    for name_ in ("kv_lo", "kv_count", "first_lo", "first_count"):
        np.testing.assert_array_equal(getattr(pl, name_), plan.devices[name_])
    for r in range(n):
        np.testing.assert_array_equal(pl.positions(r), plan.positions(r))
        assert pl.tokens(r) == plan.device_row(r)["tokens"]
    assert all(_plain(getattr(s, f)) for f in Schedule.__dataclass_fields__)


def test_a_batch_plans_schedule_holds_every_pass_resolved():
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 2, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    planner = BatchPlanner(cluster, model="gpt-7b")
    for exact in (True, False):
        bp = planner.plan([9000, [3000, 1000], 500, 700, 12000], exact=exact)
        s = bp.schedule
        assert s is bp.schedule and s.fingerprint == bp.fingerprint and s.num_devices == 4
        assert s.groups == tuple(tuple(g) for g in bp.groups) and s.lengths == bp.lengths
        for g in range(len(bp.groups)):
            assert s.sequences_of(g) == bp.sequences_of(g)
            for p in range(len(bp.passes[g])):
                pl = s.layout_of(g, p)
                assert pl is bp.plan_for(g, p).pass_layout and pl.num_devices == len(bp.groups[g])
                assert pl.seq_len == sum(bp.lengths[i] for i in bp.passes[g][p])
        assert all(_plain(getattr(s, f)) for f in Schedule.__dataclass_fields__)
        with pytest.raises(hexiseq.InvalidArgumentError, match="makes 1 pass"):
            s.layout_of(bp.assignment[0], 1)
        with pytest.raises(hexiseq.InvalidArgumentError, match="g must be a group of the schedule"):
            s.layout_of(len(bp.groups))
        if len(bp.groups) > 1:
            with pytest.raises(hexiseq.InvalidArgumentError, match="run it with hexiseq.nn.BatchContext"):
                as_pass(s, "HexiSeqAttention")


def test_what_is_not_a_plan_is_named():
    with pytest.raises(hexiseq.InvalidArgumentError, match="HexiSeqContext must be a hexiseq.Plan .* got dict"):
        as_pass({"layout": None}, "HexiSeqContext")
