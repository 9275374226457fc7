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

import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers",
                                   reason="hexiseq.hf tests need transformers (pip install transformers)")
mp = pytest.importorskip("torch.multiprocessing")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import dist_worker  # noqa: E402
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


def test_patched_models_match_full_sequence(tmp_path):
    plan = asymmetric_plan()
    world = plan.cluster.num_devices
    assert world == 4 and plan.seq_len % world != 0
    out = spawn(hf_worker.check_models, world, (plan.to_json(), FAMILIES, 2, True), tmp_path)
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


def test_parked_rank_runs_every_model(tmp_path):
    """A plan that parks a device (no tokens, no heads: what the scheduler does with a slow device on a short
    sequence) runs every supported model: the parked rank runs the model on an empty shard and takes part in the
    collectives, and the result equals the full-sequence reference."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0},
                                                   {"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    model = hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128, vocab=97, gated_mlp=True)
    plan = hexiseq.evaluate(cluster, model=model, seq_len=61, layout={"groups": [
        {"devices": [0, 1], "seq": 61, "tokens": [61, 0], "heads": [8, 0]}]})
    assert len(plan.positions(1)) == 0
    out = spawn(hf_worker.check_models, 2, (plan.to_json(), FAMILIES, 1, False), tmp_path)
    for rank, (status, per_family) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {per_family}"
        for family in FAMILIES:
            m = per_family[family]
            where = f"{family} rank {rank}"
            assert m["loss_vs_ref64"] <= 1e-10, f"{where}: loss {m['loss_vs_ref64']:.3g}"
            assert not m["grad_missing"], f"{where}: no gradient for {m['grad_missing']}"
            assert m["grad"] <= 1e-8, f"{where}: gradient of {m['grad_worst_param']} off by {m['grad']:.3g}"
            if rank == 0:
                assert m["logits"] <= 1e-10, f"{where}: logits {m['logits']:.3g}"


def test_importable_without_distributed_setup():
    import hexiseq.hf as hf

    assert callable(hf.patch_model) and callable(hf.sharded_causal_lm_loss)
    assert hf.ATTN_IMPLEMENTATION == "hexiseq"
