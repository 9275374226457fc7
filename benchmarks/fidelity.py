"""How far the cost model, with the catalog's defaults and no calibration, is from published measured training
runs of other systems (benchmarks/data/published_runs.yaml: source, table and the cells read, for every row).

Each row that hexiseq's layouts can express is rebuilt as a cluster (the catalog GPU, 8 per node, NVLink inside a
node, 25 GB/s per GPU between nodes), a model (the published architecture) and the published parallel layout, and
its step time is predicted and set against the measured one:

  USP (A800, Megatron-LM; Ulysses x ring x TP, ZeRO-1)  evaluate(): ring degree r groups of u x t devices (TP and
      Ulysses both split the heads, and each device runs its own tokens' matmuls in both; their communication
      differs: TP's all-reduces are priced as Ulysses' all-to-alls); the measured step from the published TFLOP/s
      per GPU through Megatron-LM's FLOP formula with the attention term halved for the causal mask (the paper
      says it counts only causal-effective FLOPs; the formula is our reading of that sentence);
  ALST (H100, DeepSpeed ZeRO-3 + Ulysses 8)  evaluate(): one group of the 8 devices; measured iteration time
      (their runs offload optimizer states and checkpoints to the CPU, which the model does not price);
  MosaicML (H100, A100, plain FSDP)  plan_batch() with one group per device (each runs its own sequences, the
      states sharded over all); measured tokens per step over tokens per second.

Rows it cannot express are listed with the reason (pipeline parallelism, FP8, a GPU outside the catalog, a step
time the source does not give). Every third expressible row (by id) is held aside: it was not looked at while
choosing any default, and is reported apart. Errors are predicted / measured - 1 (negative: the model is
optimistic, too fast). A second table predicts the rows again after two numbers per stack and GPU model, the
matmul and attention efficiencies a user would time on their own stack, here fitted to two of the stack's rows
that are not held aside (calibrated()). --tp-traffic adds what TP's own collectives move on the rows with TP
(tp_traffic_s; an experiment, see the notes of the results: it does not become the default).

    python benchmarks/fidelity.py [--tp-traffic] [--out benchmarks/results/fidelity.md]
"""

import argparse
import math
import os
import statistics
import sys

import numpy as np
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hexiseq  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "published_runs.yaml")
CATALOG = (("H100", "H100-SXM"), ("A800", "A800"), ("A100", "A100-80G"))  # published name prefix -> catalog
INTRA_GBPS = {"H100-SXM": 450.0, "A800": 200.0, "A100-80G": 300.0}       # NVLink, GB/s per direction
INTER_GBPS = 25.0  # per GPU between nodes: 8 x 200 Gb/s (USP: 1.6 Tb/s per node)


def catalog_gpu(name):
    for prefix, gpu in CATALOG:
        if str(name).upper().startswith(prefix):
            return gpu
    return None


def model_of(r):
    a = r["arch"]
    gated = not r["id"].startswith("mosaic")  # Llama models: SwiGLU; MPT: GELU
    return hexiseq.Model(layers=a["layers"], hidden=a["hidden"], heads=a["heads"], kv_heads=a["kv_heads"],
                         head_dim=a["hidden"] // a["heads"], ffn=a["ffn"], vocab=a["vocab"], gated_mlp=gated,
                         name=r["id"])


def cluster_of(gpu, gpus, rates=None):
    """8 per node; rates: {"gemm_eff": ..., "attn_eff": ...} in place of the catalog's (None: the catalog's)."""
    nodes = max(1, gpus // 8)
    per = gpus // nodes
    node = {"gpu": gpu, "count": per, "intra_gbps": INTRA_GBPS[gpu], **(rates or {})}
    return hexiseq.Cluster.from_dict({"nodes": [node] * nodes, "inter_node_gbps": INTER_GBPS})


def megatron_causal_flops(m, seq_len, batch):
    """Megatron-LM's model FLOPs of a step (forward and backward, no recompute), the attention term halved for the
    causal mask: 12 B S L H^2 ((1 + kv/heads + S / (2H)) q/H + F/H g + V / (2 L H)), g = 3/2 for SwiGLU."""
    H, q = m.hidden, m.heads * m.head_dim
    gated = 1.5 if m.gated_mlp else 1.0
    return 12.0 * batch * seq_len * m.layers * H * H * (
        (1.0 + m.kv_heads / m.heads + seq_len / (2.0 * H)) * (q / H) + m.ffn / H * gated + m.vocab / (2.0 * m.layers * H))


def uniform_layout(devices, ring, group, seq_len, heads):
    """ring groups of `group` consecutive devices each, the sequence and the heads split as evenly as they go."""
    groups, d = [], 0
    for g in range(ring):
        seq = seq_len // ring + (g < seq_len % ring)
        tokens = [seq // group + (i < seq % group) for i in range(group)]
        groups.append({"devices": devices[d:d + group], "seq": seq, "tokens": tokens, "heads": [heads // group] * group})
        d += group
    return {"groups": groups}


TP_TRAFFIC = False  # --tp-traffic: add tp_traffic_s() to the rows with tensor parallelism (an experiment, off)


def tp_traffic_s(r):
    """What Megatron's tensor parallelism with sequence parallelism moves that the mapping to Ulysses heads does
    not price, at the node's NVLink bandwidth, not overlapped: per layer and sample, two all-gathers and two
    reduce-scatters forward (before and after attention and the MLP) and as many backward, each of which sends a
    device (t - 1) / t of the TP group's tokens x hidden x 2 bytes; the group holds S / (ring x ulysses) tokens.
    Llama-3-8B at 64K, TP 8 x ring 2: 32 x 8 x 7/8 x 32,768 x 4,096 x 2 B = 60 GB, 0.30 s at 200 GB/s."""
    p = r.get("parallel") or {}
    t = p.get("tp") or 1
    if t == 1:
        return 0.0
    tokens = int(r["seq_len"]) / ((p.get("ring") or 1) * (p.get("ulysses") or 1))
    sent = r["arch"]["layers"] * 8 * (t - 1) / t * tokens * r["arch"]["hidden"] * 2
    return sent / (INTRA_GBPS[catalog_gpu(r["gpu"])] * 1e9)


def why_not(r):
    """Why a row cannot be predicted here, or None."""
    p = r.get("parallel") or {}
    if "fp8" in str(r.get("dtype")).lower() or "float8" in str(r.get("dtype")).lower():
        return "FP8 (the catalog prices bf16 matmuls)"
    if catalog_gpu(r["gpu"]) is None:
        return f"{r['gpu']} is not in the catalog"
    if (p.get("pp") or 1) > 1:
        return "pipeline parallelism (not a hexiseq layout)"
    if r["id"].startswith("usp"):
        return None
    if r["id"].startswith("alst"):
        if not p.get("ulysses") or p.get("ulysses") == 1 or not r.get("step_time_s"):
            return "Ulysses degree or batch not published"
        return None
    if r["id"].startswith("mosaic"):
        return None if r.get("step_time_s") else "no step time"
    return "no mapping written for this source"


def predict(r, rates=None):
    """(predicted step s, measured step s, what was set up); rates: the GPU's two efficiencies (see cluster_of)."""
    p = r["parallel"]
    m = model_of(r)
    gpu = catalog_gpu(r["gpu"])
    S = int(r["seq_len"])
    if r["id"].startswith("usp"):
        tp, u, ring, dp = p.get("tp") or 1, p.get("ulysses") or 1, p.get("ring") or 1, p.get("dp") or 1
        n = r["gpus"] // dp  # one replica; the others run beside it (their gradient all-reduce is not priced)
        c = cluster_of(gpu, n, rates)
        layout = uniform_layout(list(range(n)), ring, u * tp, S, m.heads)
        # as published: none of the memory features (USP's runs fit without them; its TP splits the logits over
        # the vocabulary, which this mapping to Ulysses does not, so "auto" would tile a loss USP did not)
        plan = hexiseq.evaluate(c, model=m, seq_len=S, layout=layout, causal=True,
                                training=hexiseq.Training(checkpointing=False, sharding="opt",
                                                          memory_features="none"))
        measured = megatron_causal_flops(m, S, r["global_batch"]) / (float(r["value"]) * 1e12 * r["gpus"])
        pred = (plan.step_time_s + (tp_traffic_s(r) if TP_TRAFFIC else 0.0)) * r["global_batch"] / dp
        return pred, measured, f"{ring} x {u * tp} on {n} {gpu}" + (f", x{dp} replicas" if dp > 1 else "")
    if r["id"].startswith("alst"):
        n = r["gpus"]
        c = cluster_of(gpu, n, rates)
        layout = uniform_layout(list(range(n)), 1, n, S, m.heads)
        # ALST offloads checkpoints and tiles the MLP and the loss: the features where a device needs them
        plan = hexiseq.evaluate(c, model=m, seq_len=S, layout=layout, causal=True,
                                training=hexiseq.Training(checkpointing=True, sharding="full", memory_features="auto"))
        return plan.step_time_s, float(r["step_time_s"]), f"1 x {n} on {n} {gpu}, ZeRO-3"
    # MosaicML: plain FSDP, each device its own sequences
    n = r["gpus"]
    c = cluster_of(gpu, n, rates)
    groups = [tuple(range(n))] + [(i,) for i in range(n)]
    bp = hexiseq.planner.plan_batch(c, model=m, lengths=[S] * int(r["global_batch"]), groups=groups,
                            training=hexiseq.Training(checkpointing=True, sharding="full", memory_features="none"))
    return bp.step_time_s, float(r["step_time_s"]), f"{n} x 1 (FSDP) on {n} {gpu}"


COND_LIMIT = 100.0  # past this condition number of the fit's Jacobian, two rows fit one factor, not two
STACK_OF = {"usp": "USP (Megatron-LM)", "alst": "ALST (DeepSpeed)", "mosaic": "MosaicML (llm-foundry)"}


def without_tp(r):
    """Whether a row's layout has no tensor parallelism (hexiseq prices TP as Ulysses heads)."""
    return (r.get("parallel") or {}).get("tp") in (None, 1)


def stack(r):
    """The software stack and GPU model of a row: what two measured numbers would be taken on."""
    return r["id"].split("_")[0], catalog_gpu(r["gpu"])


def fit_rates(rows, factors=2):
    """The GPU's matmul and attention efficiencies (gemm_eff, attn_eff) that make the model's steps of `rows` (rows
    of one stack on one GPU model) equal their measured steps: with two rows and two factors, Newton's method on the
    logarithms (the Jacobian by finite differences); with one row, or two that cannot tell the matmuls from
    attention apart, one factor on both efficiencies, zeroing the mean log error. Returns (rates, factors fitted,
    each row's error after the fit)."""
    entry = next(e for e in hexiseq.gpu_catalog() if e["name"] == catalog_gpu(rows[0]["gpu"]))
    one = factors == 1 or len(rows) == 1

    def rates(v):
        return {"gemm_eff": min(1.0, entry["gemm_eff"] * math.exp(v[0])),
                "attn_eff": min(1.0, entry["attn_eff"] * math.exp(v[0] if one else v[1]))}

    def residual(v):
        out = []
        for r in rows:
            pred, meas, _ = predict(r, rates(v))
            out.append(math.log(pred / meas))
        return out

    x, h = [0.0, 0.0], 1e-3
    for _ in range(16):
        f = residual(x)
        if one:
            m = sum(f) / len(f)
            if abs(m) < 1e-7:
                break
            d = (sum(residual([x[0] + h, 0.0])) / len(f) - m) / h
            x = [x[0] - m / d, 0.0]
            continue
        if max(abs(e) for e in f) < 1e-7:
            break
        j = (np.array([residual([x[0] + h, x[1]]), residual([x[0], x[1] + h])]).T - np.array(f)[:, None]) / h
        if not np.linalg.cond(j) <= COND_LIMIT:  # the rows cannot tell the matmuls from attention apart
            return fit_rates(rows, factors=1)
        x = list(np.array(x) - np.linalg.solve(j, f))
    return rates(x), 1 if one else 2, [math.expm1(e) for e in residual(x)]


def calibrated(usable, held):
    """Every row predicted after two measured numbers per stack and GPU model: gemm_eff and attn_eff fitted to two
    of the stack's rows that are not held aside (its shortest and its longest sequence, where matmuls and
    attention weigh most differently; rows without tensor parallelism where there are two), standing in for the
    minute a user spends timing their own stack's matmuls and attention on that GPU. Returns ({stack: (rates,
    factors fitted, calibration row ids)}, {row id: error}) for the rows that were not fitted."""
    by = {}
    for r in usable:
        by.setdefault(stack(r), []).append(r)
    fits, errors = {}, {}
    for key, rows in sorted(by.items()):
        free = sorted((r for r in rows if r["id"] not in held), key=lambda r: (r["seq_len"], r["id"]))
        # rows with tensor parallelism are priced as Ulysses (see the module's docstring): a user times their
        # own stack's matmuls and attention, not TP's collectives, so those rows stand in for them badly
        own = [r for r in free if without_tp(r)]
        free = own if len(own) >= 2 else free
        chosen = [free[0], free[-1]] if len(free) >= 2 and free[0]["seq_len"] != free[-1]["seq_len"] else free[:1]
        rates, factors, _ = fit_rates(chosen)
        fits[key] = (rates, factors, [r["id"] for r in chosen])
        for r in rows:
            if r not in chosen:
                pred, meas, _ = predict(r, rates)
                errors[r["id"]] = pred / meas - 1.0
    return fits, errors


def stats(errors):
    a = [abs(e) for e in errors]
    return (statistics.median(a), max(a), statistics.median(errors)) if errors else (float("nan"),) * 3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tp-traffic", action="store_true",
                    help="price Megatron's TP collectives on the rows with TP (tp_traffic_s; not the default)")
    args = ap.parse_args()
    global TP_TRAFFIC
    TP_TRAFFIC = args.tp_traffic
    rows = yaml.safe_load(open(DATA))
    usable = sorted((r for r in rows if why_not(r) is None), key=lambda r: r["id"])
    held = {r["id"] for i, r in enumerate(usable) if i % 3 == 2}
    lines = ["| row | source, where | setup | S | measured s | predicted s | error | set |", "|---|---|---|---|---|---|---|---|"]
    errs = {"used": [], "held aside": []}
    by_source = {}
    preds = []
    for r in usable:
        pred, meas, how = predict(r)
        preds.append((pred, meas))
        e = pred / meas - 1.0
        which = "held aside" if r["id"] in held else "used"
        errs[which].append(e)
        src = r["id"].split("_")[0]
        by_source.setdefault(src, []).append(e)
        lines.append(f"| {r['id']} | {r['source'][:40]}, {r['where'][:30]} | {how} | {r['seq_len']:,} | {meas:.3f} | "
                     f"{pred:.3f} | {e:+.1%} | {which} |")
        print(lines[-1], flush=True)
    lines += ["", "| rows | n | median abs error | worst abs error | median signed error |", "|---|---|---|---|---|"]
    for name, es in list(errs.items()) + [("all", errs["used"] + errs["held aside"])] + sorted(by_source.items()):
        med, worst, signed = stats(es)
        lines.append(f"| {name} | {len(es)} | {med:.1%} | {worst:.1%} | {signed:+.1%} |")
    # the ranking of the layouts of one published table (same source table, GPUs, model and length): kept for every
    # pair whose measured steps differ by more than 5%?
    results = {r["id"]: (r, p_m) for r, p_m in zip(usable, preds)}
    pairs = kept = 0
    own_pairs = own_kept = 0  # pairs of layouts hexiseq runs itself (no tensor parallelism, which it prices as Ulysses)
    flips = []
    ids = sorted(results)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            ra, (pa, ma) = results[a]
            rb, (pb, mb) = results[b]
            if (ra["where"], ra["gpus"], ra["model"], ra["seq_len"]) != (rb["where"], rb["gpus"], rb["model"], rb["seq_len"]):
                continue
            if abs(ma / mb - 1.0) <= 0.05:
                continue
            pairs += 1
            own = without_tp(ra) and without_tp(rb)
            own_pairs += own
            if (pa < pb) == (ma < mb) and pa != pb:
                kept += 1
                own_kept += own
            else:
                flips.append(f"{a} vs {b}: measured {ma:.3f} / {mb:.3f} s, predicted {pa:.3f} / {pb:.3f} s")
    lines += ["", f"Ranking of the layouts of one table (pairs measured more than 5% apart): {kept} of {pairs} kept; "
              f"of the pairs of layouts hexiseq runs itself (no tensor parallelism): {own_kept} of {own_pairs}."]
    lines += [f"- not kept: {f}" for f in flips]
    fits, after = calibrated(usable, held)
    lines += ["", "After two numbers per stack and GPU model (gemm_eff, attn_eff fitted to two of its rows that are "
              "not held aside; see calibrated()):", "",
              "| stack, GPU | gemm_eff | attn_eff | factors | fitted to |", "|---|---|---|---|---|"]
    for (src, gpu), (rates, factors, ids) in fits.items():
        lines.append(f"| {STACK_OF.get(src, src)}, {gpu} | {rates['gemm_eff']:.3f} | {rates['attn_eff']:.3f} | "
                     f"{factors} | {', '.join(ids)} |")
    lines += ["", "| rows predicted after the fit | n | median abs error | worst abs error | median signed error |",
              "|---|---|---|---|---|"]
    for name, es in (("used", [e for k, e in after.items() if k not in held]),
                     ("held aside", [e for k, e in after.items() if k in held]), ("all", list(after.values()))):
        med, worst, signed = stats(es)
        lines.append(f"| {name} | {len(es)} | {med:.1%} | {worst:.1%} | {signed:+.1%} |")
    lines += ["", "Rows not predicted:", ""]
    for r in rows:
        why = why_not(r)
        if why:
            lines.append(f"- {r['id']}: {why}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        notes = ""  # a "## Notes" section written by hand under the generated tables is kept
        if os.path.exists(args.out):
            old = open(args.out).read()
            notes = old[old.index("\n## Notes"):] if "\n## Notes" in old else ""
        with open(args.out, "w") as f:
            f.write("# The cost model against published measured runs (catalog defaults, no calibration)\n\n"
                    + ("With --tp-traffic (TP's collectives priced on the rows with TP).\n\n" if TP_TRAFFIC else "")
                    + "Predicted by `python benchmarks/fidelity.py` from `benchmarks/data/published_runs.yaml`; "
                    "measured figures as published (see the data file for each row's source and cells).\n\n"
                    + table + "\n" + notes)


if __name__ == "__main__":
    main()
