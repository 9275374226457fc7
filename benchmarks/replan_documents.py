"""Re-planning per batch of packed documents: wall time of a full plan and of re-balancing a plan, 128 GPUs, 1M tokens.

Usage: python benchmarks/replan_documents.py [--repeat 5] [--gpus 128] [--counts 100,1000,10000] [--out FILE.md]

Documents change every batch, so a plan made for one batch is re-split for the next. Two ways, timed side by side
on the same batches (medians of --repeat runs, wall time of the Python call, checks included):
  full        hexiseq.plan(cluster, ..., documents=lengths, strategy="hexiseq"): the whole search;
  rebalanced  plan.rebalanced(lengths): the structure (groups, heads, ring order) of a plan made once for another
              batch of the same profile kept, the sequence split (S_g, token shares, chunking) optimised again.
Also the predicted step time of each (a prediction of the cost model, not a measurement) and, for reference, the
predicted step time of the plan made for one causal document run on the same batch. Document lengths are drawn
from a log-normal (sigma 1) with the given count, summing to the sequence. Cluster: the planner-scaling cluster
(nodes of 8 GPUs cycling H100-SXM, A100-80G, A800, L40S; 25 GB/s between nodes), GPT-style 13B, checkpointing."""

import argparse
import statistics
import sys
import time

import numpy as np

import hexiseq
from _machine import machine
from planner_scaling import cluster_of


def lengths(count, total, seed):
    w = np.random.default_rng(seed).lognormal(0.0, 1.0, count)
    out = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
    out[np.argmax(out)] += total - int(out.sum())
    return out


def timed(fn, repeat):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--seq-len", default="1m")
    ap.add_argument("--model", default="gpt-13b")
    ap.add_argument("--counts", default="100,1000,10000", help="documents per batch")
    ap.add_argument("--out", help="write a Markdown report here")
    args = ap.parse_args(argv)
    cluster = cluster_of(args.gpus)
    seq = hexiseq._validate.parse_tokens(args.seq_len)
    training = hexiseq.Training(checkpointing=True)
    kw = dict(model=args.model, seq_len=seq, training=training, strategy="hexiseq")
    one_doc = hexiseq.plan(cluster, **kw)
    rows = []
    for count in [int(c) for c in args.counts.split(",")]:
        base = hexiseq.plan(cluster, **kw, documents=lengths(count, seq, seed=1))  # planned once per profile
        batch = lengths(count, seq, seed=2)  # the batch at hand
        full_med, full_min, full = timed(lambda: hexiseq.plan(cluster, **kw, documents=batch), args.repeat)
        re_med, re_min, re = timed(lambda: base.rebalanced(batch), args.repeat)
        under = hexiseq.evaluate(cluster, model=args.model, seq_len=seq, training=training, layout=one_doc.layout,
                                 documents=batch)
        rows.append((count, full_med, full_min, re_med, re_min, full.step_time_s, re.step_time_s,
                     under.step_time_s, full.num_groups, full.layout.chunking))
        print(f"{count:>6} documents  full plan {full_med * 1e3:8.2f} ms (min {full_min * 1e3:.2f})  rebalanced "
              f"{re_med * 1e3:7.2f} ms (min {re_min * 1e3:.2f})  predicted step: full {full.step_time_s:.3f} s, "
              f"rebalanced {re.step_time_s:.3f} s, one-document plan {under.step_time_s:.3f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Re-planning per batch of packed documents\n\n")
            f.write(f"{machine()}\n\n")
            f.write(f"Command (in benchmarks/): `python replan_documents.py {' '.join(sys.argv[1:])}`\n\n")
            f.write(f"{args.gpus} GPUs (nodes of 8 cycling H100-SXM, A100-80G, A800, L40S), {args.model}, "
                    f"{seq:,} tokens, checkpointing. Times: wall time of the Python call, median of {args.repeat} "
                    f"(min). Step times are predictions of the cost model, not measurements.\n\n")
            f.write("| documents | full plan | min | rebalanced | min | predicted step: full plan | rebalanced | "
                    "one-document plan on the batch | groups (full) | chunking (full) |\n")
            f.write("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|\n")
            for c, fm, fn, rm, rn, fs, rs, us, g, ch in rows:
                f.write(f"| {c:,} | {fm * 1e3:.1f} ms | {fn * 1e3:.1f} ms | {rm * 1e3:.2f} ms | {rn * 1e3:.2f} ms | "
                        f"{fs:.3f} s | {rs:.3f} s | {us:.3f} s | {g} | {ch} |\n")


if __name__ == "__main__":
    main()
