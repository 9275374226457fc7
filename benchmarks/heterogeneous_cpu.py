"""A real heterogeneous run on one machine: three CPU processes of unequal speed, calibrated, planned with every
strategy, each plan run and measured, predictions put next to measurements.

Usage: python benchmarks/heterogeneous_cpu.py [--seq 6144] [--iters 5] [--out benchmarks/results/heterogeneous_cpu.md]

Rank 0 runs alone on core 0; ranks 1 and 2 share core 1 (os.sched_setaffinity), so rank 0 computes about twice
as fast as either of the others (Gloo, one thread per process). Every rank then:
1. calibrates (hexiseq.calibrate: matmul and attention rate curves, links, memory), all ranks at once;
2. plans a small Llama-style model (12 query heads, 4 kv heads, head_dim 64, fp32) at --seq tokens with hexiseq
   and with the uniform baselines Ring, Ulysses and USP, on the calibrated cluster;
3. runs each plan's attention layer and a whole Llama-style layer forward + backward (hexiseq.measure) and
   records the measured step (slowest rank from a common start, median of --iters) and the cost model's
   prediction for the same layer.
Reported: each strategy's measured and predicted time, measured/predicted, the measured speedup of hexiseq's
plan over the best uniform baseline, and whether the predicted ranking is the measured one.
Needs at least 2 cores (the pinning uses cores 0 and 1). Takes a few minutes."""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import hexiseq  # noqa: E402
from hexiseq import calibrate  # noqa: E402
from hexiseq import measure  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine  # noqa: E402

MODEL = hexiseq.Model(layers=4, hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2048, vocab=8192, dtype_bytes=4,
                      gated_mlp=True, name="llama-tiny")
CORES = {0: {0}, 1: {1}, 2: {1}}
STRATEGIES = ("hexiseq", "ring", "ulysses", "usp")


def layout_text(plan):
    parts = []
    for g in plan.layout.groups():
        parts.append("[" + " ".join(f"d{d}:{t}t/{hi - lo}h"
                                    for d, t, (lo, hi) in zip(g["devices"], g["tokens"], g["head_ranges"])) + "]")
    return " ".join(parts)


def start_rank(rank, world, init):
    """Pin the rank to its core, join the Gloo group, and return the calibrated cluster (all ranks at once)."""
    os.sched_setaffinity(0, CORES[rank])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    return calibrated(rank)


def calibrated(rank):
    """The ranks' cluster as hexiseq.calibrate measures it now (collective)."""
    # attention timed with the model's own heads (12 query, 4 kv; the default, said here for the reader)
    return calibrate(MODEL, dtype="fp32", gemm_rows=[128, 512, 2048], attn_blocks=[64, 128, 256, 512, 1024, 2048],
                     attn_heads=MODEL.heads, iters=3, progress=rank == 0)


def finish_rank(rank, cluster, results, result_path):
    """Rank 0 writes the calibrated cluster and the results; every rank leaves the group."""
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"cluster": cluster.to_dict(), "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


def worker(rank, world, init, args, result_path):
    cluster = start_rank(rank, world, init)
    training = hexiseq.Training(checkpointing=False, sharding="full")
    results = {}
    for strategy in STRATEGIES:
        try:
            plan = hexiseq.plan(cluster, model=MODEL, seq_len=args.seq, strategy=strategy, training=training)
        except hexiseq.HexiseqError as e:
            results[strategy] = {"error": str(e)}
            continue
        row = {"layout": layout_text(plan), "fingerprint": plan.fingerprint, "predicted_step_s": plan.step_time_s}
        for layer in ("attention", "llama"):
            m = measure(plan, iters=args.iters, warmup=1, layer=layer)
            row[layer] = m.to_dict()
            if rank == 0:
                print(f"{strategy:<8} {layer:<9} measured {m.step_s * 1e3:8.1f} ms  predicted "
                      f"{m.predicted_step_s * 1e3:8.1f} ms  ratio {m.ratio:.3f}  {row['layout']}", flush=True)
        results[strategy] = row
    finish_rank(rank, cluster, results, result_path)


def report(data, args, elapsed):
    res = data["results"]
    cal = data["cluster"]
    lines = ["# A heterogeneous run, measured: three CPU ranks of unequal speed", "",
             f"Machine: {machine()}. Gloo, one thread per process; rank 0 alone on core 0, ranks 1 and 2 sharing "
             "core 1.", "",
             f"Command: `python benchmarks/heterogeneous_cpu.py --seq {args.seq} --iters {args.iters}` "
             f"({elapsed:.0f} s).", "",
             f"Model: {MODEL.heads} query heads, {MODEL.kv_heads} kv heads, head_dim {MODEL.head_dim}, hidden "
             f"{MODEL.hidden}, SwiGLU {MODEL.ffn}, fp32, causal, {args.seq} tokens; one layer forward + backward. "
             "Measured: slowest rank from a common start, median of the runs. Predicted: the cost model on the "
             "calibrated cluster, same layout, same layer.", "",
             "## Calibration (measured)", "",
             "| rank | matmul TFLOP/s (largest rows) | attention TFLOP/s (largest block) | causal TFLOP/s |",
             "|---:|---:|---:|---:|"]
    for i, d in enumerate(cal["devices"]):
        lines.append(f"| {i} | {d['gemm_tflops'][-1][1]:.4f} | {d['attn_tflops'][-1][1]:.4f} | "
                     f"{d['attn_causal_tflops'][-1][1]:.4f} |")
    fast = cal["devices"][0]["attn_tflops"][-1][1]
    slow = sum(d["attn_tflops"][-1][1] for d in cal["devices"][1:]) / 2
    lines += ["", f"Rank 0's attention rate over the mean of ranks 1 and 2: {fast / slow:.2f}x.", ""]
    for layer in ("attention", "llama"):
        lines += [f"## The {'attention layer' if layer == 'attention' else 'Llama-style layer'}", "",
                  "| strategy | layout (device:tokens/heads per group) | measured ms | predicted ms | measured/predicted |",
                  "|---|---|---:|---:|---:|"]
        ok = {s: r for s, r in res.items() if "error" not in r}
        for s, r in res.items():
            if "error" in r:
                lines.append(f"| {s} | no plan: {r['error']} | | | |")
                continue
            m = r[layer]
            lines.append(f"| {s} | {r['layout']} | {m['step_s'] * 1e3:.1f} | {m['predicted_step_s'] * 1e3:.1f} | "
                         f"{m['ratio']:.3f} |")
        base = {s: r for s, r in ok.items() if s != "hexiseq"}
        if "hexiseq" in ok and base:
            best_meas = min(base, key=lambda s: base[s][layer]["step_s"])
            best_pred = min(base, key=lambda s: base[s][layer]["predicted_step_s"])
            sp_meas = base[best_meas][layer]["step_s"] / ok["hexiseq"][layer]["step_s"]
            sp_pred = base[best_pred][layer]["predicted_step_s"] / ok["hexiseq"][layer]["predicted_step_s"]
            # strategies that chose the same layout are one entry (their order would be noise)
            distinct = {}
            for s in ok:
                distinct.setdefault(ok[s]["layout"], []).append(s)
            names = {lay: "=".join(ss) for lay, ss in distinct.items()}
            first = {lay: ok[ss[0]] for lay, ss in distinct.items()}
            rank_meas = [names[lay] for lay in sorted(first, key=lambda lay: statistics.median(
                ok[s][layer]["step_s"] for s in distinct[lay]))]
            rank_pred = [names[lay] for lay in sorted(first, key=lambda lay: first[lay][layer]["predicted_step_s"])]
            worst = max(abs(ok[s][layer]["ratio"] - 1) for s in ok)
            lines += ["", f"- measured speedup of hexiseq's plan over the best uniform baseline ({best_meas}): "
                          f"**{sp_meas:.3f}x** (predicted {sp_pred:.3f}x over {best_pred})",
                      f"- ranking measured: {' < '.join(rank_meas)}; predicted: {' < '.join(rank_pred)} "
                      f"({'the same' if rank_meas == rank_pred else 'different'})",
                      f"- largest prediction error: {worst * 100:.1f}%", ""]
    return "\n".join(lines)


def run_ranks(worker, report, args):
    """Spawn the three pinned ranks running worker(rank, world, init, args, result_path), then print (and with
    args.out write, with the raw results beside it as JSON) report(results, args, seconds)."""
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        sys.exit("needs cores 0 and 1")
    world = len(CORES)
    tmp = tempfile.mkdtemp()
    result_path = os.path.join(tmp, "result.json")
    t0 = datetime.datetime.now()
    mp.spawn(worker, args=(world, "file://" + os.path.join(tmp, "store"), args, result_path), nprocs=world)
    elapsed = (datetime.datetime.now() - t0).total_seconds()
    with open(result_path) as f:
        data = json.load(f)
    text = report(data, args, elapsed).rstrip("\n") + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=6144)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="Markdown report (default: print only)")
    run_ranks(worker, report, ap.parse_args())


if __name__ == "__main__":
    main()
