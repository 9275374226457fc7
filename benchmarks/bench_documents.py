"""What the document mask saves on the CPU kernels: attention forward + backward of one packed sequence, plain
causal (one document) against the same length cut into documents, side by side in the same run.

Usage: python benchmarks/bench_documents.py [--seq 8192] [--heads 8] [--head-dim 64] [--docs 1,8,64]
                                            [--reps 3] [--out benchmarks/results/documents.md]

Reported per setting: the best of --reps forward + backward wall times through hexiseq.ops (fp32, all cores),
its speedup over plain causal, and the fraction of the causal pairs the documents leave visible (the work a
perfect skip would do)."""

import argparse
import sys
import time

import numpy as np

from hexiseq import ops
from _machine import machine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--docs", default="1,8,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    S = args.seq
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, S, args.heads, args.head_dim)).astype(np.float32) for _ in range(4))

    def run(q_doc):
        t = time.perf_counter()
        out, lse = ops.attention_forward(q, k, v, q_doc=q_doc)
        ops.attention_backward(q, k, v, out, lse, dout, q_doc=q_doc)
        return time.perf_counter() - t

    rows, base = [], None
    for n in (int(x) for x in args.docs.split(",")):
        lengths = [S // n + (1 if i < S % n else 0) for i in range(n)]
        q_doc = None if n == 1 else ops.document_starts(lengths)
        best = min(run(q_doc) for _ in range(args.reps))
        base = best if base is None else base
        visible = sum(x * (x + 1) / 2 for x in lengths) / (S * (S + 1) / 2)
        rows.append(f"| {n} | {S // n:,} | {best:.3f} | {base / best:.1f}x | {visible:.4f} |")
    text = "\n".join([
        "# Document mask on the CPU kernels: forward + backward, measured", "",
        f"{machine()}; [1, {S}, {args.heads}, {args.head_dim}] fp32 through hexiseq.ops, best of {args.reps}, "
        f"same run. Command: `python benchmarks/bench_documents.py --seq {S} --heads {args.heads} "
        f"--head-dim {args.head_dim} --docs {args.docs} --reps {args.reps}`", "",
        "| documents | tokens each | fwd+bwd s | vs one causal document | visible pairs / causal pairs |",
        "|---|---|---|---|---|", *rows, ""])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
