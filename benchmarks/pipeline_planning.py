"""Pipeline plans against the plans of today (one layout over every device, or data parallel groups), predicted, in
one run, with the compute floor of each case.

Usage: python benchmarks/pipeline_planning.py [--out benchmarks/results/pipeline_planning.md] [--quick]

Cases (every training with activation checkpointing, both sides alike):
  A  Llama-3-70B, 16 x 128K, 128 H100 (16 nodes of 8, 50 GB/s between nodes)
  B  Llama-3-70B, 64 x 128K, 1,024 H100 (128 nodes of 8, 25 GB/s)
  C  a 106B model (80 layers, hidden 10240, 80 heads, 8 kv heads, ffn 35840), 128 x 32K, 1,024 GPUs of four kinds
     in turn (H100-SXM, A100-80G, H800, L40S; 128 nodes of 8, 25 GB/s)
  D  Llama-3-70B, 64 x 128K, 8,192 GPUs of six kinds in turn (1,024 nodes of 8, 25 GB/s): the batch planner's
     pricing of its candidate groups takes minutes here (--quick leaves the case out)

Today's plan: hexiseq.plan(..., training=Training(sequences=N, checkpointing=True)), which returns the batch plan
(groups, data parallel) where it is predicted faster than one layout over every device (on clusters up to 1,024
devices; case D asks for it, batch=True). The pipeline plan: hexiseq.planner.plan_pipeline on the same input. Every
step time is the cost model's prediction (a pipeline's with its schedule simulated); planning times are measured on
this machine. MFU: model FLOPs per second over the devices' dense bf16 peak."""

import argparse
import sys
import time

import hexiseq
from hexiseq.planner.floor import compute_floor_s, model_flops, peak_flops
from hexiseq.planner.pipeline import plan_pipeline

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402

BIG = hexiseq.Model(layers=80, hidden=10240, heads=80, kv_heads=8, head_dim=128, ffn=35840, vocab=128256,
                    gated_mlp=True, name="106b")


def cluster(kinds, nodes, inter):
    return hexiseq.Cluster.from_dict({"nodes": [{"gpu": kinds[i % len(kinds)], "count": 8, "intra_gbps": 450.0}
                                                for i in range(nodes)], "inter_node_gbps": inter})


CASES = [
    ("A", "llama3-70b", 131072, 16, ["H100-SXM"], 16, 50.0, "auto"),
    ("B", "llama3-70b", 131072, 64, ["H100-SXM"], 128, 25.0, "auto"),
    ("C", BIG, 32768, 128, ["H100-SXM", "A100-80G", "H800", "L40S"], 128, 25.0, "auto"),
    ("D", "llama3-70b", 131072, 64, ["H100-SXM", "A100-80G", "A800", "L40S", "H800", "A100-40G"], 1024, 25.0, True),
]


def describe(p) -> str:
    if isinstance(p, hexiseq.planner.BatchPlan):
        sizes = sorted({len(g) for g in p.groups})
        return f"{len(p.groups)} groups of {'/'.join(map(str, sizes))} devices, data parallel"
    return f"one layout over all {p.cluster.num_devices} devices, run once per sequence"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="leave out case D (8,192 devices)")
    args = ap.parse_args()
    rows, notes = [], []
    for name, model, S, n, kinds, nodes, inter, batch in CASES:
        if args.quick and name == "D":
            continue
        c = cluster(kinds, nodes, inter)
        tr = hexiseq.Training(sequences=n, checkpointing=True)
        m = hexiseq.Model.preset(model) if isinstance(model, str) else model
        floor = compute_floor_s(c, m, S, n)
        peak = peak_flops(c, None)
        flops = sum(model_flops(m, S, n))
        print(f"case {name}: {m.name}, {n} x {S:,} on {c.describe()}", flush=True)
        t0 = time.perf_counter()
        today = hexiseq.plan(c, model=m, seq_len=S, training=tr, batch=batch)
        t_today = time.perf_counter() - t0
        print(f"  today: {today.step_time_s:.4g} s ({describe(today)}), planned in {t_today:.1f} s", flush=True)
        t0 = time.perf_counter()
        pp = plan_pipeline(c, model=m, seq_len=S, training=tr)
        t_pipe = time.perf_counter() - t0
        print(f"  pipeline: {pp.step_time_s:.4g} s ({len(pp.pipelines)} x {len(pp.stages)} stages), planned in "
              f"{t_pipe:.1f} s", flush=True)
        rows.append((name, m, S, n, c, today, t_today, pp, t_pipe, floor, peak, flops))
        notes.append(f"### Case {name}\n\n```\n{pp.explain()}\n```\n")
    lines = ["# Pipeline plans against today's plans (predicted)", "",
             f"Machine: {machine()}. Command: `python benchmarks/pipeline_planning.py"
             f"{' --quick' if args.quick else ''}`. Every step time is the cost model's prediction; planning times "
             "are measured. Every training checkpoints activations. Floor: the step's model FLOPs at the devices' "
             "catalog matmul and attention rates (below every plan). MFU: model FLOPs per second over the devices' "
             "dense peak.", "",
             "| case | model, batch | cluster | today's plan | step (s) | MFU | pipeline plan | step (s) | MFU | "
             "pipeline / today | floor (s) | planning today / pipeline (s) |",
             "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, m, S, n, c, today, t_today, pp, t_pipe, floor, peak, flops in rows:
        lines.append(f"| {name} | {m.name}, {n} x {S // 1024}K | {c.describe()} | {describe(today)} | "
                     f"{today.step_time_s:.4g} | {100 * flops / (today.step_time_s * peak):.1f}% | "
                     f"{len(pp.pipelines)} pipeline(s) of {len(pp.stages)} stages, layers "
                     f"{'/'.join(str(s.layers) for s in pp.stages)} | "
                     f"{pp.step_time_s:.4g} | {100 * pp.mfu:.1f}% | {today.step_time_s / pp.step_time_s:.2f}x | "
                     f"{floor:.4g} | {t_today:.1f} / {t_pipe:.1f} |")
    lines += ["", "pipeline / today: today's step over the pipeline's (above 1: the pipeline is predicted faster).",
              "", "## The pipeline plans", ""] + notes
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
