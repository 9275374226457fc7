"""The `hexiseq` command: plan a cluster and compare strategies from a terminal."""

import argparse
import dataclasses
import errno
import json
import os
import re
import sys
import warnings

from . import __version__, build_info, cuda_device_count
from .planner.cluster import Cluster, gpu_catalog
from .errors import HexiseqError, InvalidArgumentError, MemoryFitError
from .planner.model import MODEL_PRESETS, Model, Training
from ._validate import number, parse_tokens, read_text
from .planner.batch import batch_alternative
from .planner.plan import Plan, Strategy, compare, no_fit_error, plan_layout as plan
from .planner.text import TABLE_LEGEND

DESCRIPTION = "Plan asymmetric sequence and head parallelism for a heterogeneous GPU cluster."


def _load_model(text: str) -> Model:
    return Model.from_name_or_path(text)


def _comparison_table(results, chosen: Plan) -> str:
    plans = [p for p in results.values() if isinstance(p, Plan)]
    best = min(p.step_time_s for p in plans) if plans else None
    rows = [f"{'strategy':<10} {'groups':>7} {'step s':>10} {'tokens/s':>12} {'vs best':>8} {'bound gap':>9}  note"]
    for name, p in results.items():
        if isinstance(p, Plan):
            mark = "  <- chosen" if p is chosen else ""
            sizes = sorted(set(p.layout.group_size.tolist()))
            note = f"{p.num_groups} x {sizes[0]}" if len(sizes) == 1 else f"sizes {sizes}"
            rows.append(f"{name:<10} {p.num_groups:>7} {p.step_time_s:>10.4f} {p.tokens_per_s:>12,.0f} "
                        f"{best / p.step_time_s:>7.3f}x {p.gap_to_bound:>8.3f}x  {note}{mark}")
        else:
            rows.append(f"{name:<10} {'-':>7} {'-':>10} {'-':>12} {'-':>8} {'-':>9}  {p}")
    return "\n".join(rows)


def _documents_arg(text):
    """--documents: lengths separated by commas or whitespace, given inline or in a file (None: not given)."""
    if text is None:
        return None
    if os.path.isfile(text):
        text = read_text(text, "documents file")
    parts = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    _no_thousands_separator(parts, "--documents", "documents", "1024")
    try:
        return [int(t) for t in parts]
    except ValueError:
        bad = next(t for t in parts if not t.lstrip("-").isdigit())
        raise InvalidArgumentError(f"--documents must be document lengths (integers) separated by commas or "
                                   f"whitespace, inline or in a file; got {bad!r}") from None


def _no_thousands_separator(parts, where, what, instead):
    """InvalidArgumentError for a count with a leading zero: "1,024" would otherwise be read as two counts, 1 and 24
    (commas separate them)."""
    zero = next((t for t in parts if len(t) > 1 and t.startswith("0")), None)
    if zero is not None:
        raise InvalidArgumentError(f"{where} has {zero!r}, a count with a leading zero: commas separate {what}, so "
                                   f"write {instead}, not 1,024")


def _batch_arg(text):
    """--batch: the sequences of one step, a file with one sequence per line (a line of several lengths is one packed
    sequence's documents) or inline lengths separated by commas (one sequence each)."""
    inline = not os.path.isfile(text)
    if inline and (os.path.exists(text) or re.search(r"[/\\]|\.(txt|csv|lst)$", text)):
        raise InvalidArgumentError(f"--batch {text!r}: no such file" if not os.path.exists(text) else
                                   f"--batch {text!r} is not a file")
    lines = [t for t in text.split(",")] if inline else read_text(text, "batch file").splitlines()
    where = "sequence" if inline else "line"
    out = []
    for n, line in enumerate(lines, 1):
        parts = [t for t in re.split(r"[\s,]+", line.split("#", 1)[0].strip()) if t]
        if not parts:
            continue
        # ASCII digits only: str.isdigit() also takes superscripts and other scripts' digits, which int() refuses;
        # a k or m suffix as --seq-len takes it (1k = 1024)
        bad = next((t for t in parts if not re.fullmatch(r"[0-9]+[kKmM]?", t) or int(t.rstrip("kKmM")) == 0), None)
        if bad is not None:
            raise InvalidArgumentError(f"--batch: {where} {n} must hold token counts (positive integers), got {bad!r}")
        _no_thousands_separator(parts, f"--batch: {where} {n}", "sequences", "1024 (or 1k)")
        vals = [parse_tokens(t, "--batch") for t in parts]
        out.append(vals[0] if len(vals) == 1 else vals)
    if not out:
        raise InvalidArgumentError(f"--batch {text!r}: no sequence in it")
    return out


def cmd_plan_batch(args, cluster, model, training, causal) -> int:
    from .planner.batch import plan_batch

    if args.documents is not None or args.sequences != 1:
        raise InvalidArgumentError("--batch gives the step's sequences and their documents: leave out --documents "
                                   "and --sequences")
    given = [f for f, v in (("--seq-len", args.seq_len), ("--strategy", args.strategy), ("--plot", args.plot))
             if v is not None]
    if given:  # each would be silently ignored: the batch planner picks every group's layout for its sequences
        raise InvalidArgumentError(f"--batch plans each group's layout for the lengths it gives: leave out "
                                   f"{' and '.join(given)}")
    lengths = _batch_arg(args.batch)
    limit = None if args.time_limit is None else number(args.time_limit, "--time-limit", positive=True)
    bp = plan_batch(cluster, model=model, lengths=lengths, training=training, causal=causal, time_limit_s=limit,
                    split_documents=bool(args.split_documents), exact=not args.per_step)
    if args.json:
        print(bp.to_json(indent=2))  # the one plan format: hexiseq.Plan.from_json reads it back
        return 0
    print(bp.explain())
    docs = [L for x in lengths for L in (x if isinstance(x, list) else [x])]
    try:
        one = plan(cluster, model=model, seq_len=sum(docs), training=training, causal=causal,
                   documents=docs if len(docs) > 1 else None)
        print(f"\nthe whole batch packed as documents into one sequence over all {cluster.num_devices} devices "
              f"(one layout, cost model): {one.step_time_s:.4g} s; this plan is "
              f"{one.step_time_s / bp.step_time_s:.2f}x that speed" + (" (its step priced linearly)" if args.per_step
                                                                       else ""))
    except MemoryFitError:
        print(f"\nthe whole batch does not fit as one packed sequence over all {cluster.num_devices} devices")
    if args.per_step:
        print("(every time is a prediction; this plan's are its linear pricing (--per-step), the cost model scores\n"
              " no pass: leave out --per-step to score each; a group runs its sequences as the documents of one\n"
              " packed sequence with its own layout, states sharded inside the group; see docs/batch.md)")
    else:
        print("(every time is a prediction of the cost model, this plan's scored pass by pass; a group runs its\n"
              " sequences as the documents of one packed sequence with its own layout, states sharded inside the\n"
              " group; see docs/batch.md)")
    return 0


def _measure_line(cluster) -> str:
    """The command that times a plan on its cluster: torchrun with one process per device (one node:
    --nproc_per_node; several nodes of one size: --nnodes too, started on every node with a rendezvous)."""
    counts = {n.count for n in cluster.nodes}
    if len(cluster.nodes) == 1:
        return f"torchrun --nproc_per_node {cluster.num_devices} -m hexiseq measure plan.json"
    if len(counts) == 1:
        return (f"torchrun --nnodes {len(cluster.nodes)} --nproc_per_node {counts.pop()} --rdzv-endpoint HOST:PORT "
                "-m hexiseq measure plan.json   (on every node)")
    return (f"torchrun ... -m hexiseq measure plan.json   (one process per device: {cluster.num_devices} in all, "
            "on each node as many as it has devices)")


def cmd_plan_pipeline(args, cluster, model, training, causal) -> int:
    from .planner.batch import plan as plan_step
    from .planner.pipeline import plan_pipeline

    given = [f for f, v in (("--strategy", args.strategy), ("--documents", args.documents), ("--plot", args.plot),
                            ("--time-limit", args.time_limit)) if v is not None]
    if given:
        raise InvalidArgumentError(f"--pipeline plans each stage's layout with the scheduler: leave out "
                                   f"{' and '.join(given)}")
    seq_len = parse_tokens(args.seq_len or "128k")
    pp = plan_pipeline(cluster, model=model, seq_len=seq_len, training=training, causal=causal)
    if args.json:
        print(json.dumps(pp.to_dict(), indent=2))
        return 0
    print(pp.explain())
    try:
        today = plan_step(cluster, model=model, seq_len=seq_len, training=training, causal=causal)
    except MemoryFitError:
        print("\nno plan without pipelines fits")
        return 0
    how = (f"{len(today.groups)} groups of devices, data parallel" if len(today.groups) > 1 else
           "one layout over every device, run once per sequence")
    print(f"\nwithout pipelines (hexiseq plan, {how}): {today.step_time_s:.4g} s a step; the pipeline plan is "
          f"{today.step_time_s / pp.step_time_s:.2f}x as fast (both predicted by the cost model)")
    return 0


def cmd_plan(args) -> int:
    cluster = Cluster.from_file(args.cluster) if args.cluster else Cluster.example()
    model = _load_model(args.model)
    reserved = {} if args.reserved_gib is None else {"reserved_gib": args.reserved_gib}
    training = Training(sequences=args.sequences, checkpointing=args.checkpointing, sharding=args.sharding,
                        state_shares=args.state_shares, memory_features=args.memory_features, **reserved)
    causal = not args.no_causal
    if args.split_documents and args.batch is None:
        raise InvalidArgumentError("--split-documents lets a packed sequence of --batch go to several groups: give "
                                   "--batch too")
    if args.per_step and args.batch is None:
        raise InvalidArgumentError("--per-step plans a --batch without scoring it exactly: give --batch too")
    if args.batch is not None:
        if args.pipeline:
            raise InvalidArgumentError("--pipeline plans --sequences sequences of --seq-len tokens: leave out --batch")
        return cmd_plan_batch(args, cluster, model, dataclasses.replace(training, sequences=1), causal)
    if args.pipeline:
        return cmd_plan_pipeline(args, cluster, model, training, causal)
    if args.plot:  # before planning, which can take minutes: a missing matplotlib is said at once
        from .planner.plotting import require_pyplot

        require_pyplot()
    strategy = Strategy(args.strategy or "auto")
    seq_len = parse_tokens(args.seq_len or "128k")
    documents = _documents_arg(args.documents)
    limit = None if args.time_limit is None else number(args.time_limit, "--time-limit", positive=True)
    results = compare(cluster, model=model, seq_len=seq_len, training=training, causal=causal, documents=documents,
                      time_limit_s=limit)
    if strategy is Strategy.AUTO:
        plans = [p for p in results.values() if isinstance(p, Plan)]
        if not plans:
            raise no_fit_error(cluster, model, training, seq_len, causal, results)
        chosen = min(plans, key=lambda p: p.step_time_s)
    else:
        chosen = results[strategy.value]
        if not isinstance(chosen, Plan):
            raise no_fit_error(cluster, model, training, seq_len, causal, {strategy.value: chosen})
    if args.plot:
        from .planner.plotting import plot_plan

        others = {n: p for n, p in results.items() if isinstance(p, Plan) and p is not chosen}
        plot_plan(chosen, args.plot, baselines=others)
    if strategy is Strategy.AUTO and any(isinstance(p, Plan) and p.stopped_early for p in results.values()):
        chosen.stopped_early = True  # the comparison that chose it was cut short
    if args.json:
        if chosen.stopped_early:
            print(f"hexiseq: the search stopped early at the time limit ({args.time_limit:g} s): the best plan "
                  "found by then", file=sys.stderr)
        print(chosen.to_json(indent=2))
        return 0
    batch = batch_alternative(cluster, model, training, seq_len, causal, chosen) if (
        strategy is Strategy.AUTO and documents is None) else None
    if batch is not None:
        print(batch.explain())
        print(f"\n--sequences {training.sequences}: the batch planner's groups above are predicted "
              f"{chosen.step_time_s / batch.step_time_s:.2f}x as fast as one layout over all "
              f"{cluster.num_devices} devices run {training.sequences} times ({chosen.step_time_s:.4g} s), which "
              "follows for comparison\n(run a batch plan with hexiseq.nn.BatchContext; `--batch` plans steps of "
              "unequal lengths; see docs/batch.md)\n")
    print(chosen.explain())
    print()
    print(TABLE_LEGEND)
    print()
    print("strategies side by side (same cost model):")
    print(_comparison_table(results, chosen))
    print("(groups = head-parallel groups in the ring; vs best = tokens/s relative to the fastest; bound gap =\n"
          "step time over the lower bound, 1.000x being optimal under the cost model; note = groups x devices\n"
          "per group, or the group sizes when they differ)")
    print(f"\nfingerprint {chosen.fingerprint}")
    print("to run it: save it with --json > plan.json, then on every rank hexiseq.Plan.from_json(...) and\n"
          "hexiseq.nn.HexiSeqAttention(plan) as your attention, or hexiseq.hf.patch_model(model, plan) for a\n"
          "Hugging Face model; to time it against these predictions, one process per device:\n"
          f"  {_measure_line(chosen.cluster)}")
    if chosen.training.state_shares == "memory":
        print("its model states are shared by memory: shard them with hexiseq.shard_states(model, plan) before\n"
              "building the optimizer (FSDP and ZeRO shard evenly, which does not fit this cluster)")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _init_distributed(backend: str):
    """The process group of a collective command: torchrun's environment when present, else a world of one.
    Returns (torch.distributed, rank, created) where created says this command must destroy it."""
    import os

    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise HexiseqError("this command needs PyTorch (pip install torch)") from None
    if dist.is_initialized():
        return dist, dist.get_rank(), False
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise HexiseqError("--backend nccl needs a CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist, dist.get_rank(), True


def _int_list(text: str, name: str):
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HexiseqError(f"{name} must be comma-separated integers, got {text!r}") from None


def _calibration_summary(cluster: Cluster) -> str:
    lines = [f"calibrated {cluster.describe()}"]
    lines.append(f"{'device':>6} {'gpu':<12} {'free GiB':>8} {'matmul TFLOP/s':>15} {'attention TFLOP/s':>18} "
                 f"{'causal TFLOP/s':>15}")
    for i, d in enumerate(cluster.devices or []):
        gemm, attn, diag = d.gemm_tflops[-1], d.attn_tflops[-1], d.attn_causal_tflops[-1]
        lines.append(f"{i:>6} {cluster.device_gpus[i]:<12} {d.memory_gib:>8.2f} "
                     f"{gemm[1]:>8.4g} @{gemm[0]:<6} {attn[1]:>10.4g} @{attn[0]:<6} {diag[1]:>8.4g} @{diag[0]:<6}")
    if cluster.bandwidth_gbps is not None:
        import numpy as np

        n = cluster.num_devices
        off = ~np.eye(n, dtype=bool)
        bw = cluster.bandwidth_gbps[off]
        lat = np.asarray(cluster.latency_us, dtype=float)[off] if cluster.latency_us is not None else None
        text = f"links: {bw.min():.3g}-{bw.max():.3g} GB/s per direction (median {np.median(bw):.3g})"
        if lat is not None:
            text += f", latency {lat.min():.3g}-{lat.max():.3g} us (median {np.median(lat):.3g})"
        lines.append(text)
    cal = cluster.calibration or {}
    if cal.get("all_to_all"):
        lines.append("all-to-all: " + ", ".join(f"{a['ranks']} ranks {a['seconds'] * 1e3:.3g} ms"
                                                for a in cal["all_to_all"]) +
                     f" ({cal['all_to_all'][0]['bytes_per_peer'] / 2**20:.3g} MiB per peer)")
    lines.append("(measured on this machine; the rates are curves over size, the largest size shown)")
    return "\n".join(lines)


def cmd_calibrate(args) -> int:
    from .hardware.calibration import calibrate

    dist, rank, created = _init_distributed(args.backend)
    try:
        cluster = calibrate(_load_model(args.model), dtype=args.dtype, gemm_rows=_int_list(args.gemm_rows, "--gemm-rows"),
                            attn_blocks=_int_list(args.attn_blocks, "--attn-blocks"), attn_heads=args.attn_heads,
                            message_bytes=(int(number(args.message_mib, "--message-mib", positive=True) * 2**20)
                                           if args.message_mib is not None else None),
                            iters=args.iters, out=args.out, progress=not args.quiet)
        if rank == 0:
            print(_calibration_summary(cluster))
            print(f"wrote {args.out}: plan with `hexiseq plan {args.out} --model {args.model}`")
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def cmd_measure(args) -> int:
    from .hardware.measurement import measure

    plan = Plan.from_json(read_text(args.plan, "plan file"))
    dist, rank, created = _init_distributed(args.backend)
    try:
        result = measure(plan, iters=args.iters, warmup=args.warmup, dtype=args.dtype, layer=args.layer)
        if rank == 0:
            print(result.to_json() if args.json else result.table())
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def cmd_gpus(args) -> int:
    print(f"{'model':<10} {'also':<18} {'TFLOP/s':>8} {'GiB':>6} {'HBM GB/s':>9} {'gemm eff':>9} {'attn eff':>9} "
          f"{'host GB/s':>9}  source")
    for g in gpu_catalog():
        also = ", ".join(g["aliases"]) or "-"
        print(f"{g['name']:<10} {also:<18} {g['peak_tflops']:>8.1f} {g['memory_gib']:>6.1f} {g['hbm_gbps']:>9.0f} "
              f"{g['gemm_eff']:>9.2f} {g['attn_eff']:>9.2f} {g['host_gbps']:>9.0f}  {g['source']}")
    print("\nThe attention kernel each attn eff stands for:")
    for g in gpu_catalog():
        print(f"  {g['name']:<12} {g['attn_kernel']}")
    print("\nhost GB/s: the host link per direction (PCIe generation x16, datasheet; GB200: its share of the "
          "superchip's NVLink-C2C to Grace, an estimate); offloaded checkpoints are priced at 0.8 of it unless "
          "calibrate measured the link.")
    print("\nNames are case-insensitive; 'also' lists the short names read as the model on their line (a Cluster "
          "stores the catalog name). A model not listed is accepted when described: memory_gib with peak_tflops, "
          "gemm_eff and attn_eff, or measured rates (hexiseq calibrate).")
    return 0


def cmd_info(args) -> int:
    info = build_info()
    # build_info()'s "cuda" means the CUDA kernels were compiled in, not that a GPU is here: say both plainly
    out = {k: v for k, v in info.items() if k not in ("cuda", "cuda_skipped")}
    out["cuda_kernels_built"] = info["cuda"]
    out["cuda_devices"] = cuda_device_count() if info["cuda"] else 0
    if not info["cuda"]:
        out["cuda_kernels"] = (f"not built ({info.get('cuda_skipped') or 'unknown reason'}); to build them, reinstall "
                               "from the source tree on a machine with nvcc: HEXISEQ_CUDA=1 pip install . "
                               "(HEXISEQ_CUDA_ARCHS=90 for Hopper only)")
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hexiseq", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"hexiseq {__version__}")
    sub = p.add_subparsers(dest="command")
    pl = sub.add_parser("plan", help="plan a cluster (the built-in example when no file is given)")
    pl.add_argument("cluster", nargs="?", help="cluster description, YAML or JSON (default: built-in example)")
    pl.add_argument("--model", default="7b",
                    help=f"preset ({', '.join(sorted(MODEL_PRESETS))}; short 3b/7b/13b/30b/8b/70b) "
                         "or a Hugging Face config.json (default: 7b)")
    pl.add_argument("--seq-len", default=None, help="tokens per sequence, e.g. 131072, 128k, 1m (default 128k)")
    pl.add_argument("--strategy", default=None, choices=[s.value for s in Strategy], help="(default auto)")
    pl.add_argument("--sequences", type=int, default=1, help="sequences per step (default 1)")
    pl.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    pl.add_argument("--sharding", default="full", choices=["full", "grad_opt", "opt", "none"],
                    help="model-state sharding (default full, ZeRO-3 style)")
    pl.add_argument("--state-shares", default="auto", choices=["auto", "even", "memory"],
                    help="how the sharded states are divided: even (FSDP, ZeRO), by each device's memory "
                         "(run with hexiseq.shard_states), or auto (default: even when it fits, else by memory)")
    pl.add_argument("--memory-features", default="auto", metavar="auto|none|NAMES",
                    help="what a device short of memory may use, chosen per device: offload (checkpoints to host "
                         "memory; needs --checkpointing), tile_mlp, tile_loss, joined by ','; auto (default) allows "
                         "all three, none none")
    pl.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    pl.add_argument("--reserved-gib", type=float, metavar="GIB",
                    help="memory kept back on every device for the CUDA context, the framework and fragmentation "
                         "(default 2)")
    pl.add_argument("--documents", metavar="LENGTHS|FILE",
                    help="packed documents: their lengths in sequence order (adding up to --seq-len), e.g. "
                         "4096,2048,2048, or a file of lengths; plans under the document mask")
    pl.add_argument("--batch", metavar="FILE|LENGTHS",
                    help="plan a step of several sequences of unequal lengths on groups of devices: a file with one "
                         "sequence per line (several numbers on a line: one packed sequence's documents) or lengths "
                         "separated by commas (4096 or 4k; no thousands separators)")
    pl.add_argument("--split-documents", action="store_true",
                    help="with --batch: a packed sequence's documents may go to different groups, cut at their "
                         "boundaries (default: each packed sequence stays whole, in one group)")
    pl.add_argument("--per-step", action="store_true",
                    help="with --batch: the per-step mode, groups and passes priced linearly in milliseconds, not "
                         "scored exactly (an exact plan takes seconds to minutes for thousands of sequences)")
    pl.add_argument("--pipeline", action="store_true",
                    help="plan the model in pipeline stages over runs of nodes (data parallel pipelines, micro-batches "
                         "of packed sequences), against the plan without pipelines (predicted; not yet runnable)")
    pl.add_argument("--json", action="store_true", help="print the chosen plan as JSON")
    pl.add_argument("--time-limit", type=float, metavar="SECONDS",
                    help="stop the search after about this long with the best plan found so far (marked stopped early)")
    pl.add_argument("--plot", metavar="FILE.png",
                    help='draw per-device shares and time breakdown (needs matplotlib: pip install "hexiseq[plot]")')
    pl.set_defaults(func=cmd_plan)
    ca = sub.add_parser("calibrate", help="measure this cluster's devices and links (a collective: run under "
                                          "torchrun, one process per device) and write a cluster YAML")
    ca.add_argument("--model", default="llama3-8b", help="model whose shapes are measured (preset or config.json)")
    ca.add_argument("--out", default="cluster.yaml", help="cluster YAML to write (default cluster.yaml)")
    ca.add_argument("--dtype", default=None, help="training dtype: bf16, fp16, fp32 (default: the model's, "
                                                    "bf16 for a preset)")
    ca.add_argument("--gemm-rows", help="row counts of the matmul rate curve, e.g. 512,2048,8192")
    ca.add_argument("--attn-blocks", help="block lengths of the attention rate curves, e.g. 256,1024,4096")
    ca.add_argument("--attn-heads", type=int, help="query heads to time attention with (default: the model's; "
                                                   "fewer is quicker, less exact)")
    ca.add_argument("--message-mib", type=float, help="MiB per link measurement (default 64 on CUDA, 4 on CPU)")
    ca.add_argument("--iters", type=int, help="timed repetitions per point (default 5 on CUDA, 3 on CPU)")
    ca.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    ca.add_argument("--quiet", action="store_true", help="no progress lines")
    ca.set_defaults(func=cmd_calibrate)
    me = sub.add_parser("measure", help="run a plan's layer on this cluster (a collective: under torchrun) and "
                                        "compare each phase with the cost model")
    me.add_argument("plan", help="a plan as JSON (hexiseq plan ... --json > plan.json)")
    me.add_argument("--iters", type=int, default=5, help="timed runs (default 5)")
    me.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    me.add_argument("--layer", default="attention", choices=["attention", "llama"],
                    help="the attention layer alone, or a whole Llama-style layer around it")
    me.add_argument("--dtype", default=None, help="input dtype (default: the one the plan's cluster was "
                    "calibrated in, else the one of the plan's model dtype_bytes, as calibrate)")
    me.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    me.add_argument("--json", action="store_true", help="print the measurement as JSON")
    me.set_defaults(func=cmd_measure)
    g = sub.add_parser("gpus", help="list the built-in GPU catalog")
    g.set_defaults(func=cmd_gpus)
    i = sub.add_parser("info", help="what this installation was built with")
    i.set_defaults(func=cmd_info)
    return p


class _OutputError(OSError):
    """A write to standard output failed (a closed pipe, a full disk): raised by _Stdout in place of the OSError."""


class _Stdout:
    """Standard output as the commands see it: a failed write or flush raises _OutputError, so that main() can tell
    it from every other OSError. Without a standard output at all (started with it closed, `hexiseq plan >&-`, where
    Python's sys.stdout is None) a write raises _OutputError too."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if self._stream is None:
            raise _OutputError(errno.EBADF, "standard output is closed")
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _OutputError(e.errno, e.strerror) from None

    def flush(self):
        if self._stream is None:  # nothing was written
            return
        try:
            self._stream.flush()
        except OSError as e:
            raise _OutputError(e.errno, e.strerror) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _detach_stdout():
    """Point standard output at /dev/null so that the interpreter's flush at exit, which would fail the same way
    and print a traceback, has nothing left to write."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (a test's capture)
        pass


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)
    # hexiseq's own warnings (a figure that looks like a unit slip, ...) as one line each on stderr, as the errors are
    show = warnings.showwarning
    warnings.showwarning = lambda message, category, *rest, **kw: (
        print(f"{message}", file=sys.stderr) if str(message).startswith("hexiseq: ")
        else show(message, category, *rest, **kw))
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit where it would be a traceback
        return rc
    except HexiseqError as e:
        print(f"hexiseq: error: {e}", file=sys.stderr)
        return 1
    except _OutputError as e:
        sys.stdout = stdout
        _detach_stdout()
        # The reader went away (hexiseq plan | head): it has all it asked for, so this is no error of ours. Exit 0,
        # not 141 (killed by SIGPIPE, as C tools are): Python ignores SIGPIPE, and a 141 would fail a pipeline run
        # under `set -o pipefail` that did what it meant to.
        if e.errno == errno.EPIPE:
            return 0
        print(f"hexiseq: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hexiseq: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout
        warnings.showwarning = show


if __name__ == "__main__":
    sys.exit(main())
