"""A device slows down mid-run: step times with and without hexiseq.rebalance.Rebalancer, measured on CPU ranks.

Usage: python benchmarks/stragglers_cpu.py [--steps 60] [--seq 3072] [--out benchmarks/results/stragglers_cpu.md]

Two Gloo processes (--world 2: rank 0 on core 0, rank 1 on core 1; --world 3 adds rank 2 on core 1, as
benchmarks/heterogeneous_cpu.py pins them), one thread each, calibrated, and the attention layer (12 query heads, 4 kv heads, head dim 64, fp32, causal)
planned by hexiseq on the calibrated cluster (its layout: the report says). Each step is the layer's forward and backward. From step
steps/3 to step 2 steps/3 a competing CPU-bound process runs on core 0, so rank 0, planned as the fastest, computes
at about half its speed. The run is made twice, alternately step by step is not possible (the plans differ), so one
after the other: with a fixed plan, and with a Rebalancer (threshold 0.2, patience 2) checked after every step.
Reported: the median step in each phase (before, during, after the slowdown) for both, and the steps a re-balance
took to happen after each change; a plot of every step. Measured: the slowest rank's step from a common barrier.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import hexiseq  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine  # noqa: E402
from heterogeneous_cpu import MODEL, calibrated, start_rank  # noqa: E402


def burn(stop):
    """A CPU-bound competitor pinned to core 0."""
    os.sched_setaffinity(0, {0})
    x = 1.0
    while not stop.is_set():
        for _ in range(100000):
            x = x * 1.0000001 + 1e-9


def timed_step(attn, plan, rank, q, k, v, do):
    """One forward and backward of the layer on this rank's shard of q, k, v under `plan`: the slowest rank's
    seconds from a common barrier."""
    ql, kl, vl = (plan.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
    dist.barrier()
    t0 = time.perf_counter()
    attn(ql, kl, vl).backward(plan.shard(do, 1, rank))
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def per_phase(attn, plan, rank, world):
    """This step's phases, measured (the context's timers: kernels, all-to-all, exposed ring, waits at the call
    checks) next to the plan's prediction for one layer (its per-device phases over the model's layers), per rank."""
    comm = attn.context.comm
    mine = [comm.phase_s["attn"], comm.phase_s.get("a2a", 0.0), comm.phase_s.get("ring_wait", 0.0)]
    every = [None] * world
    dist.all_gather_object(every, mine)
    L = plan.model.layers
    out = []
    for r in range(world):
        i = plan._slot(r)
        out.append({"measured_ms": [x * 1e3 for x in every[r]],
                    "predicted_ms": [float(plan.devices.attn_s[i]) / L * 1e3, float(plan.devices.a2a_s[i]) / L * 1e3,
                                     float(plan.devices.ring_exposed_s[i]) / L * 1e3]})
    return out


def worker(rank, world, init, args, out_path, control):
    from hexiseq.nn import HexiSeqAttention
    from hexiseq.rebalance import Rebalancer

    cluster = start_rank(rank, world, init)
    training = hexiseq.Training(checkpointing=False, sharding="none")
    plan = hexiseq.plan(cluster, model=MODEL, seq_len=args.seq, strategy="hexiseq", training=training)
    S, H, Hkv, d = args.seq, MODEL.heads, MODEL.kv_heads, MODEL.head_dim
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, S, n, d, generator=g) for n in (H, Hkv, Hkv, H))
    runs = {}
    for mode in ("fixed", "rebalanced", "replanned"):
        attn = HexiSeqAttention(plan)
        rb = Rebalancer(attn, threshold=0.2, patience=2, replan=mode == "replanned") if mode != "fixed" else None
        times, events, tokens = [], [], []
        for step in range(args.steps):
            if rank == 0:  # the competitor: on for the middle third
                if step == args.steps // 3:
                    control.put("start")
                if step == 2 * args.steps // 3:
                    control.put("stop")
            current = rb.plan if rb is not None else plan
            times.append(timed_step(attn, current, rank, q, k, v, do))
            tokens.append([int(current.devices.tokens[current._slot(r)]) for r in range(world)])
            if rb is not None:
                if events and events[-1]["step"] == step - 1:  # the first step on a re-balanced plan
                    events[-1]["layer"] = per_phase(attn, current, rank, world)
                event = rb.check()
                if event is not None:
                    events.append({"step": step, "before": event.before, "after": event.after,
                                   "reason": event.reason})
                    if rank == 0:
                        print(f"step {step}: {event.reason}", flush=True)
        if rank == 0:
            control.put("stop")  # in case the run ended inside the slow third
        runs[mode] = {"times": times, "events": events, "tokens": tokens, "layout": current.layout.to_dict()}
        attn.context.close()
        dist.barrier()
    # What the Rebalancer should come back to: a fresh calibration and plan made with the competitor running, then
    # steps/3 steps on that plan, the competitor still running
    if rank == 0:
        control.put("start")
    time.sleep(2.0)  # the competitor up and running on core 0
    dist.barrier()
    t_cal = time.perf_counter()
    fresh_cluster = calibrated(rank)
    fresh = hexiseq.plan(fresh_cluster, model=MODEL, seq_len=args.seq, strategy="hexiseq", training=training)
    t_cal = time.perf_counter() - t_cal
    attn = HexiSeqAttention(fresh)
    times = [timed_step(attn, fresh, rank, q, k, v, do) for _ in range(args.steps // 3)]
    attn.context.close()
    if rank == 0:
        control.put("stop")
    runs["fresh"] = {"times": times, "calibrate_and_plan_s": t_cal, "layout": fresh.layout.to_dict(),
                     "tokens": [int(fresh.devices.tokens[fresh._slot(r)]) for r in range(world)]}
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"cluster": cluster.to_dict(), "runs": runs, "initial": plan.layout.to_dict()}, f)
    dist.barrier()
    dist.destroy_process_group()


def phases(times, n):
    a, b = n // 3, 2 * n // 3
    return [statistics.median(times[1:a]), statistics.median(times[a:b]), statistics.median(times[b:])]


def plot(runs, n, png):
    """Every step of the runs, the slow third shaded, the fresh plan's median; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot([t * 1e3 for t in runs["fixed"]["times"]], label="fixed plan", color="#888888")
    ax.plot([t * 1e3 for t in runs["rebalanced"]["times"]], label="Rebalancer", color="#1f77b4")
    ax.plot([t * 1e3 for t in runs["replanned"]["times"]], label="Rebalancer, replan=True", color="#2ca02c")
    ax.axvspan(n // 3, 2 * n // 3, color="#f2d0a4", alpha=0.5, label="competitor on rank 0's core")
    ax.hlines(statistics.median(runs["fresh"]["times"][1:]) * 1e3, n // 3, 2 * n // 3, colors="#d62728",
              linestyles="dashed", label="fresh calibrate + plan, competitor running (median)")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, measured)")
    ax.legend(loc="lower center", fontsize=8, ncol=2)  # below the lines, which all run above 140 ms
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--world", type=int, default=2, choices=(2, 3),
                    help="2: rank 0 on core 0, rank 1 on core 1; 3: rank 2 shares core 1 with rank 1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        sys.exit("needs cores 0 and 1")
    tmp = tempfile.mkdtemp()
    out_path = os.path.join(tmp, "runs.json")
    ctx = multiprocessing.get_context("spawn")
    control = ctx.Queue()
    stop = ctx.Event()
    competitor = []

    def steer():
        while True:
            msg = control.get()
            if msg == "start" and not competitor:
                stop.clear()
                p = ctx.Process(target=burn, args=(stop,))
                p.start()
                competitor.append(p)
            elif msg == "stop" and competitor:
                stop.set()
                competitor.pop().join()
            elif msg == "end":
                return
    import threading
    th = threading.Thread(target=steer, daemon=True)
    th.start()
    t0 = time.time()
    mp.spawn(worker, args=(args.world, "file://" + os.path.join(tmp, "store"), args, out_path, control),
             nprocs=args.world)
    control.put("stop")
    control.put("end")
    th.join(timeout=10)
    with open(out_path) as f:
        data = json.load(f)
    runs = data["runs"]
    n = args.steps
    fixed, reb, rep = (phases(runs[m]["times"], n) for m in ("fixed", "rebalanced", "replanned"))
    lines = ["# A device slows down mid-run: a fixed plan against the Rebalancer", "",
             f"Machine: {machine()}. Command: `python benchmarks/stragglers_cpu.py --steps {n} --seq {args.seq} "
             f"--world {args.world}` ({time.time() - t0:.0f} s). {args.world} Gloo ranks, one thread each (rank 0 on "
             f"core 0, {'rank 1 on core 1' if args.world == 2 else 'ranks 1 and 2 sharing core 1'}), calibrated; the attention layer (12/4 heads, head dim 64, fp32, causal) planned by "
             f"hexiseq on the calibrated cluster (layout {data['initial']['groups']}), {args.seq} tokens, forward "
             "and backward per step. A CPU-bound competitor runs on core 0 (rank "
             f"0's) from step {n // 3} to step {2 * n // 3}. Measured: the slowest rank's step; medians per phase.", "",
             "| phase | fixed plan (ms) | with the Rebalancer (ms) | fixed / rebalanced | Rebalancer with replan=True "
             "(ms) | fixed / replanned |", "|---|---:|---:|---:|---:|---:|"]
    for name, a, b, c in zip(("before", "during the slowdown", "after"), fixed, reb, rep):
        lines.append(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {c * 1e3:.1f} | {a / c:.2f}x |")
    for mode in ("rebalanced", "replanned"):
        lines += ["", f"Re-balances, {mode} run (the step after which each ran, tokens per rank):", ""]
        for e in runs[mode]["events"]:
            planned = e["reason"].split("; planned afresh: ")
            lines.append(f"- step {e['step']}: {e['before']} -> {e['after']} ({e['reason'].split(';')[0]}"
                         + (f"; planned afresh: {planned[1]}" if len(planned) > 1 else "") + ")")
            for r, ph in enumerate(e.get("layer", [])):  # the next step, per phase: measured / predicted (ms)
                lines.append(f"  - step {e['step'] + 1}, rank {r}: " + ", ".join(
                    f"{name} {m:.1f} / {p:.1f}" for name, m, p in
                    zip(("attention kernels", "all-to-all", "exposed ring"), ph["measured_ms"], ph["predicted_ms"]))
                    + " ms measured / predicted")
    lines.append("")
    # the Rebalancer's steps once it has acted in the slow third, against a fresh calibration and plan made then
    fresh = runs["fresh"]
    b = statistics.median(fresh["times"][1:])
    lines += [f"A fresh `hexiseq.calibrate` and plan made with the competitor running (took "
              f"{fresh['calibrate_and_plan_s']:.1f} s; tokens per rank {fresh['tokens']}), then {len(fresh['times'])} "
              f"steps on it with the competitor still running: {b * 1e3:.1f} ms (median of the steps after the first).",
              ""]
    for mode in ("rebalanced", "replanned"):
        first = [e["step"] for e in runs[mode]["events"] if n // 3 <= e["step"] < 2 * n // 3]
        settled = runs[mode]["times"][first[0] + 2:2 * n // 3] if first else []
        if settled:
            a = statistics.median(settled)
            lines += [f"- {mode}: during the slowdown, once re-balanced (steps {first[0] + 2}-{2 * n // 3 - 1}): "
                      f"{a * 1e3:.1f} ms, {a / b:.2f}x the fresh plan's step."]
        else:
            lines += [f"- {mode}: the Rebalancer did not act during the slowdown."]
    lines.append("")
    if args.out and plot(runs, n, os.path.splitext(args.out)[0] + ".png"):
        lines += [f"![step times]({os.path.basename(os.path.splitext(args.out)[0])}.png)", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
