"""hexiseq.hf: a transformers causal LM patched to run HexiSeq attention on a token shard, across 4 Gloo processes
under an asymmetric plan, checked against the unpatched model on the full sequence in one process.

Tolerances (float64 model):
* loss 1e-10 relative to the float64 reference loss (transformers' formula, mean cross entropy over the shifted
  positions, evaluated on float64 logits): the distributed loss sums the same per-token terms in another order and
  its attention sums the same products in another order (blocks, LSE merges), a few ulps (~1e-16) amplified by two
  layers; observed ~1e-15.
* every parameter's gradient, summed over the ranks, 1e-8 relative to the largest entry of the reference gradient
  of that parameter: the backward pass adds the per-rank contributions of ~60 tokens and the ring's dK/dV
  accumulators in a different order, so a few hundred roundings of 1e-16 at most, and small gradient entries of a
  parameter are measured against its largest; 1e-8 leaves a wide margin over the ~1e-14 observed while any
  real error (a wrong position, a missing contribution from another rank) shows up at 1e-3 or more.
* against transformers' own `model(input_ids, labels=input_ids).loss`: 1e-6, because transformers casts the
  logits to float32 before the cross entropy even for a float64 model (loss_utils.ForCausalLMLoss)."""


import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers",
                                   reason="hexiseq.hf tests need transformers (pip install transformers)")
mp = pytest.importorskip("torch.multiprocessing")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402

import dist_worker  # noqa: E402
from errcheck import same_error_on_every_rank  # noqa: E402
import hf_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def spawn(fn, world, args, tmp_path, timeout_s=90):
    return dist_worker.spawn(fn, world, args, tmp_path, timeout_s)


def asymmetric_plan():
    """4 ranks on two unequal nodes; groups of 3 and 1 with unequal sequence shares (39 + 22 = 61 tokens, not
    divisible by 4), token shares 20/1/18, head shares 3/0/5 of 8 query heads with 2 kv heads (GQA 4:1: head
    ranges not aligned to kv heads, a kv head split between two ranks, a rank with no heads), members out of
    device order."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    model = hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128, vocab=97, gated_mlp=True)
    return hexiseq.evaluate(cluster, model=model, seq_len=61, layout={"groups": [
        {"devices": [0, 2, 1], "seq": 39, "tokens": [20, 1, 18], "heads": [3, 0, 5]},
        {"devices": [3], "seq": 22, "tokens": [22], "heads": [8]}]})


# the first one also runs the error and unpatch checks; qwen2 (q/k/v biases) runs with gradient checkpointing
FAMILIES = ("llama", "mistral", "qwen2")


@pytest.fixture(scope="module")
def asymmetric_run(tmp_path_factory):
    """Every family through the asymmetric plan, batch 2, with the error and unpatch checks: one spawn, which the
    packed-documents test below reads too."""
    plan = asymmetric_plan()
    world = plan.cluster.num_devices
    assert world == 4 and plan.seq_len % world != 0
    return spawn(hf_worker.check_models, world, (plan.to_json(), FAMILIES, 2, True), tmp_path_factory.mktemp("a"))


def parked_plan():
    """2 ranks, the second parked (no tokens, no heads), 61 tokens."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    model = hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128, vocab=97, gated_mlp=True)
    plan = hexiseq.evaluate(cluster, model=model, seq_len=61, layout={"groups": [
        {"devices": [0, 1], "seq": 61, "tokens": [61, 0], "heads": [8, 0]}]})
    assert len(plan.positions(1)) == 0
    return plan


@pytest.fixture(scope="module")
def parked_run(tmp_path_factory):
    """Every family through a plan that parks a device (no tokens, no heads), batch 1: one spawn."""
    return spawn(hf_worker.check_models, 2, (parked_plan().to_json(), FAMILIES, 1, False),
                 tmp_path_factory.mktemp("p"))


def test_patched_models_match_full_sequence(asymmetric_run):
    out = asymmetric_run
    for rank, (status, per_family) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {per_family}"
        for family in FAMILIES:
            m = per_family[family]
            where = f"{family} rank {rank}"
            assert m["attn_impl"] == "hexiseq"
            assert m["loss_dtype"] == "torch.float64"
            assert m["loss_vs_ref64"] <= 1e-10, f"{where}: loss {m['loss_vs_ref64']:.3g}"
            assert m["loss_vs_hf"] <= 1e-6, f"{where}: vs transformers' loss {m['loss_vs_hf']:.3g}"
            assert m["hf_loss_vs_ref64"] <= 1e-6
            assert m["logits"] <= 1e-10, f"{where}: logits {m['logits']:.3g}"
            assert not m["grad_missing"], f"{where}: no gradient for {m['grad_missing']}"
            assert m["n_params"] >= 20
            assert m["checkpointing"] == (family == "qwen2")
            assert m["grad"] <= 1e-8, f"{where}: gradient of {m['grad_worst_param']} off by {m['grad']:.3g}"
        m = per_family[FAMILIES[0]]
        assert m["no_mask_logits"] <= 1e-10
        for key in ("err_padding", "err_positions", "err_heads"):
            assert m[key] is True, f"rank {rank}: {key}: {m[key]}"
        assert m["unpatched_impl"] == "sdpa"
        assert m["unpatched_logits"] <= 1e-12


# Sliding windows, soft-capping and sinks. Gemma's RMSNorm computes in float32 even in a float64 model (q_norm,
# k_norm: their weights' gradients differ by float32 roundings), and gemma2's reference is transformers' eager
# attention (it has no SDPA path), whose softmax also runs in float32: their bounds are float32's. gpt-oss runs in
# float32 (its experts' grouped matmul takes no float64; eager attention too): 1e-5.
VARIANT_FAMILIES = {"mistral-window": 1e-10, "gemma3": 1e-6, "gemma2": 1e-6, "gpt_oss": 1e-5}


def test_windowed_softcapped_and_sink_models_match_full_sequence(tmp_path):
    """Mistral with a window shorter than the sequence, Gemma 3 (a sliding and a global layer), Gemma 2
    (soft-capped logits too) and gpt-oss (sink logits, experts) through the adapter on the asymmetric plan, batch 2:
    logits, loss and every parameter's gradient (the sinks' included) against the unpatched model on the full
    sequence, packed documents against each document alone."""
    plan = asymmetric_plan()
    out = spawn(hf_worker.check_models, plan.cluster.num_devices, (plan.to_json(), tuple(VARIANT_FAMILIES), 2, False),
                tmp_path, timeout_s=150)
    for rank, (status, per_family) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {per_family}"
        for family, tol in VARIANT_FAMILIES.items():
            m = per_family[family]
            where = f"{family} rank {rank}"
            assert m["loss_vs_ref64"] <= tol, f"{where}: loss {m['loss_vs_ref64']:.3g}"
            assert m["logits"] <= tol, f"{where}: logits {m['logits']:.3g}"
            assert not m["grad_missing"], f"{where}: no gradient for {m['grad_missing']}"
            assert m["grad"] <= 100 * tol, f"{where}: gradient of {m['grad_worst_param']} off by {m['grad']:.3g}"
            assert not m["packed_grad_missing"], f"{where}: packed: no gradient for {m['packed_grad_missing']}"
            for key in ("packed_logits", "packed_loss", "packed_grad"):
                assert m[key] <= 100 * tol, f"{where}: {key} {m[key]:.3g}"


def test_parked_rank_runs_every_model(parked_run):
    """A plan that parks a device (no tokens, no heads: what the scheduler does with a slow device on a short
    sequence) runs every supported model: the parked rank runs the model on its empty shard (shard_inputs gives it
    0 tokens, as plan.shard does, and it gets logits of 0 tokens) and takes part in the collectives, and the result
    equals the full-sequence reference."""
    out = parked_run
    for rank, (status, per_family) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {per_family}"
        for family in FAMILIES:
            m = per_family[family]
            where = f"{family} rank {rank}"
            assert m["loss_vs_ref64"] <= 1e-10, f"{where}: loss {m['loss_vs_ref64']:.3g}"
            assert not m["grad_missing"], f"{where}: no gradient for {m['grad_missing']}"
            assert m["grad"] <= 1e-8, f"{where}: gradient of {m['grad_worst_param']} off by {m['grad']:.3g}"
            assert m["logits"] <= 1e-10, f"{where}: logits {m['logits']:.3g}"   # inf: not the plan's shape


def test_patch_leaves_the_config_alone_and_takes_the_plans_shards(tmp_path):
    """patch_model gives the model its own config: a model built afterwards from the caller's config object (the
    reference, an AutoModelForCausalLM) runs plainly, with the caller's attention implementation and use_cache. The
    patched model, fed plan.shard and plan.positions as patch_model's docstring writes it, runs a plan that parks a
    rank (its shard and its logits hold 0 tokens, as shard_inputs gives them): loss from the logits and from the
    hidden states and summed gradients equal the reference's; unpatched, it is the reference again."""
    plan = parked_plan()
    out = spawn(hf_worker.check_own_config, 2, (plan.to_json(),), tmp_path)
    for rank, (status, m) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {m}"
        assert m["cfg"] == ("sdpa", True), m
        assert m["patched"] == ("hexiseq", False) and m["modules_share_copy"], m
        assert m["fresh"] == ("sdpa", "sdpa"), m
        tokens = len(plan.positions(rank))
        assert m["tokens"] == tokens and m["hidden_shape"] == [1, tokens, 64], m
        assert m["shard_inputs"] == [[1, tokens]] * 3, m
        assert m["logits"] <= 1e-10, f"rank {rank}: logits {m['logits']:.3g}"
        for key in ("loss", "hidden_loss"):
            assert m[key] <= 1e-10, f"rank {rank}: {key} {m[key]:.3g}"
        for key in ("grad", "hidden_grad"):
            assert not m[f"{key}_missing"], f"rank {rank}: no {key} for {m[f'{key}_missing']}"
            assert m[key] <= 1e-8, f"rank {rank}: {key} off by {m[key]:.3g}"
        assert m["unpatched"] == ("sdpa", True, "sdpa", True), m
        assert m["unpatched_logits"] <= 1e-12, m


def test_every_sharding_call_gives_a_parked_rank_its_empty_shard():
    """plan.shard and plan.positions, shard_inputs (with and without packed position_ids) and a batch pass's shard,
    labels and hf_inputs agree on a parked rank: 0 tokens each (one process, no torch.distributed: shard_inputs
    then checks alone)."""
    from types import SimpleNamespace

    from hexiseq.hf import shard_inputs
    from hexiseq.nn import Pass

    plan = parked_plan()
    ids = torch.arange(61)[None]
    pos = torch.cat([torch.arange(n) for n in hf_worker.PACKED[0]])[None]
    for rank, tokens in ((0, 61), (1, 0)):
        assert len(plan.positions(rank)) == tokens and plan.shard(ids, 1, rank).shape == (1, tokens)
        for got in (shard_inputs(ids, plan, rank), shard_inputs(ids, plan, rank, position_ids=pos)):
            assert {k: tuple(got[k].shape) for k in ("input_ids", "position_ids", "attention_mask")} == \
                {"input_ids": (1, tokens), "position_ids": (1, tokens), "attention_mask": (1, tokens)}
            assert torch.equal(got["input_ids"], plan.shard(ids, 1, rank))
        pass_ = Pass(None, plan, None, [0], SimpleNamespace(documents=[None], lengths=[61]), rank)
        assert pass_.tokens == tokens and pass_.shard(ids, 1).shape == (1, tokens)
        assert pass_.labels([ids[0]]).shape == (1, tokens)
        assert {k: tuple(v.shape) for k, v in pass_.hf_inputs([ids[0]]).items()} == \
            {"input_ids": (1, tokens), "position_ids": (1, tokens), "attention_mask": (1, tokens)}


def test_importable_without_distributed_setup():
    import hexiseq.hf as hf

    assert callable(hf.patch_model) and callable(hf.sharded_causal_lm_loss)
    assert hf.ATTN_IMPLEMENTATION == "hexiseq"


@pytest.mark.parametrize("run", ["asymmetric_run", "parked_run"])
def test_packed_documents_match_each_document_alone(run, request):
    """Packed inputs as DataCollatorWithFlattening makes them (position_ids restarting at each document, labels -100
    at each document's first token; batch 2 with other documents in each row on the asymmetric plan, batch 1 with
    a parked rank) through shard_inputs(..., position_ids=): logits, loss and summed gradients equal the unpatched
    model run document by document, to the tolerances of the full-sequence test. Transformers' own packed run of
    the full sequence agrees with that reference (to its float32 loss)."""
    out = request.getfixturevalue(run)
    for rank, (status, per_family) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {per_family}"
        for family in FAMILIES:
            m = per_family[family]
            where = f"{family} rank {rank}"
            assert m["packed_documents"] in (tuple(hf_worker.PACKED[0]), tuple(map(tuple, hf_worker.PACKED)))
            assert m["packed_hf_loss_vs_ref"] <= 1e-6, f"{where}: {m['packed_hf_loss_vs_ref']:.3g}"
            assert m["packed_loss"] <= 1e-10, f"{where}: loss {m['packed_loss']:.3g}"
            assert m["packed_logits"] <= 1e-10, f"{where}: logits {m['packed_logits']:.3g}"
            assert not m["packed_grad_missing"], f"{where}: no gradient for {m['packed_grad_missing']}"
            assert m["packed_grad"] <= 1e-8, f"{where}: gradient off by {m['packed_grad']:.3g}"


def test_documents_from_position_ids():
    from hexiseq.hf import documents_from_position_ids

    assert documents_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1]])) == (3, 1, 2)
    assert documents_from_position_ids([5, 6, 0, 1]) == (2, 2)  # any first id; a restart anywhere
    assert documents_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 0]])) == (2, 1)  # equal rows: one list
    assert documents_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]])) == ((2, 1), (3,))
    assert documents_from_position_ids(torch.arange(4)) == (4,)
    with pytest.raises(hexiseq.InvalidArgumentError, match="full sequence of the plan, 5 tokens"):
        documents_from_position_ids(torch.arange(4), 5)
    with pytest.raises(hexiseq.InvalidArgumentError, match="position_ids must be integer"):
        documents_from_position_ids(torch.zeros(1, 3))


def test_shard_inputs_with_packed_position_ids():
    """shard_inputs reads the documents from the full position_ids and hands each rank its shard of them."""
    from hexiseq.hf import DOCUMENTS_KWARG, _check_positions, shard_inputs

    plan = asymmetric_plan()
    pos = torch.cat([torch.arange(n) for n in hf_worker.PACKED[0]])[None]
    ids = torch.arange(61)[None].repeat(2, 1)
    checked = 0
    for rank in range(4):
        got = shard_inputs(ids, plan, rank, position_ids=pos)
        assert got[DOCUMENTS_KWARG] == tuple(hf_worker.PACKED[0])
        assert torch.equal(got["position_ids"], plan.shard(pos, 1, rank))
        assert torch.equal(got["input_ids"], plan.shard(ids, 1, rank))
        want = torch.as_tensor(plan.positions(rank))
        # _check_positions returns the error (the attention call's agreement raises it on every rank), or None
        assert _check_positions(got["position_ids"], want, got[DOCUMENTS_KWARG], rank) is None  # accepted
        assert _check_positions(got["position_ids"] + 3, want, got[DOCUMENTS_KWARG], rank) is None  # start offset
        if len(set(hexiseq.ops.document_starts(hf_worker.PACKED[0], want.numpy()).tolist())) > 1:
            # the rank's tokens span documents: absolute positions where the restarting ones belong are refused,
            # and the reverse
            checked += 1
            e = _check_positions(want[None], want, got[DOCUMENTS_KWARG], rank)
            assert isinstance(e, hexiseq.InvalidArgumentError) and "restarting at each document" in str(e), e
            e = _check_positions(got["position_ids"], want, None, rank)
            assert isinstance(e, hexiseq.InvalidArgumentError) and "absolute positions" in str(e), e
            assert "position_ids[0, " in str(e) and ", want " in str(e), e
    assert DOCUMENTS_KWARG not in shard_inputs(ids, plan, 0)
    assert checked >= 2


def refusal_plan():
    """3 ranks: an HP group of two (unequal tokens) and a ring of two groups; 45 tokens."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300.0}]})
    model = hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128, vocab=97, gated_mlp=True)
    return hexiseq.evaluate(cluster, model=model, seq_len=45, layout={"groups": [
        {"devices": [0, 1], "seq": 30, "tokens": [20, 10], "heads": [4, 4]},
        {"devices": [2], "seq": 15, "tokens": [15], "heads": [8]}]})


# (scenario, the class every rank raises, words its message must hold)
REFUSALS = [
    ("padding", "UnsupportedError", ["1 of 3 ranks", "rank 1: hexiseq: a padding attention_mask",
                                     "attention_mask [1, 10] has 1 zero(s), the first at [0, 3]"]),
    ("positions", "InvalidArgumentError", ["1 of 3 ranks", "rank 2: hexiseq: position_ids must be",
                                           "position_ids[0, 0] is 16, want 15"]),
    ("tokens", "InvalidArgumentError", ["1 of 3 ranks", "rank 0: hexiseq: rank 0 holds 20 tokens", "got 45"]),
    ("loss_labels", "InvalidArgumentError", ["1 of 3 ranks", "rank 1: labels_full must be [batch, 45]",
                                             "[1, 44]"]),
    ("loss_ignore_index", "RankMismatchError", ["ignore_index", "-1", "-100"]),
    ("shard_position_ids", "InvalidArgumentError", ["1 of 3 ranks", "rank 0: position_ids must be integer",
                                                    "float32"]),
    ("shard_batch", "RankMismatchError", ["batch", "2", "1"]),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """One spawn of 3 ranks (group timeout 5 s) runs every refusal in turn."""
    out = spawn(hf_worker.check_refusals, 3, (refusal_plan().to_json(),), tmp_path_factory.mktemp("r"),
                timeout_s=90)
    for rank, (status, report) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
    return {rank: report for rank, (_, report) in out.items()}


@pytest.mark.parametrize("name,cls,words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_input_refused_on_one_rank_raises_on_every_rank(refusals, name, cls, words):
    """An input the adapter refuses on one rank only (a padding mask, position_ids, a shard of the wrong size)
    makes every rank raise the same error at once, naming the rank, the field and the value, instead of that rank
    raising while the others wait in their attention call until the group's timeout (5 s here); the same for the
    inputs and the loss (shard_inputs, sharded_causal_lm_loss), and for ranks that disagree on the batch or on
    ignore_index."""
    same_error_on_every_rank(refusals, name, cls, words)


def test_ranks_stay_in_step_after_refusals(refusals):
    for rank, report in sorted(refusals.items()):
        assert report["good"][0] == "ok" and report["good_after"][0] == "ok", (rank, report["good"],
                                                                               report["good_after"])
