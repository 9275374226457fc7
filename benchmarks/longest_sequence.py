"""The longest sequence that fits, per model and cluster, with and without each memory feature (offloaded
checkpoints, tiled MLP, tiled loss), predicted by the planner.

Usage: python benchmarks/longest_sequence.py [--out benchmarks/results/longest_sequence.md]

For every model, cluster and setting, hexiseq.plan is asked for a sequence longer than anything fits (32M tokens)
and the MemoryFitError it raises gives the longest length that fits, searched by planning (a multiple of 1024
tokens; every strategy tried). Full activation checkpointing and full sharding throughout (offloading needs the
checkpoints), the states shared by memory where even shares do not fit, 2 GiB reserved per device, default host
memory (twice each node's device memory). The step time at that length (the chosen plan, planned again) and what
the features add to its slowest device are predictions of the cost model; the wall time of each search is measured
on this machine."""

import argparse
import sys
import time

import hexiseq

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402

CLUSTERS = {
    "8x H100 (one node)": {"nodes": [{"gpu": "H100-SXM", "count": 8, "intra_gbps": 450}], "inter_node_gbps": 25},
    "README's mixed: 8 H100, 8 A100-80G, 4 L40S": {
        "nodes": [{"gpu": "H100-SXM", "count": 8, "intra_gbps": 450}, {"gpu": "A100-80G", "count": 8, "intra_gbps": 300},
                  {"gpu": "L40S", "count": 4, "intra_gbps": 32, "attn_eff": 0.45}], "inter_node_gbps": 25},
    "16 small: 8 A100-40G, 8 L40S": {
        "nodes": [{"gpu": "A100-40G", "count": 8, "intra_gbps": 300}, {"gpu": "L40S", "count": 8, "intra_gbps": 32}],
        "inter_node_gbps": 25},
}
MODELS = ("llama3-8b", "llama3-70b")
SETTINGS = ("none", "offload", "tile_mlp", "tile_loss", "auto")
TOO_LONG = 32 * 1048576


def longest(cluster, model, features):
    training = hexiseq.Training(checkpointing=True, memory_features=features)
    t0 = time.perf_counter()
    try:
        hexiseq.plan(cluster, model=model, seq_len=TOO_LONG, training=training)
        raise SystemExit(f"{model} fits {TOO_LONG} tokens with {features}: raise TOO_LONG")
    except hexiseq.MemoryFitError as e:
        n = e.longest_seq_len
    searched = time.perf_counter() - t0
    step = added = None
    if n:
        p = hexiseq.plan(cluster, model=model, seq_len=n, training=training)
        step = p.step_time_s
        added = float((p.devices.offload_s + p.devices.tiling_s).max())
    return n, step, added, searched


def tokens(n):
    return f"{n / 1048576:.2f}M" if n >= 1048576 else f"{n // 1024}K"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = ["# Longest sequence that fits, with and without the memory features (predicted)", "",
             f"`python benchmarks/longest_sequence.py`, {machine()}.", "", __doc__.split("\n\n", 2)[2], "",
             "| cluster | model | features | longest | vs none | step at that length, s | of which the features "
             "add (slowest device), s | search, s |", "|---|---|---|---|---|---|---|---|"]
    found = {}
    for cname, spec in CLUSTERS.items():
        cluster = hexiseq.Cluster.from_dict(spec)
        for model in MODELS:
            base = None
            for features in SETTINGS:
                n, step, added, searched = longest(cluster, model, features)
                found[cname, model, features] = n
                base = n if features == "none" else base
                ratio = f"{n / base:.1f}x" if base else "-"
                row = (f"| {cname} | {model} | {features} | {tokens(n) if n else 'none'} | {ratio} | "
                       f"{step:.1f} | {added:.2f} | {searched:.1f} |" if n else
                       f"| {cname} | {model} | {features} | none | - | - | - | {searched:.1f} |")
                print(row, flush=True)
                lines.append(row)
    lines += ["", "## Where a plan fits without them but memory binds", "",
              "The README's mixed cluster, checkpointing: the step with the features allowed against none, both "
              "predicted; the planning time measured.", "",
              "| model | tokens | step, none, s | step, auto, s | speedup | devices using them | plan, none / auto, s |",
              "|---|---|---|---|---|---|---|"]
    cluster = hexiseq.Cluster.from_dict(CLUSTERS["README's mixed: 8 H100, 8 A100-80G, 4 L40S"])
    # half the longest length that fits without the features, and that length rounded down to 32K
    mixed = "README's mixed: 8 H100, 8 A100-80G, 4 L40S"
    cases = [(m, n) for m in MODELS for cap in [found[mixed, m, "none"]]
             for n in (cap // 2 // 1024 * 1024, cap // 32768 * 32768) if n]
    for model, n in cases:
        got = {}
        for features in ("none", "auto"):
            t0 = time.perf_counter()
            p = hexiseq.plan(cluster, model=model, seq_len=n, training=hexiseq.Training(checkpointing=True,
                                                                                         memory_features=features))
            got[features] = (p.step_time_s, time.perf_counter() - t0, p)
        using = got["auto"][2].devices
        which = sorted({f for f in using.features.tolist() if f})
        row = (f"| {model} | {tokens(n)} | {got['none'][0]:.2f} | {got['auto'][0]:.2f} | "
               f"{got['none'][0] / got['auto'][0]:.2f}x | {sum(1 for f in using.features if f)} "
               f"({', '.join(which) or 'none'}) | {got['none'][1]:.3f} / {got['auto'][1]:.3f} |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", "Reading: the features remove different per-token terms (the layers' checkpoints, the MLP's "
              "intermediates, the logits), so together they reach far more than any one; what is left per token is "
              "two layers' checkpoints, one layer's other activations and the attention working set. For comparison "
              "only (a published figure, not run here): Arctic Long Sequence Training reports Llama-3.1-8B trained "
              "at 3.7M tokens on one node of 8 H100 with offloaded checkpoints and tiled MLP and loss; this model "
              f"predicts {tokens(found['8x H100 (one node)', 'llama3-8b', 'auto'])} fits there, counting no "
              "fragmentation beyond the 2 GiB reserved. 70B does not fit 8 "
              "H100 or the small cluster at any length: its model states alone take more than the devices hold "
              "(offloading optimizer states is not modelled)."]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
