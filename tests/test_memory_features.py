"""Memory features in the runtime: offloaded checkpoints exact against plain ones (float64), the plan's per-device
choice, its fields read and written, and a Hugging Face model patched with a plan whose small device offloads (and,
forced, whose other device tiles its MLP and loss), 2 Gloo processes against the unpatched model in one process.

Tolerances as tests/test_hf.py: loss 1e-10 relative, every parameter's summed gradient 1e-8 relative to its largest
entry (sums in another order; observed ~1e-15). The offloaded checkpoint alone is bitwise: it returns the saved
tensors themselves."""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the Hugging Face half needs transformers")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402
from hexiseq.errors import InvalidArgumentError  # noqa: E402

import dist_worker  # noqa: E402
import memory_worker  # noqa: E402

GIB = 1024 ** 3


def _layers(n, width, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.GELU(),
                                                   torch.nn.Linear(3 * width, width)) for _ in range(n)).double()


def test_offloaded_checkpoint_is_the_plain_checkpoint():
    """Four layers on 37 odd tokens: the same loss and gradients, bit for bit, as torch's checkpoint and as no
    checkpoint; one saved tensor per layer (its input), held until the backward and released after it."""
    layers = _layers(4, 16)
    x0 = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    params = [x0, *layers.parameters()]

    def run(how, offloader=None):
        x = x0
        for layer in layers:
            if how == "offload":
                x = hexiseq.nn.offloaded_checkpoint(layer, x, offloader=offloader)
            elif how == "checkpoint":
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x.square().sum()

    ref = run("plain")
    ref_grads = torch.autograd.grad(ref, params)
    ck = run("checkpoint")
    ck_grads = torch.autograd.grad(ck, params)
    off = hexiseq.nn.OffloadCheckpoints()
    out = run("offload", off)
    assert off.saved == 4 and off.host_bytes == off.peak_host_bytes == 4 * 37 * 16 * 8
    grads = torch.autograd.grad(out, params)
    assert off.host_bytes == 0
    assert out.item() == ref.item() == ck.item()
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(grads, ref_grads, ck_grads))
    # the peak is kept until reset, and a step after the reset reaches it again (two layers: half of it)
    assert off.peak_host_bytes == 4 * 37 * 16 * 8
    off.reset_peak()
    assert off.peak_host_bytes == off.host_bytes == 0
    x = x0
    for layer in list(layers)[:2]:
        x = hexiseq.nn.offloaded_checkpoint(layer, x, offloader=off)
    assert off.peak_host_bytes == 2 * 37 * 16 * 8 and off.saved == 6
    torch.autograd.grad(x.sum(), [x0])
    assert off.host_bytes == 0 and off.peak_host_bytes == 2 * 37 * 16 * 8


def test_offload_refusals():
    layer = _layers(1, 4)[0]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="use_reentrant=False"):
        hexiseq.nn.offloaded_checkpoint(layer, x, use_reentrant=True)
    with pytest.raises(InvalidArgumentError, match="offloader must be"):
        hexiseq.nn.offloaded_checkpoint(layer, x, offloader=object())
    with pytest.raises(InvalidArgumentError, match="min_bytes"):
        hexiseq.nn.OffloadCheckpoints(min_bytes=-1)


MODEL = hexiseq.Model(layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=53, gated_mlp=True,
                      dtype_bytes=8)
TRAINING = hexiseq.Training(checkpointing=True, reserved_gib=0.0, state_shares="even")
LAYOUT = {"groups": [{"devices": [0], "seq": 24, "tokens": [24], "heads": [4]},
                     {"devices": [1], "seq": 24, "tokens": [24], "heads": [4]}]}


def _cluster(small_gib=None):
    nodes = [{"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0},
             {"gpu": "A100-80G", "count": 1, "intra_gbps": 300.0}]
    if small_gib is not None:
        nodes[1]["memory_gib"] = small_gib
    return hexiseq.Cluster.from_dict({"nodes": nodes, "inter_node_gbps": 25.0})


def offloading_plan():
    """Device 1 short by half of what offloading saves there ((layers - 2) checkpoints of 24 tokens x 32 x 8 bytes):
    the cost model chooses offloading for it (tiling saves nothing below a tile) and nothing for device 0."""
    roomy = hexiseq.evaluate(_cluster(), model=MODEL, seq_len=48, layout=LAYOUT, training=TRAINING)
    need = float(roomy.devices.mem_total_gib[1])
    return hexiseq.evaluate(_cluster(need - 6144 / GIB), model=MODEL, seq_len=48, layout=LAYOUT, training=TRAINING)


def test_the_plan_says_what_each_device_uses():
    plan = offloading_plan()
    t = plan.devices
    assert plan.fits and t.features.tolist() == ["", "offload"]
    assert plan.memory_features(1) == {"offload": True, "mlp_tiles": 1, "loss_tiles": 1}
    assert plan.memory_features(0) == {"offload": False, "mlp_tiles": 1, "loss_tiles": 1}
    assert t.mem_host_gib[1] * GIB == pytest.approx(4 * 24 * 32 * 8, rel=1e-12) and t.mem_host_gib[0] == 0
    assert t.offload_s[1] >= 0 and t.tiling_s.tolist() == [0.0, 0.0]
    assert "device(s) 1 (A100-80G): checkpoints offloaded to host memory" in plan.explain()
    none = hexiseq.evaluate(plan.cluster, model=MODEL, seq_len=48, layout=LAYOUT,
                            training=dataclasses.replace(TRAINING, memory_features="none"))
    assert not none.fits and none.devices.features.tolist() == ["", ""]
    for bad in (2, -1, "1", True, 1.0):
        with pytest.raises(InvalidArgumentError, match="device must be one of the plan's devices"):
            plan.memory_features(bad)
    # written and read back; a plan file without the field (older ones) means none and keeps its fingerprint
    back = hexiseq.Plan.from_json(plan.to_json())
    assert back.fingerprint == plan.fingerprint and back.devices.features.tolist() == ["", "offload"]
    doc = json.loads(none.to_json())
    assert "memory_features" not in doc["training"]
    assert hexiseq.Plan.from_json(json.dumps(doc)).training.memory_features == "none"


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("none", "none"), ("tile_loss,offload", "offload,tile_loss"),
                                         ("offload+tile_mlp", "offload,tile_mlp"), (["tile_mlp"], "tile_mlp"),
                                         ([], "none")])
def test_training_memory_features(value, want):
    assert hexiseq.Training(memory_features=value).memory_features == want


@pytest.mark.parametrize("bad", ["offlaod", "", 3, None, "auto,none"])
def test_training_memory_features_refused(bad):
    with pytest.raises(InvalidArgumentError, match="training.memory_features"):
        hexiseq.Training(memory_features=bad)


def test_host_fields_of_a_cluster():
    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "L40S", "count": 2, "intra_gbps": 32, "host_memory_gib": 100}],
                                   "inter_node_gbps": 25,
                                   "devices": [{"host_gbps": 12.5}, None]})
    assert hexiseq.Cluster.from_dict(c.to_dict()).to_dict() == c.to_dict()
    plan = hexiseq.evaluate(c, model=MODEL, seq_len=48, layout={"groups": [
        {"devices": [0, 1], "seq": 48, "tokens": [24, 24], "heads": [2, 2]}]}, training=TRAINING)
    assert plan.devices.host_cap_gib.tolist() == [50.0, 50.0]
    default = hexiseq.evaluate(_cluster(), model=MODEL, seq_len=48, layout=LAYOUT, training=TRAINING)
    assert default.devices.host_cap_gib.tolist() == [160.0, 160.0]  # twice the A100's 80 GiB
    for field, value in (("host_memory_gib", -1), ("host_memory_gib", "lots")):
        with pytest.raises(InvalidArgumentError, match=field):
            hexiseq.Cluster.from_dict({"nodes": [{"gpu": "L40S", "count": 1, field: value}], "inter_node_gbps": 25})
    with pytest.raises(InvalidArgumentError, match="host_gbps"):
        hexiseq.Cluster.from_dict({"nodes": [{"gpu": "L40S", "count": 1}], "inter_node_gbps": 25,
                                   "devices": [{"host_gbps": 0}]})
    assert {g["name"]: g["host_gbps"] for g in hexiseq.gpu_catalog()}["H100-SXM"] == 64.0


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_hf_model_runs_what_the_plan_chose(tmp_path):
    """Rank 1 offloads because the plan says so (its 4 layers' inputs in host memory: the plan's mem_host_gib, all
    released by the backward), and so both ranks checkpoint; rank 0, forced, tiles its MLP in 3 and its loss in 4
    and keeps its checkpoints on the device; the loss and the summed
    gradients match the unpatched model on the whole sequence, and unpatch_model restores the modules."""
    plan = offloading_plan()
    forced = {0: {"offload": False, "mlp_tiles": 3, "loss_tiles": 4}}
    out = dist_worker.spawn(memory_worker.run, 2, (plan.to_json(), forced, 7), tmp_path, 120)
    for r in (0, 1):
        assert out[r][0] == "ok", out[r][1]
    r0, r1 = out[0][1], out[1][1]
    assert r0["tiled_mlp"] == ["TiledMLP"] * 4 and "saved" not in r0
    assert r0["checkpointing"] == [True] * 4  # every rank recomputes alike (the attention's collectives)
    assert r1["tiled_mlp"] == ["LlamaMLP"] * 4 and r1["checkpointing"] == [True] * 4
    assert r1["reset"] == ["checkpoint"] * 4  # what keep_offloading then replaced (saved == 4 shows it did)
    assert r1["saved"] == 4 and r1["host_bytes"] == round(float(plan.devices.mem_host_gib[1]) * GIB)
    assert r1["host_bytes_after"] == 0
    assert r0["restored"] == r1["restored"] == ["LlamaMLP"] * 4 + [False] * 4
    assert r0["loss_err"] < 1e-10 and r0["grad_err"] < 1e-8, r0
