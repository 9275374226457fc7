"""How much communication the distributed attention layer exposes: layer time across processes against the
time its attention kernels take on the slowest rank.

Usage: python benchmarks/bench_runtime.py [--world 2] [--seq 4096] [--reps 5] [--slices 1,4]
                                         [--out benchmarks/results/runtime.md]

For each plan, every rank runs HexiSeqAttention forward+backward on its shard (Gloo, CPU, one thread per process).
Reported per plan: the layer's wall time (median over --reps after a warm-up, slowest rank), the time spent inside
attention kernels on the slowest rank, and the difference (all-to-all, ring transfers not hidden, packing and
merging), the part of it spent waiting for all-to-alls, and the runtime's own work (the layer less kernels,
all-to-all and ring waits and call checks, on the rank where it is largest). Each plan runs once per --slices value
(the number of kv-head slices a layer is pipelined in: 1 is the plain layer, whose all-to-alls stand alone), side
by side in the same run. Also, for reference, the kernels on the whole sequence in one process.
On a 2-core machine use --world 2: more processes than cores measure the scheduler, not the layer."""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hexiseq
from _machine import machine


def plans(world, seq, model):
    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": world, "intra_gbps": 300}]})
    out = {}
    for s in ("ring", "ulysses"):
        try:
            out[s] = hexiseq.plan(c, model=model, seq_len=seq, strategy=s)
        except hexiseq.HexiseqError:
            pass
    if world == 2:
        heads = model.heads
        a = seq * 3 // 5
        out["asym ring 60/40"] = hexiseq.evaluate(c, model=model, seq_len=seq, layout={"groups": [
            {"devices": [0], "seq": a, "tokens": [a], "heads": [heads]},
            {"devices": [1], "seq": seq - a, "tokens": [seq - a], "heads": [heads]}]})
        h0 = heads * 5 // 8
        out["asym ulysses 5/3 heads"] = hexiseq.evaluate(c, model=model, seq_len=seq, layout={"groups": [
            {"devices": [0, 1], "seq": seq, "tokens": [seq * 5 // 8, seq - seq * 5 // 8], "heads": [h0, heads - h0]}]})
    return out


def worker(rank, world, init, plan_json, reps, slices, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from hexiseq.nn import HexiSeqAttention

    plan = hexiseq.Plan.from_json(plan_json)
    m = plan.model
    attn = HexiSeqAttention(plan, a2a_slices=slices)
    s = int(plan.devices.tokens[plan._slot(rank)])
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, s, m.heads, m.head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, s, m.kv_heads, m.head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, s, m.kv_heads, m.head_dim, generator=g, requires_grad=True)
    layer, kern, a2a, own = [], [], [], []
    for it in range(reps + 1):
        dist.barrier()
        attn.context.reset_timers()
        t0 = time.perf_counter()
        o = attn(q, k, v)
        o.backward(torch.ones_like(o))
        wall, ph = time.perf_counter() - t0, attn.context.phase_s
        t = torch.tensor([wall, attn.context.kernel_s, ph["a2a"],
                          wall - ph["attn"] - ph["a2a"] - ph["ring_wait"] - ph["sync"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it:  # the first run is a warm-up
            layer.append(t[0].item())
            kern.append(t[1].item())
            a2a.append(t[2].item())
            own.append(t[3].item())
    if rank == 0:
        results.put((statistics.median(layer), statistics.median(kern), statistics.median(a2a),
                     statistics.median(own)))
    dist.destroy_process_group()


def single_process_kernels(seq, model, reps):
    """Forward+backward of the C kernels on the whole sequence in this process (one thread)."""
    torch.set_num_threads(1)
    q = torch.randn(1, seq, model.heads, model.head_dim)
    k = torch.randn(1, seq, model.kv_heads, model.head_dim)
    v = torch.randn(1, seq, model.kv_heads, model.head_dim)
    times = []
    for it in range(reps + 1):
        t0 = time.perf_counter()
        o, lse = hexiseq.ops.attention_forward(q, k, v, causal=True)
        hexiseq.ops.attention_backward(q, k, v, o, lse, torch.ones_like(o), causal=True)
        if it:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slices", default="1,4", help="comma-separated slice counts to compare (default 1,4)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = hexiseq.Model(layers=1, hidden=1024, heads=16, kv_heads=4, head_dim=64, ffn=4096, vocab=1000)
    rows = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans(args.world, args.seq, model).items():
            for slices in [int(x) for x in args.slices.split(",")]:
                results = ctx.SimpleQueue()
                init = f"file://{tmp}/store-{time.monotonic_ns()}"
                procs = [ctx.Process(target=worker, args=(r, args.world, init, plan.to_json(), args.reps, slices,
                                                          results)) for r in range(args.world)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                layer, kern, a2a, own = results.get()
                rows.append((name, plan.num_groups, slices, layer, kern, a2a, own))
                print(f"{name:<24} groups {plan.num_groups}  slices {slices}  layer {layer * 1e3:8.1f} ms  "
                      f"kernels {kern * 1e3:8.1f} ms  exposed {100 * (layer - kern) / layer:5.1f}%  "
                      f"a2a wait {100 * a2a / layer:5.1f}%  runtime work {100 * own / layer:5.1f}%", flush=True)
    single = single_process_kernels(args.seq, model, args.reps)
    print(f"kernels on the whole sequence in one process: {single * 1e3:.1f} ms")
    if args.out:
        load = os.getloadavg()
        with open(args.out, "w") as f:
            f.write("# Distributed attention layer: exposed communication\n\n")
            f.write(f"Machine: {machine()}; load average at the end {load[0]:.2f}. Gloo on CPU, {args.world} processes, "
                    "one thread each.\n\n")
            f.write(f"Command: `python benchmarks/bench_runtime.py --world {args.world} --seq {args.seq} "
                    f"--reps {args.reps} --slices {args.slices} --out {args.out}`\n\n")
            f.write(f"Shapes: batch 1, seq {args.seq}, 16 query heads, 4 kv heads, head dim 64, fp32, causal; "
                    "forward+backward of one layer. Times: median over reps, slowest rank.\n\n")
            f.write("| plan | groups | slices | layer | attention kernels (slowest rank) | exposed (layer - kernels) "
                    "| of which all-to-all wait | runtime's own work |\n")
            f.write("|---|---:|---:|---:|---:|---:|---:|---:|\n")
            for name, groups, slices, layer, kern, a2a, own in rows:
                f.write(f"| {name} | {groups} | {slices} | {layer * 1e3:.1f} ms | {kern * 1e3:.1f} ms | "
                        f"{(layer - kern) * 1e3:.1f} ms ({100 * (layer - kern) / layer:.1f}%) | "
                        f"{a2a * 1e3:.1f} ms ({100 * a2a / layer:.1f}%) | {own * 1e3:.1f} ms ({100 * own / layer:.1f}%) |\n")
            f.write(f"\nThe same kernels on the whole sequence in one process: {single * 1e3:.1f} ms.\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
