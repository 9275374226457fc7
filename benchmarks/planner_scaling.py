"""Planner wall time for clusters of 8 to 65,536 GPUs of four models (H100, A100, A800, L40S).

Usage: python benchmarks/planner_scaling.py [--repeat 3] [--sizes 8,32,128,512,1024] [--model gpt-13b]
                                            [--tokens-per-device N] [--no-baselines] [--out FILE.md [--append]]

Each cluster is nodes of 8 GPUs (2 per node for the 8-GPU case), the four models in turn, NVLink
450/300/200 GB/s for H100/A100/A800, PCIe 32 GB/s for L40S, 25 GB/s between nodes; activation checkpointing.
The default workload is GPT-style 13B on 256k tokens (up to 32 GPUs) or 1m; --model llama3-70b
--tokens-per-device 8192 is the large-cluster workload (sequence = 8192 x GPUs, e.g.
--sizes 128,1024,4096,16384,65536). Reported: median wall time of hexiseq.plan(strategy="hexiseq") over
--repeat runs, the ratio to the previous size when the sizes double, the layouts scored, the predicted
speedup over the best baseline (same cost model; --no-baselines skips planning them, which takes as long
again at large sizes), and the paper's planning time for comparison (9 s at 128 GPUs, 444 s at 1024)."""

import argparse
import os
import platform
import statistics
import sys
import time

import hexiseq
from _machine import machine

GPUS = [("H100-SXM", 450.0), ("A100-80G", 300.0), ("A800", 200.0), ("L40S", 32.0)]
PAPER_S = {128: 9.0, 1024: 444.0}


def cluster_of(n):
    per_node = 2 if n == 8 else 8
    nodes = [{"gpu": GPUS[i % 4][0], "count": per_node, "intra_gbps": GPUS[i % 4][1]} for i in range(n // per_node)]
    return hexiseq.Cluster.from_dict({"nodes": nodes, "inter_node_gbps": 25.0})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="8,32,128,512,1024", help="GPU counts (8, or multiples of 8 up to 65536)")
    ap.add_argument("--model", default="gpt-13b", help="model preset (default gpt-13b)")
    ap.add_argument("--tokens-per-device", type=int,
                    help="sequence = this x GPUs (default: 256k up to 32 GPUs, else 1m)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the baselines (no speedup column)")
    ap.add_argument("--out", help="write a Markdown table here")
    ap.add_argument("--append", action="store_true", help="add the table to --out instead of replacing the file")
    args = ap.parse_args(argv)
    training = hexiseq.Training(checkpointing=True)
    rows = []
    prev = None
    for n in [int(x) for x in args.sizes.split(",")]:
        cluster = cluster_of(n)
        if args.tokens_per_device:
            seq = args.tokens_per_device * n
            seq_text = f"{seq // 1048576}m" if seq % 1048576 == 0 else f"{seq // 1024}k"
        else:
            seq = seq_text = "256k" if n <= 32 else "1m"
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = hexiseq.plan(cluster, model=args.model, seq_len=seq, strategy="hexiseq", training=training)
            times.append(time.perf_counter() - t0)
        if args.no_baselines:
            sp_text = "-"
        else:
            base = [p for name, p in hexiseq.compare(cluster, model=args.model, seq_len=seq,
                                                    training=training).items()
                    if name != "hexiseq" and isinstance(p, hexiseq.Plan)]
            speedup = min(p.step_time_s for p in base) / plan.step_time_s if base else None
            sp_text = f"{speedup:.3f}x" if speedup else "no baseline fits in memory"
        med = statistics.median(times)
        ratio = f"{med / prev[1]:.2f}x" if prev and n == 2 * prev[0] else "-"
        prev = (n, med)
        evals = plan._search["evaluations"]  # layouts the cost model priced
        rows.append((n, seq_text, med, min(times), ratio, evals, plan.num_groups, sp_text,
                     PAPER_S.get(n)))
        paper = f"{PAPER_S[n]:.0f} s (ours {PAPER_S[n] / med:,.0f}x faster)" if n in PAPER_S else "-"
        print(f"{n:>5} GPUs  seq {seq_text:>5}  plan {med * 1e3:9.1f} ms (min {min(times) * 1e3:.1f}, {ratio} "
              f"per doubling)  scored {evals}  groups {plan.num_groups:>4}  "
              f"speedup vs best baseline {sp_text}  paper {paper}", flush=True)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            if not args.append:
                f.write("# Planner scaling\n\n")
                f.write(f"Machine: {machine()}, Python {platform.python_version()}, hexiseq {hexiseq.__version__}. "
                        "Shared with other jobs while it ran: times are medians of the runs, and their spread is "
                        "noise.\n\n")
            work = (f"{args.model}, {args.tokens_per_device} tokens per GPU" if args.tokens_per_device
                    else f"{args.model}, 256k tokens up to 32 GPUs, else 1m")
            f.write(f"## {work}\n\n")
            script = os.path.relpath(os.path.abspath(__file__))  # as run from this working directory
            f.write(f"Command: `python {script} {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
            f.write("Clusters: nodes of 8 GPUs (2 for the 8-GPU case) cycling H100-SXM, A100-80G, A800, L40S; "
                    f"{work}, activation checkpointing. Time: median wall time of "
                    f"`hexiseq.plan(strategy=\"hexiseq\")` over {args.repeat} runs (min: the fastest); per "
                    "doubling: median over the previous size's; scored: layouts the cost model priced.\n\n")
            f.write("| GPUs | seq | plan time (median) | min | per doubling | scored | groups | predicted speedup vs best "
                    "baseline | paper's planner |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
            for n, seq, med, lo, ratio, evals, groups, sp, paper in rows:
                p = f"{paper:.0f} s" if paper else "-"
                f.write(f"| {n} | {seq} | {med * 1e3:.1f} ms | {lo * 1e3:.1f} ms | {ratio} | {evals} | {groups} | {sp} "
                        f"| {p} |\n")
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
