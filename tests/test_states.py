"""Uneven sharding of model states (hexiseq.shard_states): exact against a single-process reference (uneven and
zero shares, activation checkpointing, reduce="sum", the fallback collectives), the gathered parameters freed
between forward and backward, optimizer states only for the local shards, and the contract: bad shares or
ranks that disagree raise the same error on every rank, quickly. One spawn of three Gloo ranks runs every
scenario in turn (tests/workers/states_worker.run_all)."""

import math
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402
from hexiseq.runtime.replicas import holders  # noqa: E402
from hexiseq.states import shard_sizes  # noqa: E402

import dist_worker  # noqa: E402
import states_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD = 3
GOOD = [0.5, 0.3, 0.2]
ZERO = [0.7, 0.3, 0.0]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    t0 = time.monotonic()
    out = dist_worker.spawn(states_worker.run_all, WORLD, (), tmp_path_factory.mktemp("states"), timeout_s=150)
    for rank, (status, report) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
    return {rank: report for rank, (_, report) in out.items()}, time.monotonic() - t0


def _same_on_every_rank(by_rank, name):
    got = {rank: by_rank[rank][name] for rank in by_rank}
    kinds = {kind for kind, _, _ in got.values()}
    messages = {str(value) for _, value, _ in got.values()}
    assert len(kinds) == 1 and len(messages) == 1, f"{name}: ranks differ: {got}"
    return got[0]


# ------------------------------------------------------------------------------------------------ sizes

def test_shard_sizes_by_largest_remainder():
    assert shard_sizes(GOOD, 10) == [5, 3, 2]
    assert shard_sizes(GOOD, 7) == [4, 2, 1]  # quotas 3.5, 2.1, 1.4: the leftover goes to the largest remainder
    assert shard_sizes([0.25, 0.25, 0.25, 0.25], 6) == [2, 2, 1, 1]  # equal remainders: the lower ranks
    assert shard_sizes(ZERO, 10) == [7, 3, 0]
    # the float shares are taken exactly: 0.7 and 0.3 are a little under, so 5 x 0.3 is nearer 2 than 5 x 0.7 is
    # to 4 (remainders 0.4999999999999999722 and 0.4999999999999997780)
    assert shard_sizes(ZERO, 5) == [3, 2, 0]
    assert shard_sizes([0.0, 1.0, 0.0], 9) == [0, 9, 0]
    for total in (0, 1, 2, 3, 822, 10**12 + 7):
        for shares in (GOOD, ZERO, [0.1, 0.2, 0.7], [1 / 3] * 3):
            sizes = shard_sizes(shares, total)
            assert sum(sizes) == total and min(sizes) >= 0, (shares, total, sizes)
            assert all(abs(n - s * total) < 1 for n, s in zip(sizes, shares)), (shares, total, sizes)
            assert all(n == 0 for n, s in zip(sizes, shares) if s == 0)


def test_replica_segments_give_each_element_one_holder_per_replica():
    """The segments the cross-replica sum runs over: replicas [0] and [1, 2, 3] at shares 0.5/0.3/0.2 of 10
    elements give rank 0 three partners in turn; replicas of 2 and 3 ranks cut a 7-element unit at both replicas'
    boundaries; a zero share holds nothing. Every segment has one holder per replica, and the segments tile the
    unit."""
    one_three = ((0,), (1, 2, 3))
    shares = [1.0, 0.5, 0.3, 0.2]
    got = holders([10], lambda u, j: shard_sizes([shares[r] for r in one_three[j]], 10), one_three)
    assert got == [((0, 1), 0, 0, 5), ((0, 2), 0, 5, 8), ((0, 3), 0, 8, 10)]
    two_three = ((0, 1), (2, 3, 4))
    shares = [0.5, 0.5, 0.0, 0.6, 0.4]
    for totals in ([7], [7, 1, 0, 13]):
        got = holders(totals, lambda u, j: shard_sizes([shares[r] for r in two_three[j]], totals[u]), two_three)
        for u, total in enumerate(totals):
            segs = [(lo, hi, ranks) for ranks, v, lo, hi in got if v == u]
            assert [lo for lo, _, _ in segs] == [0, *(hi for _, hi, _ in segs[:-1])][:len(segs)]
            assert (segs[-1][1] if segs else 0) == total
            for lo, hi, ranks in segs:
                assert lo < hi and len(ranks) == 2 and ranks[0] in (0, 1) and ranks[1] in (3, 4), (u, segs)
    got = holders([7], lambda u, j: shard_sizes([shares[r] for r in two_three[j]], 7), two_three)
    assert [(r, lo, hi) for r, _, lo, hi in got] == [((0, 3), 0, 4), ((1, 4), 4, 7)]  # [4, 3] and [0, 4, 3]


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(hexiseq.HexiseqError, match="not initialised"):
        hexiseq.shard_states(states_worker.make_net(), GOOD)


# ------------------------------------------------------------------------------------------------ the contract

# (scenario, the class every rank raises, words its message must hold)
CONTRACT = [
    ("wrong_length", "InvalidArgumentError",
     ["3 of 3 ranks", "shares must hold one share per rank of the group (3), got 2: [0.5, 0.5]"]),
    ("negative", "InvalidArgumentError", ["1 of 3 ranks", "rank 1: shares[2] must be >= 0, got -0.1"]),
    ("sum", "InvalidArgumentError", ["shares must sum to 1", "[0.5, 0.3, 0.3]"]),
    ("nan", "InvalidArgumentError", ["rank 2: shares[0]", "got nan"]),
    ("reduce", "InvalidArgumentError", ["rank 0: reduce must be one of ['mean', 'sum'], got 'max'"]),
    ("tied_across", "InvalidArgumentError", ["head.weight is the same tensor as embed.weight", "another unit"]),
    ("mismatch", "RankMismatchError",
     ["shares", "rank 0: [0.5, 0.3, 0.2]", "rank 1: [0.5, 0.3, 0.2]", "rank 2: [0.4, 0.4, 0.2]"]),
    ("units", "RankMismatchError", ["units[0].numel", "rank 0: 624", "rank 1: 672", "rank 2: 624"]),
    ("seeds", "RankMismatchError", ["ranks disagree about the values of embed.weight", "rank 0: digest",
                                    "rank 1: digest", "rank 2: digest", "they also disagree about the values of"]),
    ("load_seeds", "RankMismatchError", ["ranks disagree about state_dict['embed.weight']", "rank 1: digest", "rank 0: digest",
                                         "they also disagree about state_dict["]),
    ("load_missing", "InvalidArgumentError", ["1 of 3 ranks", "rank 0: state_dict lacks the parameter blocks.1."]),
    ("load_missing_fsdp2", "InvalidArgumentError", ["1 of 3 ranks",
                                                    "rank 0: state_dict lacks the parameter blocks.1."]),
    ("fsdp2_uneven", "InvalidArgumentError", ["3 of 3 ranks", "engine 'fsdp2' needs even shares",
                                              "[0.5, 0.3, 0.2]"]),
    ("replicas_overlap", "InvalidArgumentError", ["3 of 3 ranks", "rank 1 is in replicas[0] and replicas[1]"]),
    ("replicas_missing", "InvalidArgumentError", ["replicas must hold every rank of the group once; ranks [2]"]),
    ("replicas_sum", "InvalidArgumentError", ["the shares of replicas[1] (ranks [1, 2]) must sum to 1",
                                              "[0.5, 0.4]"]),
    ("replicas_mismatch", "RankMismatchError", ["replicas", "rank 0: [[0], [1, 2]]", "rank 2: [[0, 1], [2]]"]),
    ("replicas_fsdp2", "InvalidArgumentError", ["engine 'fsdp2' does not take replicas"]),
    ("engine", "InvalidArgumentError",
     ["1 of 3 ranks", "rank 1: engine must be one of ['auto', 'hexiseq', 'fsdp2'], got 'zero3'"]),
    ("engine_mismatch", "RankMismatchError", ["engine", "rank 0: 'auto', sharding with FSDP2",
                                              "rank 2: 'hexiseq', sharding with its own engine"]),
]


@pytest.mark.parametrize("name,cls,words", CONTRACT, ids=[s[0] for s in CONTRACT])
def test_every_rank_raises_the_same_error(reports, name, cls, words):
    """Bad arguments on one rank or all, and ranks that disagree: the same error on every rank, before the
    group's timeout (10 s) could have expired, never an abort."""
    kind, message, seconds = _same_on_every_rank(reports[0], name)
    assert kind == cls, message
    for w in words:
        assert w in message, f"{name}: the message lacks {w!r}: {message}"
    assert seconds < 8, f"{name} took {seconds:.1f} s (the group timeout is 10 s: a rank waited)"


def test_a_plan_gives_its_state_shares(reports):
    """A plan whose L40S holds less of the states than the H100s: each rank holds its share of the model's
    elements, up to one element per unit of rounding, and together every element once."""
    mine = {}
    for rank, report in reports[0].items():
        assert report["plan_object"][0] == "ok", (rank, report["plan_object"])
        shares, mine[rank], total = report["plan_object"][1]
        assert shares[2] < 1 / 3 < shares[0] == shares[1] and abs(sum(shares) - 1) < 1e-12, shares
        assert abs(mine[rank] - shares[rank] * total) <= 8, (rank, mine[rank], shares[rank] * total)
    assert sum(mine.values()) == total


# ------------------------------------------------------------------------------------------------ exactness

TRAINING = ["uneven", "zero_share", "checkpoint", "checkpoint_reentrant", "reduce_sum", "unused", "fallback",
            "even_fsdp2", "even_fsdp2_sum", "even_own", "clip_uneven", "clip_uneven_inf", "clip_even", "recover",
            "twice", "twice_checkpoint"]


@pytest.mark.parametrize("name", TRAINING)
def test_training_matches_the_single_process_reference(reports, name):
    """Three Adam steps, each rank on its own batch: the full parameters after every step equal those of one
    process that trains on all the batches with the mean (or sum) of their gradients. The scenarios follow the
    contract's failures, so they also show that the ranks stayed in step."""
    for rank, report in sorted(reports[0].items()):
        kind, worst, _ = report[name]
        assert kind == "ok", f"{name}: rank {rank} raised {kind}: {worst}"
        assert worst <= 1e-12, f"{name}: rank {rank}: parameters differ from the reference by {worst:.3g}"


# ------------------------------------------------------------------------------------------------ memory

def test_gathered_parameters_do_not_outlive_the_forward(reports):
    """Between the forward and the backward no gathered flat vector is alive; the backward gathers each unit
    once; from the second step on, each gather but the first of a pass was posted ahead. Without the saved-tensor
    hooks every unit's vector would still be alive (what the first check would
    catch)."""
    for rank, report in sorted(reports[0].items()):
        kind, got, _ = report["memory"]
        assert kind == "ok", (rank, got)
        units = got["units"]
        assert units == 4  # the root (embedding, norm, head) and three blocks
        assert got["alive_after_forward"] == 0, (rank, got)
        assert got["forward_gathers"] == units and got["backward_gathers"] == units, (rank, got)
        assert got["alive_after_backward"] == 0, (rank, got)
        # every gather but each pass's first was posted while the unit before it computed, none in vain
        assert got["forward_ahead"] == units - 1 and got["backward_ahead"] == units - 1, (rank, got)
        assert got["dropped"] == 0, (rank, got)
        kind, without, _ = report["memory_without_hooks"]
        assert kind == "ok", (rank, without)
        assert without["alive_after_forward"] == units and without["backward_gathers"] == 0, (rank, without)


@pytest.mark.parametrize("name,words", [
    ("inplace_activation", ["modified by an inplace operation", "saved at version 0"]),
    ("inplace_shard", ["modified between the forward and the backward"])])
def test_changes_between_forward_and_backward_are_refused(reports, name, words):
    """A saved activation changed in place inside a unit (our saved-tensor hooks take autograd's own check
    away, so they must make it), or the shards changed before the backward gathers them again."""
    kind, message, _ = _same_on_every_rank(reports[0], name)
    assert kind == "RuntimeError", message
    for w in words:
        assert w in message, message


# ------------------------------------------------------------------------------------------------ optimizer

@pytest.mark.parametrize("name,shares", [("optimizer", GOOD), ("optimizer_zero", ZERO)])
def test_optimizer_state_only_for_the_local_shards(reports, name, shares):
    by_rank = reports[0]
    got = {}
    for rank, report in sorted(by_rank.items()):
        kind, value, _ = report[name]
        assert kind == "ok", (rank, value)
        got[rank] = value
    totals = got[0]["totals"]
    assert sum(g["state"] for g in got.values()) == 2 * sum(totals)
    for rank, g in got.items():
        expected = sum(shard_sizes(shares, t)[rank] for t in totals)
        assert g["shard"] == expected and g["state"] == 2 * expected, (rank, g, expected)
        assert abs(g["shard"] - shares[rank] * sum(totals)) < len(totals), (rank, g)


def test_a_forward_without_backward_leaves_fsdp2_sharded(reports):
    """FSDP2 keeps the root unsharded after a forward unless told otherwise: after a first forward under no_grad the
    optimizer would get the root's plain tensors (never trained) and the state dicts would fail."""
    for rank, report in sorted(reports[0].items()):
        kind, value, _ = report["eval_first_fsdp2"]
        assert kind == "ok", (rank, value)
        worst, kinds = value
        assert worst == 0.0 and kinds == ["DTensor"], (rank, value)


@pytest.mark.parametrize("name", ["load_good", "load_good_fsdp2"])
def test_ranks_loading_the_same_weights_agree(reports, name):
    """After the refusals, every rank loads the same full state dict: it is the one gathered back (at uneven
    shares, and at even ones under FSDP2)."""
    for rank, report in sorted(reports[0].items()):
        assert report[name][:2] == ("ok", 0.0), (rank, report[name])


def test_full_state_dict_round_trip(reports):
    for rank, report in sorted(reports[0].items()):
        kind, value, _ = report["roundtrip"]
        assert kind == "ok", (rank, value)
        worst, same_shapes, names = value
        assert worst == 0.0 and same_shapes, (rank, value)
        # the module holds only the shards: one flat parameter per unit
        assert names == ["hexiseq_shard"] + [f"blocks.{i}.hexiseq_shard" for i in range(3)], names
        kind, value, _ = report["roundtrip_fsdp2"]
        assert kind == "ok", (rank, value)
        worst, same_shapes, names = value
        assert worst == 0.0 and same_shapes, (rank, value)
        # FSDP2 at even shares: the parameters keep their names (DTensors), the tied head once
        assert names == [n for n, _ in states_worker.make_net(tied=True).named_parameters()], names


def test_checkpoint_reshards_across_world_sizes_and_shares(tmp_path):
    """hexiseq.checkpoint: save_states at 3 ranks with shares [0.5, 0.3, 0.2] (DCP format, after two Adam steps), load_states at 2 ranks
    with shares [0.25, 0.75] into a model of other weights and a fresh optimizer (its learning rate changed): the
    weights and the optimizer's moments, step and hyper-parameters come back, so the next step equals the one the
    saving job took (1e-12, float64); and a plain unsharded model in one process loads the weights as they were
    saved, through torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    saved = dist_worker.spawn(states_worker.checkpoint_phase, 3, ("save", [0.5, 0.3, 0.2], path), tmp_path, 120)
    for rank, (status, report) in sorted(saved.items()):
        assert status == "ok", f"save rank {rank}: {report}"
    loaded = dist_worker.spawn(states_worker.checkpoint_phase, 2, ("load", [0.25, 0.75], path), tmp_path, 120)
    for rank, (status, report) in sorted(loaded.items()):
        assert status == "ok", f"load rank {rank}: {report}"
    at_save, after = saved[0][1]["at_save"], saved[0][1]["after"]
    for rank, (_, report) in loaded.items():
        assert report["lr"] == 0.05
        assert _diff(report["loaded"], at_save) == 0.0, "the weights as saved, bit for bit"
        assert _diff(report["after"], after) <= 1e-12, "the next step as the saving job took it"
    # a node lost: the survivors' plan (the cluster less the lost device, states shared by memory) gives the shares
    # the checkpoint is loaded at, and the next step is the one the saving job took
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450},
                                                   {"gpu": "L40S", "count": 1, "intra_gbps": 32}],
                                         "inter_node_gbps": 25})
    survivors = hexiseq.plan(cluster.without([0]), model="gpt-3b", seq_len=8192,
                             training=hexiseq.Training(checkpointing=True, state_shares="memory"))
    shares = [float(x) for x in survivors.state_shares]
    assert len(shares) == 2 and abs(shares[0] - shares[1]) > 0.1, shares  # uneven: the H100 holds more
    resumed = dist_worker.spawn(states_worker.checkpoint_phase, 2, ("load", shares, path), tmp_path, 120)
    for rank, (status, report) in sorted(resumed.items()):
        assert status == "ok", f"resume rank {rank}: {report}"
        assert _diff(report["loaded"], at_save) == 0.0 and _diff(report["after"], after) <= 1e-12
    # a different starting point really differs: the comparison above is not vacuous
    assert _diff(states_worker._numpy(states_worker.make_net(seed=5).state_dict()), at_save) > 1e-3
    assert _diff(after, at_save) > 1e-3  # and the step moves the weights
    plain = states_worker.make_net(seed=7)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    assert _diff(states_worker._numpy(plain.state_dict()), at_save) == 0.0


def test_checkpoint_moves_between_fsdp2_and_uneven_shares(tmp_path):
    """Even shares go to FSDP2, uneven ones to hexiseq's own engine; their checkpoints are one format. Saved by
    FSDP2 at 3 even ranks, loaded at 2 ranks with shares [0.25, 0.75] (the elastic case: the survivors' shares are
    seldom even), and saved at 3 uneven ranks, loaded by FSDP2 at 2 even ones: the weights as saved bit for bit,
    the next step as the saving job took it (1e-12, float64); and both saving jobs trained alike (1e-12)."""
    runs = {}
    for name, save_shares, load_shares in (("from_fsdp2", [1 / 3] * 3, [0.25, 0.75]),
                                           ("to_fsdp2", [0.5, 0.3, 0.2], [0.5, 0.5])):
        path = str(tmp_path / name)
        # a layer no step uses in every block: FSDP2 saves no optimizer state for it, the own engine zeros
        saved = dist_worker.spawn(states_worker.checkpoint_phase, 3, ("save", save_shares, path, "never"), tmp_path,
                                  120)
        loaded = dist_worker.spawn(states_worker.checkpoint_phase, 2, ("load", load_shares, path, "never"),
                                   tmp_path, 120)
        for rank, (status, report) in sorted(saved.items()) + sorted(loaded.items()):
            assert status == "ok", f"{name}, rank {rank}: {report}"
        engines = ({r["engine"] for _, r in saved.values()}, {r["engine"] for _, r in loaded.values()})
        assert engines == (({"fsdp2"}, {"hexiseq"}) if name == "from_fsdp2" else ({"hexiseq"}, {"fsdp2"})), engines
        at_save, after = saved[0][1]["at_save"], saved[0][1]["after"]
        for rank, (_, report) in loaded.items():
            assert report["lr"] == 0.05
            assert _diff(report["loaded"], at_save) == 0.0, (name, "the weights as saved, bit for bit")
            assert _diff(report["after"], after) <= 1e-12, (name, "the next step as the saving job took it")
        runs[name] = at_save
    assert _diff(runs["from_fsdp2"], runs["to_fsdp2"]) <= 1e-12


def test_fsdp2_checkpoint_keeps_each_parameters_step_count(tmp_path):
    """FSDP2 counts Adam's steps per parameter: a layer first used in the second step has taken one step fewer than
    the others when the checkpoint is taken. Saved and loaded at 3 even ranks, into other weights and a fresh
    optimizer: the next step exactly as the saving job took it (a count shared per unit gave the layer the others'
    count, another bias correction: 7e-3 off). Loaded at 2 ranks instead, the batches' gradients are summed in
    another order, and this layer's Adam step, one step after its first, carries that rounding to 3e-10."""
    path = str(tmp_path / "late")
    saved = dist_worker.spawn(states_worker.checkpoint_phase, 3, ("save", [1 / 3] * 3, path, "late"), tmp_path, 120)
    loaded = dist_worker.spawn(states_worker.checkpoint_phase, 3, ("load", [1 / 3] * 3, path, "late"), tmp_path, 120)
    for rank, (status, report) in sorted(saved.items()) + sorted(loaded.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report["engine"] == "fsdp2"
    for rank, (_, report) in loaded.items():
        assert _diff(report["loaded"], saved[0][1]["at_save"]) == 0.0
        assert _diff(report["after"], saved[0][1]["after"]) == 0.0


def _diff(a, b):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(abs(a[k].astype("float64") - b[k].astype("float64")).max()) for k in a)


def test_checkpoint_chunks_cover_a_flat_range_exactly():
    """A contiguous range of a row-major tensor as rectangles (what a rank's shard holds of one parameter): every
    element of the range once, nothing else, each rectangle contiguous where its flat range says, at most
    2 ndim - 1 of them."""
    import random

    from hexiseq.runtime.checkpoint import chunks

    rng = random.Random(3)
    for shape in [(7,), (3, 5), (4, 1, 6), (2, 3, 4, 5), (1, 1), (5, 7, 3)]:
        n = math.prod(shape)
        ids = torch.arange(n).view(shape)
        pairs = [(0, n), (0, 0), (n - 1, n)] + [tuple(sorted(rng.sample(range(n + 1), 2))) for _ in range(30)]
        for lo, hi in pairs:
            got = chunks(lo, hi, shape)
            assert len(got) <= max(1, 2 * len(shape) - 1)
            covered = []
            for f0, f1, off, size in got:
                block = ids[tuple(slice(o, o + s) for o, s in zip(off, size))]
                assert block.reshape(-1).tolist() == list(range(f0, f1)), (shape, lo, hi, off, size)
                covered += list(range(f0, f1))
            assert covered == list(range(lo, hi)), (shape, lo, hi)


def test_restarted_ranks_find_their_devices_by_machine(tmp_path):
    """hexiseq.elastic.survivors on 3 Gloo ranks of a saved 4-device cluster whose node-a is half gone: each rank's
    machine (HEXISEQ_HOST) and LOCAL_RANK give its device, the cluster comes back in rank order; a rank on a machine
    the cluster does not name makes every rank raise the same error."""
    got = dist_worker.spawn(states_worker.survivors_phase, 3, ([("node-b", 0), ("node-b", 1), ("node-a", 1)],),
                            tmp_path, 60)
    for rank, (status, devices, nodes) in sorted(got.items()):
        assert status == "ok", f"rank {rank}: {devices}"
        assert devices == [2, 3, 1] and nodes == [("L40S", 2, "node-b"), ("H100-SXM", 1, "node-a")]
    bad = dist_worker.spawn(states_worker.survivors_phase, 2, ([("node-a", 0), ("node-c", 0)],), tmp_path, 60)
    assert {(s, m) for s, m, _ in bad.values()} == {
        ("InvalidArgumentError", "rank 1 runs on machine 'node-c', which the saved cluster does not name (its "
                                 "machines: node-a, node-b; HEXISEQ_HOST overrides the name)")}
