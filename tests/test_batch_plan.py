"""Batch plans (hexiseq.planner.plan_batch): a step's sequences of unequal lengths on groups of unequal devices. The
choice of groups (a cut of the candidate tree) and of the assignment is held against an exhaustive search over
every cut with the exact assignment of each (the C core's branch and bound), on instances small enough for it;
the lower bound against that optimum; bad input against named errors."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

import hexiseq
from hexiseq import _core
from hexiseq.errors import InvalidArgumentError, MemoryFitError
from hexiseq.planner.batch import BatchPlanner, candidate_groups
from hexiseq.planner.batch_kinds import exact_pass

TINY = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "head_dim": 64, "ffn": 2048, "vocab": 32000}


def mixed(*nodes, inter=25.0):
    """A cluster of nodes given as (gpu, count, intra_gbps)."""
    return hexiseq.Cluster.from_dict({"nodes": [{"gpu": g, "count": c, "intra_gbps": bw} for g, c, bw in nodes],
                                      "inter_node_gbps": inter})


def cuts(children, g):
    """Every cut of the subtree under candidate g: [g] itself, or one cut of each child side by side."""
    yield (g,)
    if children[g]:
        for parts in itertools.product(*(list(cuts(children, c)) for c in children[g])):
            yield tuple(x for p in parts for x in p)


def exhaustive(planner, lengths):
    """The best step over every cut of the candidate tree, each with its exact assignment: (step, cut)."""
    cost, fixed, cap = planner.cost_matrix(lengths)
    parent, children = planner.tree()
    roots = [g for g, p in enumerate(parent) if p < 0]
    best = (math.inf, None)
    tokens = np.array([sum(x) if isinstance(x, list) else x for x in lengths], dtype=np.int64)
    for parts in itertools.product(*(list(cuts(children, r)) for r in roots)):
        cut = [x for p in parts for x in p]
        c = cost[cut]
        if np.isinf(c.min(axis=0)).any():
            continue
        assert len(cut) ** len(lengths) <= 200_000  # the core's exact search
        try:  # one pass per group (the small cases fit so)
            group_of, _, info = _core.batch_assign(np.ascontiguousarray(c), fixed[cut], tokens, cap[cut], 0.0)
        except MemoryFitError:
            continue
        assert info["exact"]
        # a group that holds nothing idles (the search charges it f; the plan does not)
        times = [(fixed[g] if (group_of == k).any() else 0.0) + c[k][group_of == k].sum() for k, g in enumerate(cut)]
        step = float(max(times)) + planner.sync_s([planner.groups[g] for g in cut])
        best = min(best, (step, tuple(cut)))
    return best


SMALL = [  # (cluster, lengths): heterogeneous devices, long and short sequences, a packed sequence
    (mixed(("H100-SXM", 4, 450.0)), [65536, 2048, 1024, 30000, 512, 4096]),
    (mixed(("H100-SXM", 2, 450.0), ("L40S", 2, 32.0)), [40000, 3000, 900, 12000, 700, [500, 1500, 64]]),
    (mixed(("A100-80G", 2, 300.0), ("H100-SXM", 2, 450.0), inter=12.5), [100000, 5000, 5000, 2000, 20000]),
]


@pytest.mark.parametrize("case", range(len(SMALL)))
def test_within_two_percent_of_exhaustive(case):
    cluster, lengths = SMALL[case]
    planner = BatchPlanner(cluster, model=TINY)
    got = planner.plan(lengths, reprice=False)  # one search under one pricing: the one the exhaustive search uses
    best, cut = exhaustive(planner, lengths)
    # the search ranks cuts by the linear pricing: hold its best against the exhaustive optimum of that pricing
    assert got.searched_s <= best * 1.02, (got.explain(), best, [planner.groups[g] for g in cut])
    assert got.lower_bound_s <= best * (1 + 1e-9)      # a valid bound is never above the optimum
    assert got.searched_s >= best * (1 - 1e-9)         # and the search's time is one of the searched ones
    assert got.model_step_time_s >= best * (1 - 1e-9)  # the plan kept after exact scoring is priced no lower
    # the exact scoring of the chosen plan's passes stays near its linear pricing on these batches
    assert got.step_time_s == pytest.approx(got.model_step_time_s, rel=0.35)
    # the plan is a partition of the devices, every sequence in one group that holds it
    assert sorted(d for g in got.groups for d in g) == list(range(cluster.num_devices))
    assert len(got.assignment) == len(lengths) and set(got.assignment) <= set(range(len(got.groups)))
    assert all(len(p) == 1 for p in got.passes)
    cost, fixed, cap = planner.cost_matrix(lengths)
    for g, devs in enumerate(got.groups):
        row = planner.groups.index(devs)
        seqs = got.sequences_of(g)
        assert got.model_group_time_s[g] == pytest.approx(fixed[row] + sum(cost[row][i] for i in seqs), rel=1e-12)
        assert got.group_time_s[g] == pytest.approx(got.plan_for(g).step_time_s, rel=1e-12)
        assert sum(got.lengths[i] for i in seqs) <= cap[row]
    # on these instances, re-pricing and learning from exact scores keep a plan scored no slower than the
    # one-search plan, whose round-one finalists they also score (a fresh
    # planner: learning changes its pricing)
    assert BatchPlanner(cluster, model=TINY).plan(lengths).step_time_s <= got.step_time_s * (1 + 1e-9)


def test_long_tail_batch_beats_one_packed_sequence():
    """A long-tailed batch of a 7B model on mixed nodes joined by 25 GB/s: the plan takes several groups, the
    longest sequence a group of several devices, and its step (scored exactly by the cost model) beats today's
    path, the whole batch packed as documents into one sequence over every device (1.27x when written: 3.87 s
    against 4.93 s)."""
    cluster = mixed(("H100-SXM", 8, 450.0), ("A100-80G", 8, 300.0), ("L40S", 8, 32.0))
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in np.clip(rng.lognormal(np.log(3000), 1.2, 48), 64, 60000)]
    training = hexiseq.Training(checkpointing=True)
    p = hexiseq.planner.plan_batch(cluster, model="gpt-7b", lengths=lengths, training=training)
    assert len(p.groups) > 1
    longest = int(np.argmax(lengths))
    assert len(p.groups[p.assignment[longest]]) > 1
    one = hexiseq.plan(cluster, model="gpt-7b", seq_len=sum(lengths), documents=lengths, training=training)
    assert one.step_time_s / p.step_time_s >= 1.15, (p.explain(), one.step_time_s)


def test_candidate_tree_of_a_mixed_cluster():
    c = mixed(("H100-SXM", 4, 450.0), ("H100-SXM", 4, 450.0), ("L40S", 3, 32.0))
    groups = candidate_groups(c)
    assert groups[0] == tuple(range(11))
    assert tuple(range(8)) in groups and (0, 1, 2, 3) in groups and (8, 9, 10) in groups  # run, node
    assert all((d,) in groups for d in range(11))
    planner = BatchPlanner(c, model=TINY)
    parent, children = planner.tree()
    for g, kids in enumerate(children):  # children partition their parent
        if kids:
            assert sorted(d for k in kids for d in groups[k]) == list(groups[g])


def test_plan_for_a_sequence_is_its_groups_layout():
    cluster = mixed(("H100-SXM", 2, 450.0), ("A100-80G", 2, 300.0))
    p = hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[50000, 3000, [1000, 2000]])
    for g in set(p.assignment):
        sub = p.plan_for(g)
        assert sub.cluster.num_devices == len(p.groups[g])
        assert sub.seq_len == sum(p.lengths[i] for i in p.sequences_of(g))
        assert sub.step_time_s == p.group_time_s[g]
    assert p.lengths[2] == 3000 and p.documents[2] == (1000, 2000)
    text = p.explain()
    assert "3 sequences" in text and "bound of the linear pricing: at least" in text and "for any grouping" in text
    assert p.to_dict()["assignment"] == list(p.assignment) and p.to_dict()["scored"] is True
    # each figure named by what it is: the exact step the cost model's score, the search's the linear pricing, and
    # the bound that pricing's (a scored step below it says so); a per-step plan is "priced" throughout
    assert f"step (cost model, each pass scored) {p.step_time_s:.4g} s" in text, text
    assert f"step (priced, linear) {p.model_step_time_s:.4g} s, as the search" in text, text
    assert "step (predicted)" not in text and "time (s, scored)" in text, text
    assert ("the scored step is below it" in text) == (p.step_time_s < p.lower_bound_s), text
    planner = BatchPlanner(cluster, model=TINY)
    assert repr(planner).startswith("BatchPlanner(4 devices (2x H100-SXM, 2x A100-80G), model=") and \
        "candidate groups" in repr(planner)
    quick = planner.plan([5000], exact=False).explain()
    assert quick.startswith("batch plan: 1 sequence (5,000 tokens") and "s scored" not in quick, quick
    assert "s priced (fewer groups" in quick, quick  # the why-line names the per-step step as priced
    assert "step (priced, linear)" in quick and "cost model, each pass scored" not in quick, quick
    assert "time (s, priced)" in quick and "bound of the linear pricing" in quick, quick
    assert planner.plan([5000], exact=False).to_dict()["scored"] is False
    for name in ("exact", "reprice", "split_documents"):
        with pytest.raises(InvalidArgumentError, match=f"{name} must be True or False, got 'no'"):
            planner.plan([5000], **{name: "no"})


def test_user_groups_must_nest_and_cover():
    cluster = mixed(("H100-SXM", 4, 450.0))
    ok = hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4000, 4000], groups=[[0, 1, 2, 3], [0, 1], [2, 3]])
    assert sorted(ok.groups) in ([(0, 1, 2, 3)], [(0, 1), (2, 3)])
    with pytest.raises(InvalidArgumentError, match="overlap"):
        hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4000], groups=[[0, 1, 2, 3], [0, 1], [1, 2]])
    with pytest.raises(InvalidArgumentError, match="cover"):
        hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4000], groups=[[0, 1], [2]])
    with pytest.raises(InvalidArgumentError, match=r"groups\[1\]"):
        hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4000], groups=[[0, 1, 2, 3], [0, 7]])


@pytest.mark.parametrize("lengths,words", [
    ([], "at least one sequence"),
    ([100, 0], r"lengths\[1\] must be between 1"),
    ([100, 2.5], r"lengths\[1\] must be a whole number"),
    ([100, []], r"lengths\[1\] must be a token count or a non-empty list"),
    ([100, [5, -1]], r"lengths\[1\]\[1\] must be between 1"),
    ("1000", "one entry per sequence"),
])
def test_bad_lengths_are_named(lengths, words):
    with pytest.raises(InvalidArgumentError, match=words):
        hexiseq.planner.plan_batch(mixed(("H100-SXM", 2, 450.0)), model=TINY, lengths=lengths)


def test_a_sequence_no_group_holds_is_named():
    with pytest.raises(MemoryFitError, match=r"lengths\[1\]"):
        hexiseq.planner.plan_batch(mixed(("L40S", 1, 32.0)), model=TINY, lengths=[1000, 2_000_000])


def test_training_sequences_must_be_one():
    with pytest.raises(InvalidArgumentError, match="training.sequences must be 1"):
        hexiseq.planner.plan_batch(mixed(("H100-SXM", 2, 450.0)), model=TINY, lengths=[100],
                           training=hexiseq.Training(sequences=4))


def test_per_step_planning_reuses_the_job_pricing():
    """A BatchPlanner made once plans step after step; exact=False keeps the search's best under the linear pricing
    (group_time_s is that pricing) and still hands out each pass's plan on request."""
    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-80G", 4, 300.0))
    planner = BatchPlanner(cluster, model=TINY)
    rng = np.random.default_rng(5)
    for _ in range(3):
        lengths = [int(x) for x in np.clip(rng.lognormal(np.log(2000), 1.2, 40), 16, 50000)]
        quick = planner.plan(lengths, exact=False)
        assert quick.group_time_s == quick.model_group_time_s
        # the kept cut's final assignment searches longer than the ranking did (and its passes are packed for real)
        assert quick.step_time_s <= quick.searched_s * 1.05
        full = planner.plan(lengths)
        assert full.step_time_s == pytest.approx(max(full.group_time_s) + full.sync_s, rel=1e-12)
        g = quick.assignment[0]
        sub = quick.plan_for(g)
        assert sub.seq_len == sum(quick.lengths[i] for i in quick.passes[g][0])


def test_bundles_cover_every_sequence_once():
    from hexiseq.planner.batch import _bundled, _bundles, _Rows

    rng = np.random.default_rng(2)
    raw = rng.random((5, 1300))
    raw[1, :40] = np.inf
    cost = _Rows(raw, np.arange(5))
    total = rng.integers(10, 1000, 1300)
    members = _bundles(cost, 512)
    assert len(members) == 512
    assert sorted(int(i) for m in members for i in m) == list(range(1300))
    tokens, c = _bundled(members, total, cost)
    c = c.full()
    assert tokens.sum() == total.sum() and [int(tokens[k]) for k in range(3)] == [int(total[m].sum()) for m in members[:3]]
    assert np.isclose(c[0].sum(), raw[0].sum())                      # a bundle costs the sum of its members
    held_inf = [any(np.isinf(raw[1, m])) for m in members]            # and cannot go where one of them cannot
    assert list(np.isinf(c[1])) == held_inf
    assert all(len(m) == 1 for m in _bundles(_Rows(raw[:, :300], np.arange(5)), 512))


def test_the_plan_says_why_this_many_groups():
    """The plan keeps, per number of groups, the best step found (scored exactly where a finalist was), and
    explain() sets the chosen count against its neighbours: the chosen count's entry is the plan's own step and no
    scored alternative beats it."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 8, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 8, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    bp = hexiseq.planner.plan_batch(cluster, model="gpt-7b", lengths=[8000] * 12 + [300] * 40)
    alt = {k: (t, scored) for k, t, scored in bp.alternatives}
    n = len(bp.groups)
    assert alt[n] == (pytest.approx(bp.step_time_s), True)
    assert all(t >= bp.step_time_s * (1 - 1e-9) for k, (t, scored) in alt.items() if scored)
    assert len(alt) >= 2
    line = next(x for x in bp.explain().splitlines() if x.strip().startswith("why"))
    assert f"why {n} groups" in line and "scored" in line
    assert bp.to_dict()["alternatives"][0]["groups"] == min(alt)


def test_a_plan_is_resolved_when_made(monkeypatch):
    """Every pass of a plan, exact or per-step, is resolved when the plan is made: asking for a pass's plan, the
    fingerprint or the plan's data afterwards plans nothing (the core's planning entry points fail here if called),
    and a per-step plan's passes are the fastest of their kind's bases re-balanced to them."""
    from hexiseq import _core

    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 4, "intra_gbps": 300.0}]})
    planner = BatchPlanner(cluster, model="gpt-7b")
    plans = [planner.plan([8000, 300, 300, 4000], exact=False), planner.plan([8000, 300, 300, 4000]),
             planner.plan([[6000, 2000], 300, [200, 100], 4000], exact=False, split_documents=True)]

    def planning(*args, **kwargs):
        raise AssertionError("planned after the plan was made")

    for name in ("plan_strategy", "rebalance", "evaluate", "batch_assign", "memory_tokens_bound"):
        monkeypatch.setattr(_core, name, planning)
    for bp in plans:
        for g in range(len(bp.groups)):
            for p in range(len(bp.passes[g])):
                sub = bp.plan_for(g, p)
                assert sub is bp.plan_for(g, p) and isinstance(sub, hexiseq.Plan)
                assert sub.seq_len == sum(bp.lengths[i] for i in bp.passes[g][p])
                assert sub.cluster.num_devices == len(bp.groups[g])
        assert bp.fingerprint == bp.fingerprint and len(bp.fingerprint) == 16
        bp.to_dict(), bp.explain()
    assert [bp.scored for bp in plans] == [False, True, False]
    with pytest.raises(hexiseq.InvalidArgumentError, match="makes 1 pass"):
        plans[0].plan_for(plans[0].assignment[0], 1)
    with pytest.raises(hexiseq.InvalidArgumentError, match="g must be a group"):
        plans[0].plan_for(-1)


def test_plan_runs_a_step_of_several_sequences_as_groups_when_faster():
    """plan() asked for several sequences a step returns the batch plan of them (a BatchPlan: devices in groups, data
    parallel across them) when it is predicted faster than one layout over every device run once per sequence, the
    same plan plan_batch makes; batch=False keeps the one layout, batch=True the groups; one sequence is one Plan."""
    from hexiseq.planner.batch import BatchPlan

    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-80G", 4, 300.0))
    several = hexiseq.Training(sequences=8)
    got = hexiseq.plan(cluster, model=TINY, seq_len=4096, training=several)
    one = hexiseq.plan(cluster, model=TINY, seq_len=4096, training=several, batch=False)
    assert isinstance(one, hexiseq.Plan) and isinstance(got, BatchPlan)
    assert len(got.groups) > 1 and got.step_time_s < one.step_time_s
    same = hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4096] * 8)
    assert (got.groups, got.assignment, got.step_time_s) == (same.groups, same.assignment, same.step_time_s)
    assert isinstance(hexiseq.plan(cluster, model=TINY, seq_len=4096, training=several, batch=True), BatchPlan)
    assert isinstance(hexiseq.plan(cluster, model=TINY, seq_len=4096, batch=True), hexiseq.Plan)  # one sequence
    assert isinstance(got, hexiseq.Plan)  # one type: a plan of several groups is a Plan
    # a door that runs one layout refuses a step of several groups by its shape, with how to run one
    with pytest.raises(InvalidArgumentError, match="HexiSeqContext runs one layout; this plan runs 2 groups of "
                                                   "devices making .* passes: run it with hexiseq.nn.BatchContext"):
        hexiseq.nn.HexiSeqContext(got)


@pytest.mark.parametrize("kwargs,words", [
    ({"batch": "yes"}, "batch must be 'auto', True or False, got 'yes'"),
    ({"batch": 1}, "batch must be 'auto', True or False, got 1"),
    ({"batch": True, "strategy": "ring"}, "batch=True plans groups with the 'auto' strategy"),
    ({"batch": True, "documents": [2048, 2048]}, "and documents"),
])
def test_plan_batch_argument_is_checked(kwargs, words):
    with pytest.raises(InvalidArgumentError, match=words):
        hexiseq.plan(mixed(("H100-SXM", 2, 450.0)), model=TINY, seq_len=4096,
                     training=hexiseq.Training(sequences=2), **kwargs)


@pytest.mark.parametrize("nodes,model,features", [
    ((("H100-SXM", 8, 450.0),), "llama3-8b", "none"),
    ((("H100-SXM", 8, 450.0), ("A100-80G", 8, 300.0)), "llama3-70b", "auto"),
    ((("A100-40G", 4, 300.0), ("L40S", 4, 32.0), ("H800", 8, 400.0)), "llama3-8b", "none"),
])
def test_a_kinds_fit_probes_answer_as_the_full_search(nodes, model, features):
    """A kind's capacity is searched with probes that stop at the scheduler's first plan that fits; at lengths around
    the capacity found they answer what the full search (no time limit) does. (Whether a length fits is not
    monotone in the length: a layout family that fits one length can miss a slightly longer one.)"""
    from hexiseq.planner.batch_kinds import GroupKind
    from hexiseq.planner.plan import plan_one, strategy_of

    cluster, m = mixed(*nodes), hexiseq.Model.from_name_or_path(model)
    training = hexiseq.Training(checkpointing=True, memory_features=features)
    kind = GroupKind(cluster, m, training, True)
    kind._ensure()
    assert kind.longest > 0

    def full(L):
        try:
            plan_one(cluster, m, training, L, True, strategy_of("hexiseq"), None, None)
            return True
        except MemoryFitError:
            return False

    lengths = [int(kind.longest * f) for f in (0.5, 0.95, 0.99, 1.0, 1.003, 1.01, 1.05, 2.0)]
    answers = [kind._fits(L, training) for L in lengths]
    assert answers == [full(L) for L in lengths]
    assert answers[3] and not answers[-1]


@pytest.mark.parametrize("nodes,model,features", [
    ((("H100-SXM", 8, 450.0),), "llama3-8b", "none"),
    ((("H100-SXM", 8, 450.0), ("A100-80G", 8, 300.0)), "llama3-70b", "auto"),
    ((("A100-40G", 4, 300.0), ("L40S", 4, 32.0), ("H800", 8, 400.0)), "llama3-8b", "none"),
])
def test_the_memory_bound_lies_above_every_plan_that_fits(nodes, model, features):
    """The memory bound a kind's search starts from (no length past it fits any layout) lies above the longest the
    scheduler fits, and past it every strategy's plan is refused for memory; on one node of one GPU model it is
    within 0.5% of that longest, so the search ends after one probe there. Under state shares "auto" it is the
    larger of the two settings' bounds."""
    from hexiseq.planner.batch_kinds import GroupKind
    from hexiseq.planner.plan import memory_tokens_bound

    cluster, m = mixed(*nodes), hexiseq.Model.from_name_or_path(model)
    training = hexiseq.Training(checkpointing=True, memory_features=features)
    bound = memory_tokens_bound(cluster, m, training)
    kind = GroupKind(cluster, m, training, True)
    kind._ensure()
    assert 0 < kind.longest <= bound
    if len(nodes) == 1 and features == "none":
        assert kind.longest >= bound * 0.995
    for strategy in ("hexiseq", "ring", "ulysses"):
        with pytest.raises(MemoryFitError):
            hexiseq.plan(cluster, model=m, seq_len=bound + 1, training=training, strategy=strategy)
    auto = dataclasses.replace(training, state_shares="auto")
    assert memory_tokens_bound(cluster, m, auto) == max(
        memory_tokens_bound(cluster, m, dataclasses.replace(training, state_shares=x)) for x in ("even", "memory"))


def test_the_memory_bound_is_not_rounded_below_a_length_that_fits():
    """Memory an exact number of tokens' worth (to the last bits): the bound and the evaluation each round their
    sums their own way, and the bound errs upward (it once came out 293,463 where 293,464 fit)."""
    from hexiseq.planner.plan import memory_tokens_bound

    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 8, "intra_gbps": 450,
                                                    "memory_gib": 76.51194939613342}], "inter_node_gbps": 50})
    m = hexiseq.Model.from_name_or_path("llama3-8b")
    training = hexiseq.Training(checkpointing=True, memory_features="none", reserved_gib=0.1)
    bound = memory_tokens_bound(cluster, m, training)
    assert hexiseq.plan(cluster, model=m, seq_len=293464, training=training, strategy="ulysses").fits
    assert bound >= 293464
    with pytest.raises(MemoryFitError):
        hexiseq.plan(cluster, model=m, seq_len=bound + 1, training=training, strategy="ulysses")


def test_kinds_priced_side_by_side_give_the_same_plans():
    """The kinds of group are priced on several threads (the core plans without the GIL); every answer is the
    kind's own and clock-free, so the plans, exact and per step, are those of one thread."""
    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-40G", 4, 300.0), ("L40S", 4, 32.0), ("H800", 4, 400.0))
    lengths = [65536, 32768, 16384, 9000, 4096, 4096, 2048, 1500, 1024, 700]
    plans = []
    for threads in (1, 3):
        planner = BatchPlanner(cluster, model="llama3-8b", threads=threads)
        assert planner.threads == threads
        plans.append((planner.plan(lengths), planner.plan(lengths[::-1], exact=False)))
    for one, many in zip(*plans):
        assert (one.groups, one.assignment, one.passes) == (many.groups, many.assignment, many.passes)
        assert one.step_time_s == many.step_time_s
    assert BatchPlanner(cluster, model="llama3-8b").threads >= 1
    with pytest.raises(InvalidArgumentError, match=r"threads must be in \[1, 1024\], got 0"):
        BatchPlanner(cluster, model="llama3-8b", threads=0)


def test_passes_are_priced_as_whole_sequences_pack():
    """Three sequences of 128 tokens, two groups holding 250 a pass, 10 s a pass, a sequence 1 s on group 0 and 5 s
    on group 1. Seen in aggregate (2 passes x 250), group 0 takes all three for 2 x 10 + 3 = 23 s; but whole
    sequences pack into 3 passes there (33 s). Priced as they pack, two on group 0 (2 passes, 22 s) and one on
    group 1 (15 s) is the step: 22 s."""
    planner = BatchPlanner(mixed(("H100-SXM", 2, 450.0)), model=TINY)
    total = np.array([128, 128, 128], dtype=np.int64)
    cost = np.array([[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    fixed, cap = np.array([10.0, 10.0]), np.array([250, 250], dtype=np.int64)
    group_of, times, _, passes = planner._assign(total, cost, fixed, cap, [0, 1], 0.0, quick=False)
    assert sorted(np.bincount(group_of, minlength=2).tolist()) == [1, 2] and np.bincount(group_of)[0] == 2
    assert times.tolist() == [22.0, 15.0]


def test_exact_plans_also_try_passes_as_long_as_the_memory_features_allow():
    """Two sequences of 150K of Llama-3-8B on 16 A100-40G: without the memory features the whole cluster holds
    275K a pass, so the linear pricing runs them in two passes there (or one on each node, with the features each
    node needs for 150K). One pass of both with the features is scored faster than two passes of the same group,
    and the exact plan finds it."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "A100-40G", "count": 8, "intra_gbps": 300.0}] * 2,
                                         "inter_node_gbps": 25.0})
    planner = BatchPlanner(cluster, model="llama3-8b", training=hexiseq.Training(checkpointing=True))
    bp = planner.plan([150000, 150000])
    root = planner._kind[planner._roots[0]]
    assert root.anchor < 300000 <= root.longest
    two = 2 * exact_pass(root, [150000]).step_time_s
    assert len(bp.groups) == 1 and bp.passes == (((0, 1),),)
    assert bp.step_time_s < two


def test_a_pass_near_capacity_costs_in_proportion_to_its_sequences():
    """Sequences of 2,048 tokens of gpt-7b packed into one pass of a group of 8 H100 and 8 A100-80G, up to 99% of
    what a pass holds: each costs the same time to 1%. The scheduler's first search water-fills the devices' token
    shares under their memory without features; a layout that fitted only because a device used one (a tiled loss,
    an offload) was taken for one with room to spare, the search with the features' memory skipped, and the
    devices held back by the featureless caps left short (560 sequences: 28.5 s where 16.8 s fits, 51 ms a
    sequence instead of 30)."""
    cluster = mixed(("H100-SXM", 8, 450.0), ("A100-80G", 8, 300.0))
    planner = BatchPlanner(cluster, model="gpt-7b", training=hexiseq.Training(checkpointing=True),
                           groups=[tuple(range(16))])
    bp = planner.plan([2048] * 560)
    assert 0.75 * bp.capacity[0] < 560 * 2048 <= bp.capacity[0]
    per = {n: exact_pass(planner._kind[0], [2048] * n).step_time_s / n for n in (300, 450, 560, 620)}
    assert max(per.values()) < 1.01 * min(per.values()), per
    # the exact plan keeps one pass or two, whichever is faster; each pass's plan is the group's own
    assert sorted(i for p in bp.passes[0] for i in p) == list(range(560))
    times = [bp.plan_for(0, p).step_time_s for p in range(len(bp.passes[0]))]
    assert all(bp.plan_for(0, p).seq_len == 2048 * len(bp.passes[0][p]) for p in range(len(bp.passes[0])))
    assert bp.group_time_s[0] == pytest.approx(sum(times), rel=1e-12)
    assert bp.step_time_s <= 560 * per[560] * (1 + 1e-9) + bp.sync_s


def test_split_documents_lets_a_packed_sequences_documents_go_to_different_groups():
    """One packed sequence of twelve documents and two short sequences on 16 mixed devices: kept whole, the packed
    sequence runs on one group; split at its documents, they spread over groups and the step is shorter. The split
    plan is the plan of the documents as sequences of their own, `origin` maps each back, `split_batch` cuts a
    batch's tensors at the boundaries and `per_caller_sequence` sums figures back per sequence of the batch."""
    torch = pytest.importorskip("torch")
    cluster = mixed(("H100-SXM", 8, 450.0), ("A100-80G", 8, 300.0))
    docs = [8192, 4096, 12000, 6000, 2048, 9000, 7000, 3000, 16000, 5000, 4000, 10000]
    lengths = [docs, 6000, 3000]
    planner = BatchPlanner(cluster, model=TINY)  # a fresh planner each: exact plans teach the next ones
    whole = BatchPlanner(cluster, model=TINY).plan(lengths)
    split = planner.plan(lengths, split_documents=True)
    assert whole.origin is None and len(whole.lengths) == 3
    assert split.origin == tuple((0, j) for j in range(12)) + ((1, 0), (2, 0))
    assert list(split.lengths) == docs + [6000, 3000] and all(d is None for d in split.documents)
    assert len({split.assignment[k] for k in range(12)}) > 1
    assert split.step_time_s < whole.step_time_s
    flat = BatchPlanner(cluster, model=TINY).plan(docs + [6000, 3000])
    assert (flat.groups, flat.assignment) == (split.groups, split.assignment)

    batch = [torch.arange(sum(docs)), torch.arange(6000) + 10 ** 6, torch.arange(3000) + 2 * 10 ** 6]
    pieces = split.split_batch(batch)
    assert [len(p) for p in pieces] == list(split.lengths)
    assert torch.equal(torch.cat(pieces[:12]), batch[0]) and torch.equal(pieces[12], batch[1])
    assert torch.equal(pieces[2], batch[0][8192 + 4096:8192 + 4096 + 12000])
    assert torch.equal(pieces[13], batch[2])
    assert split.per_caller_sequence([float(L) for L in split.lengths]) == [float(sum(docs)), 6000.0, 3000.0]
    assert whole.split_batch(batch) == batch and whole.per_caller_sequence([1, 2, 3]) == [1, 2, 3]
    two_d = [x[None, :].repeat(2, 1) for x in batch]  # tokens along dim 1
    assert torch.equal(split.split_batch(two_d, dim=1)[3], two_d[0][:, 24288:30288])
    # a plan that lists the documents in another order (as a plan file may) cuts each at its own place
    listed = dataclasses.replace(split, origin=split.origin[::-1], lengths=tuple(split.lengths)[::-1])
    assert all(torch.equal(a, b) for a, b in zip(listed.split_batch(batch), pieces[::-1]))
    # a batch that is not the one the plan was made for is refused by name, never cut short or padded
    for bad, words in (([batch[0][:-7], batch[1], batch[2]], f"batch\\[0\\] holds {sum(docs) - 7} tokens along dim 0; "
                                                             f"the plan was made for {sum(docs)}"),
                       ([torch.cat([batch[0], batch[0][:5]]), batch[1], batch[2]], "batch\\[0\\] holds"),
                       (batch[:2], "batch must hold the 3 sequence\\(s\\) the plan was made for, one tensor each, got 2"),
                       ([batch[0], list(range(6000)), batch[2]], "batch\\[1\\] must be a tensor or array"),
                       ("abc", "got str")):
        for plan in (split, whole):
            with pytest.raises(InvalidArgumentError, match=words):
                plan.split_batch(bad)
    with pytest.raises(InvalidArgumentError, match="dimension 2"):
        split.split_batch(two_d, dim=2)
    for plan in (split, whole):
        with pytest.raises(InvalidArgumentError, match=f"one figure per sequence of the plan \\({len(plan.lengths)}"):
            plan.per_caller_sequence([1.0] * (len(plan.lengths) - 1))
    with pytest.raises(InvalidArgumentError, match="split_documents must be True or False, got 'yes'"):
        planner.plan(lengths, split_documents="yes")
    # nothing to split: the plain plan
    assert planner.plan([4096, 2048], split_documents=True).origin is None


def test_an_exact_plan_stops_at_its_time_limit_with_the_best_cut_scored():
    """time_limit_s bounds the exact scoring: past it no further finalist cut is scored, and the plan says it
    stopped early (in explain() and to_dict()); without a limit it does not."""
    cluster = mixed(("H100-SXM", 2, 450.0), ("A100-80G", 2, 300.0))
    planner = BatchPlanner(cluster, model=TINY)
    lengths = [3000, 2500, 2000, 1500, 1000, 800, 600, 400, 300, 200]
    full = planner.plan(lengths)
    assert not full.stopped_early and "STOPPED EARLY" not in full.explain()
    assert "stopped_early" not in full.to_dict()
    quick = planner.plan(lengths, time_limit_s=1e-6)
    assert quick.stopped_early and "STOPPED EARLY at the time limit" in quick.explain()
    assert quick.to_dict()["stopped_early"] is True
    assert len(quick.assignment) == len(lengths) and set(quick.assignment) <= set(range(len(quick.groups)))
    assert sorted(i for ps in quick.passes for p in ps for i in p) == list(range(len(lengths)))


def test_a_fast_group_takes_more_passes_than_slow_ones():
    """Many short sequences fill several passes of every group: a group of faster GPUs must be given more passes
    than the slower groups (one pass count for all held the H100 group to the A100 groups' count, 83.2 s against
    73.9 s for this batch), so the groups' times come out balanced."""
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(100, 4001, 2000)]
    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-80G", 4, 300.0))
    bp = BatchPlanner(cluster, model="gpt-7b").plan(lengths, exact=False)
    times = bp.model_group_time_s
    assert len(times) > 1 and max(times) / min(times) < 1.03, (times, [len(p) for p in bp.passes])
    assert bp.step_time_s < 0.95 * 83.2, bp.step_time_s


def test_one_plan_type_groups_by_passes_and_its_layout_asked_of_a_pass():
    """Whatever the planner returns is a hexiseq.Plan, a step as groups x passes: a plan of one layout is the
    one-group case (its pass the plan itself); a plan of several groups answers the layout's questions per pass and,
    asked of the whole step, raises a named error that is also an AttributeError (hasattr is False)."""
    from hexiseq.planner.batch_plan import ONE_LAYOUT, NotOneLayoutError

    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-80G", 4, 300.0))
    one = hexiseq.plan(cluster, model=TINY, seq_len=4096)
    assert one.groups == (tuple(range(8)),) and one.passes == (((0,),),) and one.lengths == (4096,)
    assert one.assignment == (0,) and one.group_time_s == (one.step_time_s,) and one.sync_s == 0.0
    assert one.plan_for(0, 0) is one and one.one_layout() is one
    assert one.sequences_of(0) == [0] and one.passes_of(0) == [[0]]
    for g, p in ((1, 0), (0, 1), (-1, 0), (True, 0)):
        with pytest.raises(InvalidArgumentError, match="group|pass"):
            one.plan_for(g, p)
    got = hexiseq.planner.plan_batch(cluster, model=TINY, lengths=[4096] * 5 + [1024] * 3)
    assert isinstance(got, hexiseq.Plan) and len(got.groups) > 1
    for name in ONE_LAYOUT:
        assert not hasattr(got, name), name
        with pytest.raises(NotOneLayoutError, match=f"plan.{name} is of one layout; this plan runs "
                                                    f"{len(got.groups)} groups of devices making .*plan_for"):
            getattr(got, name)
    with pytest.raises(InvalidArgumentError, match="patch_model runs one layout.*BatchContext"):
        got.one_layout("patch_model")
    p = got.plan_for(1, 0)
    assert isinstance(p, hexiseq.Plan) and p.seq_len == sum(got.lengths[i] for i in got.passes[1][0])
    # one group making one pass: a step every door of one layout runs, through that pass
    single = BatchPlanner(cluster, model=TINY, groups=[list(range(8))]).plan([4096])
    assert single.one_layout() is single.plan_for(0, 0) and single.pass_layout is single.plan_for(0, 0).pass_layout


def test_a_plan_of_several_groups_goes_to_json_and_back_in_the_one_format():
    """to_json writes a plan of several groups in the format of a plan of one layout ("hexiseq-plan"), with every
    pass's layout, so Plan.from_json rebuilds it without planning: same fingerprint, figures, schedule; a file whose
    contents were changed fails on its fingerprint or names the field that is wrong."""
    import json

    cluster = mixed(("H100-SXM", 4, 450.0), ("A100-80G", 4, 300.0))
    for exact, lengths in ((True, [4096] * 5 + [1024] * 3), (False, [[1024, 3072], 2048, 4096, 512])):
        got = hexiseq.planner.plan_batch(cluster, model=TINY, lengths=lengths, exact=exact)
        text = got.to_json()
        doc = json.loads(text)
        assert doc["format"] == "hexiseq-plan" and doc["fingerprint"] == got.fingerprint
        back = hexiseq.Plan.from_json(text)
        assert type(back) is type(got) and back == got and back.fingerprint == got.fingerprint
        assert back.schedule.fingerprint == got.schedule.fingerprint
        assert [[p.layout for p in ps] for ps in back.pass_plans] == [[p.layout for p in ps] for ps in got.pass_plans]
        assert back.explain() == got.explain()
        changed = json.loads(text)
        changed["lengths"][0] += 1
        with pytest.raises(InvalidArgumentError, match="seq_len is"):
            hexiseq.Plan.from_json(json.dumps(changed))
        changed = json.loads(text)
        changed["pass_plans"][0][0]["layout"]["groups"][0]["devices"].reverse()  # another valid layout
        with pytest.raises(InvalidArgumentError, match="fingerprint mismatch"):
            hexiseq.Plan.from_json(json.dumps(changed))
        for field, value, words in (("groups", [[0, 1]], "each of the cluster's 8 devices once"),
                                    ("assignment", [0], "place each sequence"),
                                    ("causal", 1, "causal must be true or false"),
                                    ("pass_plans", [], "one plan per pass")):
            changed = json.loads(text)
            changed[field] = value
            with pytest.raises(InvalidArgumentError, match=words):
                hexiseq.Plan.from_json(json.dumps(changed))
