"""A step of unequal sequences on ranks of unequal speed, measured: the batch plan next to the batch planner told
that every device is equal, one packed sequence over every rank (documents), and the uniform Ring, Ulysses and USP.

Usage: python benchmarks/batch_cpu.py [--iters 3] [--scale 1.0] [--out benchmarks/results/batch_cpu.md]

Three CPU processes pinned as in benchmarks/heterogeneous_cpu.py (rank 0 alone on core 0, ranks 1 and 2 sharing
core 1, so rank 0 computes about twice as fast), Gloo, one thread each. Every rank:
1. calibrates (hexiseq.calibrate), all ranks at once, and plans on the calibrated cluster;
2. for each row, runs the step: for every pass of its group, a Llama-style layer (benchmarks' model: 12 query heads,
   4 kv heads, head dim 64, fp32, causal, one layer) forward and backward over the pass's tokens with its documents,
   then one all-reduce of the layer's gradients over all ranks; the step is the slowest rank from a common barrier
   (median of --iters after one warm-up);
3. predicts the same step with the cost model on the calibrated cluster: per group, the sum over its passes of the
   layer's forward and backward (hexiseq.hardware.measurement.predicted_layer: attention, all-to-all, ring, matmuls), the
   slowest group, plus the gradient all-reduce across groups (BatchPlanner.sync_s). The all-reduce inside one group
   is measured but not predicted (a 5 MB layer on Gloo: milliseconds against a step of seconds).
The batch: one long sequence and a tail of short ones, each length half the one before it (4,096, 2,048, ... 64,
and two more of 64 and 128), some short ones packed from two documents; --scale multiplies every length.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine  # noqa: E402
from heterogeneous_cpu import MODEL, run_ranks, start_rank  # noqa: E402

from hexiseq.nn import BatchContext, HexiSeqAttention  # noqa: E402
from hexiseq.hardware.harness import llama_layer  # noqa: E402
from hexiseq.hardware.measurement import predicted_layer  # noqa: E402

LAYER = hexiseq.Model(layers=1, hidden=MODEL.hidden, heads=MODEL.heads, kv_heads=MODEL.kv_heads,
                      head_dim=MODEL.head_dim, ffn=MODEL.ffn, vocab=8, dtype_bytes=4, gated_mlp=True, name="one-layer")
MIXES = {
    # one long sequence and a tail, each length half the one before it
    "long-tail": [4096, 2048, 1024, 512, [128, 128], 128, [32, 32], 64, 128, 64],
    # one long sequence and many short ones (most of the tokens in sequences of 256 or fewer)
    "short-heavy": [2048] + [256] * 4 + [128] * 16 + [[64, 64]] * 8 + [32] * 16,
}


def configure(args):
    """The layer the step runs (--hidden, --ffn: the matmuls around the attention, whose gradients all ranks
    all-reduce)."""
    global LAYER
    LAYER = hexiseq.Model(layers=1, hidden=args.hidden, heads=MODEL.heads, kv_heads=MODEL.kv_heads,
                          head_dim=MODEL.head_dim, ffn=args.ffn, vocab=8, dtype_bytes=4, gated_mlp=True,
                          name="one-layer")
TRAINING = hexiseq.Training(checkpointing=False, sharding="none")
STRATEGIES = ("ring", "ulysses", "usp")


def batch(scale, mix="long-tail"):
    base = MIXES[mix]
    out = []
    for x in base:
        out.append([max(1, int(v * scale)) for v in x] if isinstance(x, list) else max(1, int(x * scale)))
    return out


def flat_documents(lengths):
    return [v for x in lengths for v in (x if isinstance(x, list) else [x])]


def equal_cluster(cluster):
    """The calibrated cluster with every device given the mean of the devices' figures: what a planner for
    identical devices sees."""
    d = cluster.to_dict()
    devs = d["devices"]
    keys = [k for k, v in devs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    curves = [k for k, v in devs[0].items() if isinstance(v, list) and v and isinstance(v[0], list)]
    for k in keys:
        mean = sum(x[k] for x in devs) / len(devs)
        for x in devs:
            x[k] = mean
    for k in curves:
        n = min(len(x[k]) for x in devs)
        mean = [[devs[0][k][i][0], sum(x[k][i][1] for x in devs) / len(devs)] for i in range(n)]
        for x in devs:
            x[k] = [list(p) for p in mean]
    return hexiseq.Cluster.from_dict(d)


def predict_groups(cluster, groups, passes, lengths_of_pass):
    """The cost model's step of `passes` (per group, a list of (layout, document lengths)) on `cluster`."""
    worst = 0.0
    for devices, ps in zip(groups, passes):
        sub = cluster.subset(devices)
        t = 0.0
        for layout, docs in ps:
            plan = hexiseq.evaluate(sub, model=LAYER, seq_len=sum(docs), layout=layout, training=TRAINING,
                                    causal=True)
            t += predicted_layer(plan, "llama", docs if len(docs) > 1 else None)[1]
        worst = max(worst, t)
    return worst


def run_step(layer, holder, runs, iters):
    """runs: this rank's passes as (attention callable, tokens). Median over iters of the slowest rank's step."""
    samples = []
    params = [p for p in layer.parameters()]
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for attend, s in runs:
            holder["attend"] = attend
            x = torch.randn(1, s, LAYER.hidden, requires_grad=True)
            layer(x).backward(torch.randn_like(x))
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
        dist.all_reduce(flat)
        for p in params:
            p.grad = None
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            samples.append(float(t))
    return statistics.median(samples)


def worker(rank, world, init, args, result_path):
    configure(args)
    cluster = start_rank(rank, world, init)
    lengths = batch(args.scale, args.mix)
    docs_all = flat_documents(lengths)
    holder = {}  # the attention of the pass being run
    layer = llama_layer(LAYER, lambda q, k, v: holder["attend"](q, k, v), torch.device("cpu"), torch.float32, 0)
    results = {}

    def batch_row(name, planner, predict_cluster):
        t0 = time.perf_counter()
        plan = planner.plan(lengths)
        solve = time.perf_counter() - t0
        ctx = BatchContext(planner)
        step = ctx.step(plan)
        runs = [(p.attention, p.tokens) for p in step.passes]
        measured = run_step(layer, holder, runs, args.iters)
        passes = [[(plan.plan_for(g, p).layout, [L for i in seqs for L in (plan.documents[i] or (plan.lengths[i],))])
                   for p, seqs in enumerate(plan.passes[g])] for g in range(len(plan.groups))]
        true_planner = hexiseq.BatchPlanner(cluster, model=LAYER, training=TRAINING)
        predicted = predict_groups(predict_cluster, plan.groups, passes, None) + true_planner.sync_s(plan.groups)
        ctx.close()
        results[name] = {"groups": [list(g) for g in plan.groups], "assignment": list(plan.assignment),
                         "passes": [[list(p) for p in ps] for ps in plan.passes], "measured_s": measured,
                         "predicted_s": predicted, "planner_step_s": plan.step_time_s, "solve_s": solve}
        if rank == 0:
            print(f"{name:<22} measured {measured * 1e3:8.1f} ms  predicted {predicted * 1e3:8.1f} ms  groups "
                  f"{results[name]['groups']}", flush=True)

    batch_row("batch plan", hexiseq.BatchPlanner(cluster, model=LAYER, training=TRAINING), cluster)
    batch_row("batch plan, equal devices", hexiseq.BatchPlanner(equal_cluster(cluster), model=LAYER,
                                                                training=TRAINING), cluster)
    batch_row("packed, hexiseq", hexiseq.BatchPlanner(cluster, model=LAYER, training=TRAINING,
                                                      groups=[tuple(range(world))]), cluster)
    for strategy in STRATEGIES:
        plan = hexiseq.plan(cluster, model=LAYER, seq_len=sum(docs_all), strategy=strategy, training=TRAINING,
                            documents=docs_all)
        attn = HexiSeqAttention(plan, causal=True)
        s = int(plan.devices.tokens[plan._slot(rank)])
        measured = run_step(layer, holder, [(lambda q, k, v, a=attn: a(q, k, v, documents=docs_all), s)], args.iters)
        attn.context.close()
        predicted = predicted_layer(plan, "llama", docs_all)[1]
        results[f"packed, {strategy}"] = {"groups": [list(range(world))], "measured_s": measured,
                                          "predicted_s": predicted}
        if rank == 0:
            print(f"packed, {strategy:<14} measured {measured * 1e3:8.1f} ms  predicted {predicted * 1e3:8.1f} ms",
                  flush=True)
    from heterogeneous_cpu import finish_rank
    finish_rank(rank, cluster, {"lengths": lengths, "rows": results}, result_path)


def report(data, args, elapsed):
    res = data["results"]
    rows = res["rows"]
    lines = ["# A step of unequal sequences on ranks of unequal speed, measured", "",
             f"Machine: {machine()}. Gloo, one thread per process; rank 0 alone on core 0, ranks 1 and 2 sharing "
             "core 1 (rank 0 about twice as fast).", "",
             f"Command: `python benchmarks/batch_cpu.py --iters {args.iters} --scale {args.scale} --mix {args.mix} "
             f"--hidden {args.hidden} --ffn {args.ffn}"
             f"{'' if args.link_gbit is None else f' --link-gbit {args.link_gbit:g}'}` ({elapsed:.0f} s)"
             f"{'' if args.link_gbit is None else f'; loopback limited to {args.link_gbit:g} Gbit/s (tc tbf), every link between ranks as slow as one between nodes'}.",
             "",
             f"Batch ({len(res['lengths'])} sequences, {sum(flat_documents(res['lengths'])):,} tokens; a list is a "
             f"sequence packed from documents): {res['lengths']}.", "",
             f"Step: one Llama-style layer ({LAYER.heads} query heads, {LAYER.kv_heads} kv heads, head dim "
             f"{LAYER.head_dim}, hidden {LAYER.hidden}, SwiGLU {LAYER.ffn}, fp32, causal) forward and backward over "
             "every pass of each rank's group, then the gradient all-reduce over all ranks. Measured: the slowest "
             "rank from a common barrier, median of the runs. Predicted: the cost model on the calibrated cluster, "
             "same layouts and documents (see the script's docstring for what it sums).", "",
             "| row | groups (devices) | measured ms | predicted ms | measured / predicted | measured gain of the batch "
             "plan |", "|---|---|---:|---:|---:|---:|"]
    ours = rows["batch plan"]["measured_s"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['groups']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['measured_s'] / r['predicted_s']:.3f} | {r['measured_s'] / ours:.3f}x |")
    packed = rows["packed, hexiseq"]["measured_s"]
    worst = max(abs(r["measured_s"] / r["predicted_s"] - 1) for r in rows.values())
    lines += ["", f"- measured gain of the batch plan over one packed sequence on every rank (hexiseq's plan): "
                  f"**{packed / ours:.3f}x**; over the batch planner told the devices are equal: "
                  f"{rows['batch plan, equal devices']['measured_s'] / ours:.3f}x",
              f"- largest prediction error: {worst * 100:.1f}%",
              f"- the batch plan's assignment (group of each sequence): {rows['batch plan']['assignment']}; "
              f"passes: {rows['batch plan']['passes']}", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--mix", default="long-tail", choices=sorted(MIXES))
    ap.add_argument("--hidden", type=int, default=MODEL.hidden)
    ap.add_argument("--ffn", type=int, default=MODEL.ffn)
    ap.add_argument("--link-gbit", type=float, default=None,
                    help="limit the loopback device to this rate for the whole run, calibration included (tc tbf on "
                         "lo, as root; removed at the end): links between the ranks as slow as between nodes")
    ap.add_argument("--out", default=None, help="Markdown report (default: print only)")
    args = ap.parse_args()
    configure(args)
    if args.link_gbit is None:
        run_ranks(worker, report, args)
        return
    import subprocess
    cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{args.link_gbit}gbit", "burst", "256kb",
           "latency", "100ms"]
    if subprocess.run(cmd).returncode:
        sys.exit("could not limit lo with tc (needs root and the tbf qdisc)")
    try:
        run_ranks(worker, report, args)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"])


if __name__ == "__main__":
    main()
