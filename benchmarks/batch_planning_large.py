"""A batch of 64 sequences of 128K tokens for Llama-3-70B on 8,192 mixed GPUs: the batch planner against one plan
over every device, predicted.

Usage: python benchmarks/batch_planning_large.py [--out benchmarks/results/batch_planning_large.md]

The cluster: 1,024 nodes of 8 GPUs, six kinds in turn (H100-SXM, A100-80G, A800, L40S, H800, A100-40G), 300 GB/s
inside a node, 25 GB/s between nodes. Compared: hexiseq.BatchPlanner(...).plan([131072] * 64) (groups from the
planner's candidate tree, data parallel across groups, each group's own asymmetric layout) and hexiseq.plan with
Training(sequences=64) (one sequence's plan over all 8,192 devices, run 64 times per step, states sharded over all).
Every time is the cost model's prediction; the solve times are measured on this machine."""

import argparse
import sys
import time

import hexiseq

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402

KINDS = ["H100-SXM", "A100-80G", "A800", "L40S", "H800", "A100-40G"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": KINDS[i % 6], "count": 8, "intra_gbps": 300.0}
                                                   for i in range(1024)], "inter_node_gbps": 25.0})
    lengths = [131072] * 64
    t0 = time.perf_counter()
    planner = hexiseq.BatchPlanner(cluster, model="llama3-70b")
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    bp = planner.plan(lengths, exact=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = planner.plan(lengths, exact=False)
    second = time.perf_counter() - t0
    assert again.groups == bp.groups
    t0 = time.perf_counter()
    one = hexiseq.plan(cluster, model="llama3-70b", seq_len=131072, training=hexiseq.Training(sequences=64),
                       batch=False)
    single = time.perf_counter() - t0
    sizes = sorted({len(g) for g in bp.groups})
    lines = ["# 64 sequences of 128K tokens, Llama-3-70B, 8,192 mixed GPUs: batch plan against one plan", "",
             f"Machine: {machine()}. Command: `python benchmarks/batch_planning_large.py`. Every step time is "
             "predicted by the cost model; solve times are measured.", "",
             "Cluster: 1,024 nodes of 8 GPUs, six kinds in turn (H100-SXM, A100-80G, A800, L40S, H800, A100-40G), "
             "300 GB/s inside a node, 25 GB/s between nodes.", "",
             "| plan | groups | step (s, predicted) | lower bound (s) | step / bound |", "|---|---|---:|---:|---:|",
             f"| batch plan (`BatchPlanner.plan`) | {len(bp.groups)} of {', '.join(map(str, sizes))} devices, "
             f"{max(len(bp.sequences_of(g)) for g in range(len(bp.groups)))} sequences each | "
             f"{bp.step_time_s:.2f} | {bp.lower_bound_s:.2f} | {bp.step_time_s / bp.lower_bound_s:.2f} |",
             "| one plan over every device, 64 sequences a step (`plan`, `Training(sequences=64)`, `batch=False`) | "
             f"1 of 8192 devices | {one.step_time_s:.1f} | {bp.lower_bound_s:.2f} (the batch's bound) | "
             f"{one.step_time_s / bp.lower_bound_s:.0f} |", "",
             f"- batch plan against one plan: {one.step_time_s / bp.step_time_s:.0f}x faster (predicted); of the batch "
             f"plan's step, {bp.sync_s:.3f} s is the gradient all-reduce across groups",
             f"- solve: candidate tree {made:.1f} s ({bp.candidates} candidates), first plan {first:.0f} s (pricing "
             f"every kind of group it needs, once per job), the next step's plan {second:.2f} s; the one plan "
             f"{single:.1f} s (measured)", "", "```", bp.explain().split("\n  group")[0], "```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
