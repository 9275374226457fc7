"""Packed documents on devices of unequal speed, measured: a plan made for the documents against the plan made for
one causal document, both run on the same packed batch, next to their predictions.

Usage: python benchmarks/heterogeneous_documents.py [--seq 4096] [--iters 5] [--out benchmarks/results/heterogeneous_documents.md]

The machine set-up of benchmarks/heterogeneous_cpu.py: three Gloo processes, rank 0 alone on core 0, ranks 1 and 2
sharing core 1 (so rank 0 computes about twice as fast), calibrated with hexiseq.calibrate. For each profile of
document lengths (drawn once, fixed seed, adding up to --seq):
  aware    hexiseq.plan(cluster, ..., documents=lengths): pairs counted under the document mask, chunking chosen;
  unaware  hexiseq.plan(cluster, ...): the plan for one causal document, what a planner without documents gives;
  aware, other chunking: the aware layout with the chunking it did not choose (a check of that choice);
both run with the same documents per call (hexiseq.measure(plan, documents=lengths): the attention layer,
forward + backward, slowest rank from a common start, median of --iters), and both predicted by the cost model
under the same documents. Reported per profile: measured and predicted time of each, the measured and predicted
gain of the aware plan (unaware / aware), and the prediction error. The measured figures are measurements on
this CPU; the predicted ones are the cost model's, on the calibrated cluster. Takes a few minutes."""

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import hexiseq  # noqa: E402
from hexiseq import measure  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine  # noqa: E402
from heterogeneous_cpu import MODEL, finish_rank, layout_text, run_ranks, start_rank  # noqa: E402


def profiles(seq):
    """Document lengths of a few batch profiles, in sequence order, each adding up to seq."""
    rng = np.random.default_rng(7)

    def fill(total, lo, hi):
        out, left = [], total
        while left:
            n = min(left, int(rng.integers(lo, hi + 1)))
            out.append(n)
            left -= n
        return out

    return {
        "short (64-256 tokens)": fill(seq, 64, 256),
        "medium (256-1024 tokens)": fill(seq, 256, 1024),
        "one long + short": [seq // 2] + fill(seq - seq // 2, 64, 256),
    }


def worker(rank, world, init, args, result_path):
    cluster = start_rank(rank, world, init)
    training = hexiseq.Training(checkpointing=False, sharding="full")
    unaware = hexiseq.plan(cluster, model=MODEL, seq_len=args.seq, strategy="hexiseq", training=training)
    results = {}
    for name, docs in profiles(args.seq).items():
        aware = hexiseq.plan(cluster, model=MODEL, seq_len=args.seq, strategy="hexiseq", training=training,
                             documents=docs)
        row = {"documents": len(docs), "longest": max(docs)}
        # the aware layout with the other chunking: checks the pricing of the choice between the two
        other = dict(aware.layout.to_dict(), chunking=[c for c in hexiseq.Layout.CHUNKINGS
                                                       if c != aware.layout.chunking][0])
        swapped = hexiseq.evaluate(cluster, model=MODEL, seq_len=args.seq, layout=other, training=training,
                                   strategy="hexiseq", documents=docs)
        for which, plan in (("aware", aware), ("unaware", unaware), ("aware, other chunking", swapped)):
            m = measure(plan, iters=args.iters, warmup=1, layer="attention", documents=docs)
            row[which] = {"layout": layout_text(plan), "chunking": plan.layout.chunking,
                          "measured_s": m.step_s, "predicted_s": m.predicted_step_s,
                          "ranks": m.ranks, "samples_s": m.step_samples_s}
            if rank == 0:
                print(f"{name:<26} {which:<22} measured {m.step_s * 1e3:8.1f} ms  predicted "
                      f"{m.predicted_step_s * 1e3:8.1f} ms  {plan.layout.chunking:<10} {row[which]['layout']}",
                      flush=True)
        results[name] = row
    finish_rank(rank, cluster, results, result_path)


def report(data, args, elapsed):
    lines = ["# Packed documents on ranks of unequal speed, measured", "",
             f"Machine: {machine()}. Gloo, one thread per process; rank 0 alone on core 0, ranks 1 and 2 sharing "
             "core 1; calibrated with hexiseq.calibrate.", "",
             f"Command: `python benchmarks/heterogeneous_documents.py --seq {args.seq} --iters {args.iters}` "
             f"({elapsed:.0f} s).", "",
             f"Model: {MODEL.heads} query heads, {MODEL.kv_heads} kv heads, head_dim {MODEL.head_dim}, fp32, "
             f"{args.seq} tokens; the attention layer forward + backward under the document mask. **aware**: the "
             "plan made for the documents; **unaware**: the plan made for one causal document. Both run the same "
             "batch. Measured: slowest rank from a common start, median of the runs (a measurement). Predicted: "
             "the cost model on the calibrated cluster, same layout, same documents (a prediction).", "",
             "| profile | documents | plan | layout (device:tokens/heads per group) | chunking | measured ms | "
             "predicted ms | measured/predicted |",
             "|---|---:|---|---|---|---:|---:|---:|"]
    gains = []
    for name, row in data["results"].items():
        for which in ("aware", "unaware", "aware, other chunking"):
            r = row[which]
            lines.append(f"| {name} | {row['documents']} | {which} | {r['layout']} | {r['chunking']} | "
                         f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                         f"{r['measured_s'] / r['predicted_s']:.3f} |")
        a, u = row["aware"], row["unaware"]
        gains.append(f"- {name}: the aware plan is **{u['measured_s'] / a['measured_s']:.3f}x** as fast measured "
                     f"(predicted {u['predicted_s'] / a['predicted_s']:.3f}x)"
                     + (" — the same layout: the documents do not change this plan" if a["layout"] == u["layout"]
                        and a["chunking"] == u["chunking"] else ""))
        o = row["aware, other chunking"]
        gains.append(f"  - its chunking ({a['chunking']}) against the same layout {o['chunking']}: "
                     f"**{o['measured_s'] / a['measured_s']:.3f}x** as fast measured (predicted "
                     f"{o['predicted_s'] / a['predicted_s']:.3f}x)")
    phases = ["", "Per rank, ms, measured / predicted (attn: block kernels and merges; a2a: all-to-all waits; ring: "
              "exposed ring waits; sync: waits at the per-call checks for slower ranks, predicted 0; rest: the "
              "runtime's work around the kernels, predicted from the calibrated runtime curves):", "",
              "| profile | plan | rank | tokens | heads | attn | a2a | ring | sync | rest |",
              "|---|---|---:|---:|---:|---|---|---|---|---|"]
    for name, row in data["results"].items():
        for which in ("aware", "unaware", "aware, other chunking"):
            for r in row[which].get("ranks", []):
                cells = " | ".join(f"{r['measured'][k] * 1e3:.1f} / {r['predicted'][k] * 1e3:.1f}"
                                   for k in ("attn", "a2a", "ring", "sync", "rest"))
                phases.append(f"| {name} | {which} | {r['rank']} | {r['tokens']} | {r['heads']} | {cells} |")
    return "\n".join(lines + [""] + gains + phases) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="Markdown report (default: print only)")
    run_ranks(worker, report, ap.parse_args())


if __name__ == "__main__":
    main()
