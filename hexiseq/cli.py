"""The `hexiseq` command: plan a cluster and compare strategies from a terminal."""

import argparse
import json
import sys

from . import __version__, build_info
from .cluster import Cluster, gpu_catalog
from .errors import HexiseqError
from .model import MODEL_PRESETS, Model, Training
from .plan import Plan, Strategy, compare

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


def cmd_plan(args) -> int:
    cluster = Cluster.from_file(args.cluster) if args.cluster else Cluster.example()
    model = _load_model(args.model)
    training = Training(sequences=args.sequences, checkpointing=args.checkpointing, sharding=args.sharding)
    causal = not args.no_causal
    strategy = Strategy(args.strategy)
    results = compare(cluster, model=model, seq_len=args.seq_len, training=training, causal=causal)
    if strategy is Strategy.AUTO:
        plans = [p for p in results.values() if isinstance(p, Plan)]
        if not plans:
            errs = [str(e) for e in results.values()]
            raise HexiseqError("no strategy has a plan that fits: " + "; ".join(errs))
        chosen = min(plans, key=lambda p: p.step_time_s)
    else:
        chosen = results[strategy.value]
        if not isinstance(chosen, Plan):
            raise chosen
    if args.plot:
        from .plotting import plot_plan

        others = {n: p for n, p in results.items() if isinstance(p, Plan) and p is not chosen}
        plot_plan(chosen, args.plot, baselines=others)
    if args.json:
        print(chosen.to_json(indent=2))
        return 0
    print(chosen.explain())
    print()
    print("strategies side by side (same cost model):")
    print(_comparison_table(results, chosen))
    print(f"\nfingerprint {chosen.fingerprint}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def cmd_gpus(args) -> int:
    print(f"{'model':<10} {'TFLOP/s':>8} {'GiB':>6} {'HBM GB/s':>9} {'gemm eff':>9} {'attn eff':>9}  source")
    for g in gpu_catalog():
        print(f"{g['name']:<10} {g['peak_tflops']:>8.1f} {g['memory_gib']:>6.1f} {g['hbm_gbps']:>9.0f} "
              f"{g['gemm_eff']:>9.2f} {g['attn_eff']:>9.2f}  {g['source']}")
    return 0


def cmd_info(args) -> int:
    print(json.dumps(build_info(), indent=2))
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
    pl.add_argument("--seq-len", default="128k", help="tokens per sequence, e.g. 131072, 128k, 1m (default 128k)")
    pl.add_argument("--strategy", default="auto", choices=[s.value for s in Strategy])
    pl.add_argument("--sequences", type=int, default=1, help="sequences per step (default 1)")
    pl.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    pl.add_argument("--sharding", default="full", choices=["full", "grad_opt", "opt", "none"],
                    help="model-state sharding (default full, ZeRO-3 style)")
    pl.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    pl.add_argument("--json", action="store_true", help="print the chosen plan as JSON")
    pl.add_argument("--plot", metavar="FILE.png", help="draw per-device shares and time breakdown (needs matplotlib)")
    pl.set_defaults(func=cmd_plan)
    g = sub.add_parser("gpus", help="list the built-in GPU catalog")
    g.set_defaults(func=cmd_gpus)
    i = sub.add_parser("info", help="what this installation was built with")
    i.set_defaults(func=cmd_info)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except HexiseqError as e:
        print(f"hexiseq: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
