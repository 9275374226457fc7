"""The one-time pricing of a BatchPlanner (its first plan prices every kind of candidate group it needs) with the
kinds priced one at a time and side by side on the machine's cores, in the same run.

Usage: python benchmarks/batch_pricing.py [--sizes 128,1024] [--reps 2] [--out benchmarks/results/batch_pricing.md]

The clusters, model and batches are those of benchmarks/batch_planning.py (gpt-7b with activation checkpointing,
mixed nodes of six GPU models, about 16K tokens per GPU, the "pretraining long tail" lengths). Each timing runs in a
fresh process (nothing priced carries over), the settings alternating; the plans of both settings are checked to be
the same. Times are measured on this machine."""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _machine import machine  # noqa: E402

ONE = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {bench!r}); sys.path.insert(0, {root!r})
import batch_planning as bp
from hexiseq.planner.batch import BatchPlanner
size, threads = {size}, {threads}
lengths = bp.distribution("pretraining long tail", 16384 * size, np.random.default_rng(0))
planner = BatchPlanner(bp.cluster(size), model=bp.MODEL, training=bp.TRAINING, threads=threads)
t0 = time.perf_counter()
plan = planner.plan(lengths, exact=False)
took = time.perf_counter() - t0
print(json.dumps({{"seconds": took, "kinds": len(planner._kinds_list), "sequences": len(lengths),
                  "plan": [plan.groups, list(plan.assignment), plan.step_time_s]}}))
"""


def timed(size, threads):
    here = os.path.dirname(os.path.abspath(__file__))
    code = ONE.format(bench=here, root=os.path.dirname(here), size=size, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128,1024")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = ["# Batch planning: the one-time pricing, kinds one at a time and side by side", "",
             f"Machine: {machine()}. Command: `python benchmarks/batch_pricing.py --sizes {args.sizes} --reps "
             f"{args.reps}`. Measured: the first `BatchPlanner.plan(lengths, exact=False)` of a fresh planner (gpt-7b, "
             "the pretraining long tail of `batch_planning.py`), each in its own process, the settings alternating.",
             "", f"| GPUs | sequences | kinds priced | one thread (s) | {cores} threads (s) | speed-up | same plans |",
             "|---:|---:|---:|---|---|---:|---|"]
    for size in (int(x) for x in args.sizes.split(",")):
        runs = {1: [], cores: []}
        for _ in range(args.reps):
            for threads in runs:
                runs[threads].append(timed(size, threads))
                print(size, threads, f"{runs[threads][-1]['seconds']:.2f} s", flush=True)
        same = all(r["plan"] == runs[1][0]["plan"] for rs in runs.values() for r in rs)
        one = [r["seconds"] for r in runs[1]]
        many = [r["seconds"] for r in runs[cores]]
        lines.append(f"| {size} | {runs[1][0]['sequences']} | {runs[1][0]['kinds']} | "
                     f"{', '.join(f'{x:.1f}' for x in one)} | {', '.join(f'{x:.1f}' for x in many)} | "
                     f"{min(one) / min(many):.2f}x | {'yes' if same else 'NO'} |")
    lines += ["", "Speed-up: the fastest of each setting's runs, one over the other."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
