"""A plan as text: the term-by-term breakdown of its predicted step time (`Plan.explain`) and the per-device table
(`Plan.table`), with the legend the CLI prints under it. Reads a plan; knows nothing of how it was made."""

from typing import List

import numpy as np

from .model import Sharding

# How far the catalog's defaults have been found off on published measured runs (benchmarks/fidelity.py against
# benchmarks/data/published_runs.yaml, results in benchmarks/results/fidelity.md): printed beside a plan that
# rests on them, so the figures are read as the estimates they are. Rerun the benchmark when a default changes.
CATALOG_FIDELITY = ("on 26 published measured runs (A800, A100, H100; 8K-3.7M tokens) they predicted",
                    "the step within a median 6%, the worst 40% too fast (benchmarks/results/fidelity.md)")


def explain(plan, one_document=None) -> str:
    """A readable breakdown of the predicted step time, term by term. one_document: with packed documents, the
    same layout priced as one causal document (a Plan), shown beside it."""
    t = plan.devices
    c = plan._cost

    def dev(d):
        return f"device {d} ({plan.cluster.device_gpus[d]})"

    lines = [
        f"HexiSeq plan '{plan.strategy}': {plan.model.name}, seq_len {plan.seq_len:,}, "
        f"{'causal' if plan.causal else 'full'} attention{_window_words(plan)}, {plan.cluster.describe()}",
    ]
    if plan.stopped_early:
        lines.append("  search           STOPPED EARLY at the time limit: the best plan found by then")
    if plan.documents is not None:
        lines += _documents_lines(plan, one_document)
    lines += [
        f"  step time        {plan.step_time_s:10.4f} s   ({plan.tokens_per_s:,.0f} tokens/s)",
        f"    token-parallel {c['gemm_phase_s']:10.4f} s   slowest {dev(c['gemm_bottleneck'])}",
        f"    all-to-all     {c['a2a_phase_s']:10.4f} s   slowest group of {dev(c['a2a_bottleneck'])}",
        f"    attention+ring {c['ring_phase_s']:10.4f} s   slowest {dev(c['ring_bottleneck'])}",
    ]
    slowest = int(np.flatnonzero(t.device == c['ring_bottleneck'])[0])
    if t.runtime_s[slowest] > 0:
        lines.append(f"      of which the runtime's work around the kernels {t.runtime_s[slowest]:.4f} s "
                     "(calibrated runtime_ns)")
    lines += [
        f"    gradient sync  {c['grad_exposed_s']:10.4f} s   exposed of {c['grad_sync_s']:.4f} s of "
        f"{_sharding_words(plan.training)} over {plan.cluster.num_devices} device(s)",
        f"  lower bound      {plan.lower_bound_s:10.4f} s   (plan is {plan.gap_to_bound:.3f}x the bound)",
    ]
    if plan.cluster.calibration is None:
        lines += [f"  rates            the catalog's, not calibrated: {CATALOG_FIDELITY[0]}",
                  f"                   {CATALOG_FIDELITY[1]}"]
    lines += [
        f"  memory           {'fits' if plan.fits else 'DOES NOT FIT'}: peak "
        f"{float(t.mem_total_gib.max()):.1f} GiB (device {int(t.device[int(np.argmax(t.mem_total_gib))])})",
        f"  model states     {_states_words(plan)}",
    ]
    lines += _memory_feature_lines(plan)
    lines += [
        f"  groups in ring order ({plan.num_groups}):",
    ]
    r = 0
    for g, size in enumerate(plan.layout.group_size.tolist()):
        # a parked device (no tokens, no heads) is not counted as one of its group's members, only named beside it
        off = [(n == 0 and h == 0) for n, h in zip(t.tokens[r:r + size], t.head_count[r:r + size])]
        members = [int(d) for d, o in zip(t.device[r:r + size], off) if not o]
        gpus = sorted(set(x for x, o in zip(t.gpu[r:r + size].tolist(), off) if not o))
        left = [int(d) for d, o in zip(t.device[r:r + size], off) if o]
        lines.append(f"    g{g}: {len(members)} device(s) {_ranges(members) if members else '-'} [{', '.join(gpus)}], "
                     f"seq {int(plan.layout.group_seq[g]):,}" + (f" (and parked {_ranges(left)})" if left else ""))
        r += size
    parked = sorted(int(d) for d, n, h in zip(t.device, t.tokens, t.head_count) if n == 0 and h == 0)
    if parked:
        lines.append(f"  parked           {len(parked)} device(s) {_ranges(parked)} hold no tokens and no heads: the "
                     "scheduler found the plan faster")
        lines.append("                   without them (too little work to spread, or links too slow for it); they "
                     "still join the")
        lines.append("                   collectives. Strategy \"usp\" or \"ring\" (--strategy) uses every device")
    lines.append("")
    lines.append(table(plan))
    return "\n".join(lines)


def table(plan, max_rows: int = 64) -> str:
    """The per-device table as aligned text."""
    t = plan.devices
    saving = any(t.features)
    head = (f"{'dev':>4} {'gpu':<10} {'grp':>3} {'tokens':>9} {'heads':>9} {'kv':>7} {'gemm s':>9} "
            f"{'attn s':>9} {'a2a s':>8} {'ring s':>8} {'busy s':>9} {'mem GiB':>13}" + ("  saves" if saving else ""))
    rows = [head]
    n = len(t)
    idx = list(range(n)) if n <= max_rows else list(range(max_rows // 2)) + list(range(n - max_rows // 2, n))
    last = -1
    for i in idx:
        if i != last + 1:
            rows.append(f"{'...':>4} ({n - max_rows} more)")
        last = i
        heads = _span(t.head_lo[i], t.head_count[i])
        kv = _span(t.kv_lo[i], t.kv_count[i])
        rows.append(
            f"{t.device[i]:>4} {t.gpu[i]:<10} {t.group[i]:>3} {t.tokens[i]:>9,} {heads:>9} {kv:>7} "
            f"{t.gemm_s[i] + t.mem_bound_s[i] + t.offload_s[i] + t.tiling_s[i]:>9.4f} {t.attn_s[i]:>9.4f} {t.a2a_s[i]:>8.4f} {t.ring_exposed_s[i]:>8.4f} "
            f"{t.busy_s[i]:>9.4f} {t.mem_total_gib[i]:>6.1f}/{t.mem_cap_gib[i]:<6.1f}"
            + (f"  {_feature_codes(t.features[i])}" if saving else ""))
    return "\n".join(rows)


def _documents_lines(plan, one) -> List[str]:
    """What the packed documents change: the pairs the mask leaves, the chunking, and the same layout priced as
    one causal document."""
    d = plan.documents
    S = plan.seq_len
    kept = float(np.sum(d * (d + 1) / 2)) / (S * (S + 1) / 2)
    return [
        f"  documents        {d.size:,} packed (mean {S / d.size:,.0f}, longest {int(d.max()):,} tokens): "
        f"{100 * kept:.3g}% of one causal document's pairs; {plan.layout.chunking} chunks",
        f"                   this layout priced as one causal document: {one.step_time_s:.4f} s "
        f"(attention+ring {one._cost['ring_phase_s']:.4f} s)",
    ]


def _states_words(plan) -> str:
    """How the plan divides the model states, and what runs it that way."""
    n, t = plan.cluster.num_devices, plan.training
    if t.sharding is Sharding.NONE:
        return f"replicated on every device ({float(plan.devices.mem_states_gib.max()):.1f} GiB each)"
    lo, hi = (f"{float(f(plan.devices.mem_states_gib)):.1f}" for f in (np.min, np.max))
    span = f"{lo if lo == hi else f'{lo}-{hi}'} GiB per device"
    if t.state_shares == "memory":
        shares = plan.state_shares
        return (f"shared by memory, {100 * float(shares.min()):.2f}-{100 * float(shares.max()):.2f}% of the "
                f"{t.sharding.value}-sharded states per device (even: {100 / n:.2f}%), {span}; run with "
                f"hexiseq.shard_states(module, plan), as FSDP and ZeRO shard evenly")
    return f"even, 1/{n} of the {t.sharding.value}-sharded states per device, {span}"


def _sharding_words(training) -> str:
    """What the gradient collectives are under the plan's sharding."""
    name = str(getattr(training.sharding, "value", training.sharding)).lower()
    return {"full": "parameter gathers and gradient reduce-scatters",
            "grad_opt": "gradient reduce-scatter and parameter gather",
            "opt": "gradient all-reduce", "none": "gradient all-reduce"}.get(name, "collectives")


def _span(lo: int, count: int) -> str:
    """count items from lo as an inclusive range, the way device ranges print ("4-7", "5"); "-" for none."""
    return "-" if count == 0 else f"{lo}" if count == 1 else f"{lo}-{lo + count - 1}"


TABLE_LEGEND = (
    "columns: tokens = the device's share of the sequence; heads, kv = query and key/value heads it holds\n"
    "(inclusive ranges, like devices); gemm s = token-parallel work (the projections' and MLP's matmuls, and the\n"
    "memory-bound norms, activations, loss and optimizer step); attn s = attention of all ring steps; a2a s =\n"
    "all-to-all; ring s = ring transfers not hidden behind attention; busy s = their sum; mem GiB = peak /\n"
    "capacity; saves (when a device needs them) = memory features: O offloaded checkpoints, M tiled MLP, L tiled\n"
    "loss (gemm s holds what they add). Times are per training step, all layers, forward and backward.")


def _feature_codes(features: str) -> str:
    codes = {"offload": "O", "tile_mlp": "M", "tile_loss": "L"}
    return "".join(codes[f] for f in features.split("+")) if features else "-"


def _memory_feature_lines(plan) -> List[str]:
    """Which devices use which memory features, what they add, and how to run them."""
    t = plan.devices
    used = [i for i in range(len(t)) if t.features[i]]
    allowed = plan.training.memory_features
    if not used:
        return [] if allowed == "none" else [
            f"  memory features  none needed ({'allowed: ' + allowed if allowed != 'auto' else 'all allowed'})"]
    words = {"offload": "checkpoints offloaded to host memory", "tile_mlp": "tiled MLP", "tile_loss": "tiled loss"}
    lines = []
    kinds = sorted({(t.features[i], t.gpu[i]) for i in used}, key=lambda k: min(
        int(t.device[i]) for i in used if (t.features[i], t.gpu[i]) == k))
    for combo, gpu in kinds:  # one line per choice and GPU model, in device order
        rows = [i for i in used if t.features[i] == combo and t.gpu[i] == gpu]
        devs = sorted(int(t.device[i]) for i in rows)
        added = max(float(t.offload_s[i] + t.tiling_s[i]) for i in rows)
        host = max(float(t.mem_host_gib[i]) for i in rows)
        what = ", ".join(words[f] for f in combo.split("+"))
        extra = f"; host memory up to {host:.1f} GiB a device" if host > 0 else ""
        lines.append(f"    device(s) {_ranges(devs)} ({gpu}): {what} (adds up to {added:.4f} s{extra})")
    return [f"  memory features  {len(used)} device(s) fit their memory with them (chosen per device; hexiseq.hf "
            "applies them, hexiseq.nn has them for a model of one's own):"] + lines


def _ranges(ids: List[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out, start = [], None
    for i, d in enumerate(ids):
        if start is None:
            start = d
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            out.append(f"{start}" if start == d else f"{start}-{d}")
            start = None
    return ",".join(out)


def _window_words(plan):
    """' (a W-token window on n of L layers)' for a model with sliding-window layers, else ''."""
    m = plan.model
    if m.sliding_window is None or not m.sliding_layers or not plan.causal:
        return ""
    return f" (a {m.sliding_window:,}-token window on {m.sliding_layers} of {m.layers} layers)"
