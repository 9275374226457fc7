"""Worker processes for the calibration and measurement tests (spawned children import this module)."""

import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist

import hexiseq

import dist_worker

TINY = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=512, dtype_bytes=4,
            gated_mlp=True, name="tiny")


def _init(rank, world, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))


def _probe_s():
    """Seconds this rank takes for a fixed matmul loop while every rank runs it at the same time: how the machine
    treats the pinned ranks now, measured independently of the calibration (a loaded machine can erase the
    difference that pinning makes, and then the calibration cannot see it either)."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(150):  # 5 GFLOP, a few hundred ms: many scheduler slices, so sharing ranks are seen sharing
        a @ a
    took = [None] * dist.get_world_size()
    dist.all_gather_object(took, time.perf_counter() - t0)
    return took


def calibrate_pinned(rank, world, init, cores, results):
    """Calibrate with rank r pinned to cores[r] (None: not pinned); report the cluster as a dict, and the probe's
    seconds per rank just before and just after calibrating."""
    try:
        if cores is not None:
            os.sched_setaffinity(0, cores[rank])
        _init(rank, world, init)
        from hexiseq import calibrate

        # sizes big enough that compute, not call overhead, dominates the largest point on a CPU; the largest
        # attention block is 1024 tokens because at 512 one timed call can fit in one scheduler slice, so two ranks
        # that share a core were each timed running alone and the rank alone on its core showed no gain (seen on
        # a quiet 2-core machine: 1.00x at 512, 1.7-2.0x at 1024)
        before = _probe_s()
        c = calibrate(hexiseq.Model(**TINY), gemm_rows=[64, 512], attn_blocks=[64, 256, 1024], message_bytes=1 << 20,
                      iters=3, progress=False)
        results.put((rank, "ok", c.to_dict(), [before, _probe_s()]))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def measure_plan(rank, world, init, plan_json, layers, results):
    try:
        _init(rank, world, init)
        from hexiseq import measure

        plan = hexiseq.Plan.from_json(plan_json)
        out = {layer: measure(plan, iters=2, warmup=1, layer=layer).to_dict() for layer in layers}
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def contexts_in_sequence(rank, world, init, plan_jsons, results):
    """Build one context per plan in turn, on the world, and run each layer once (forward + backward)."""
    try:
        _init(rank, world, init)
        from hexiseq.nn import HexiSeqAttention

        for text in plan_jsons:
            plan = hexiseq.Plan.from_json(text)
            m, s = plan.model, int(plan.devices.tokens[plan._slot(rank)])
            q = torch.randn(1, s, m.heads, m.head_dim, requires_grad=True)
            k = torch.randn(1, s, m.kv_heads, m.head_dim, requires_grad=True)
            v = torch.randn(1, s, m.kv_heads, m.head_dim, requires_grad=True)
            HexiSeqAttention(plan)(q, k, v).sum().backward()
        results.put((rank, "ok", len(plan_jsons)))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def argument_scenarios(rank, world, init, plan_json, results):
    """calibrate and measure called with arguments that differ between the ranks, or are invalid on one rank
    only, one scenario after another in one process group (timeout 5 s), then a good measurement: reports
    {scenario: (the exception's class, its message, seconds)}."""

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=5))
        from hexiseq import calibrate, measure

        plan = hexiseq.Plan.from_json(plan_json)
        tiny = hexiseq.Model(**TINY)
        report = {}

        scenario = dist_worker.scenarios(report)

        def cal(**kw):
            args = dict(model=tiny, gemm_rows=[16], attn_blocks=[32], message_bytes=1 << 12, iters=1, warmup=0,
                        progress=False)
            args.update(kw)
            calibrate(**args)

        scenario("cal_blocks", lambda: cal(attn_blocks=[32, 64] if rank == 1 else [32]))
        scenario("cal_rows", lambda: cal(gemm_rows=[16, 32] if rank == 0 else [16]))
        scenario("cal_model", lambda: cal(model=hexiseq.Model(**{**TINY, "heads": 8}) if rank == 2 else tiny))
        scenario("cal_dtype", lambda: cal(dtype="fp64" if rank == 2 else None))
        scenario("cal_iters", lambda: cal(iters=2 if rank == 1 else 1))
        scenario("cal_message_bytes", lambda: cal(message_bytes=1 << 13 if rank == 0 else 1 << 12))
        scenario("cal_invalid", lambda: cal(iters=0 if rank == 2 else 1))
        scenario("cal_unknown_model", lambda: cal(model="9b" if rank == 1 else tiny))
        scenario("measure_iters", lambda: measure(plan, iters=2 if rank == 1 else 1, warmup=0))
        scenario("measure_layer", lambda: measure(plan, iters=1, warmup=0, layer="llama" if rank == 0 else "attention"))
        scenario("measure_documents", lambda: measure(plan, iters=1, warmup=0,
                                                      documents=[32, 32] if rank == 2 else None))
        scenario("measure_invalid", lambda: measure(plan, iters=1, warmup=0, layer="mlp" if rank == 0 else "attention"))
        scenario("good_after", lambda: measure(plan, iters=1, warmup=0))
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
