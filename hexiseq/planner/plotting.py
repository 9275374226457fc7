"""Pictures of a plan: per-device shares and time breakdown (matplotlib, imported only when drawing)."""

import textwrap

import numpy as np

from ..errors import HexiseqError

__all__ = ["plot_plan"]


def require_pyplot():
    """matplotlib.pyplot, or a HexiseqError naming the extra that installs it."""
    try:
        import matplotlib.pyplot as plt  # headless machines fall back to Agg by themselves
    except ImportError:
        raise HexiseqError('plotting needs matplotlib, which is not installed: pip install "hexiseq[plot]" (or '
                           "pip install matplotlib)") from None
    return plt


def plot_plan(plan, path=None, baselines=None):
    """Draw a plan: per device its token share, head count and predicted time terms; groups divided by dashed lines
    and named above; parked devices (no tokens, no heads) drawn apart, after every group, on a grey band.

    plan: a hexiseq.Plan. path: write a PNG there (else return the figure). baselines: optional
    {name: Plan} drawn as tokens/s bars beside the plan's."""
    plt = require_pyplot()
    from matplotlib.ticker import MaxNLocator

    t = plan.devices
    n = len(t)
    parked_rows = (np.asarray(t.tokens) == 0) & (np.asarray(t.head_count) == 0)
    # the groups' working members in layout order, then the parked devices: a parked device holds nothing of its
    # group's sequence or heads, so it is not drawn (or counted) as one of the group's members
    order = np.concatenate([np.flatnonzero(~parked_rows), np.flatnonzero(parked_rows)])
    parked = parked_rows[order]
    active = int((~parked).sum())
    group = np.asarray(t.group)[order]
    gpu = [t.gpu.tolist()[i] for i in order]
    x = np.arange(n)
    rows = 4 if baselines else 3
    width = max(8.0, 0.28 * n + 3)
    fig, axes = plt.subplots(rows, 1, figsize=(width, 2.6 * rows + 0.4), constrained_layout=True)
    # the GPU models in a palette of their own: the time terms below use the default colours
    colours = list(plt.cm.Set2(np.arange(8))) + list(plt.cm.Dark2(np.arange(8)))
    gpu_names = sorted(set(gpu))
    gpu_colour = {g: colours[i % len(colours)] for i, g in enumerate(gpu_names)}
    bar_colours = [gpu_colour[g] for g in gpu]
    # group spans over the working devices (a group whose devices are all parked has none)
    spans = []
    for g in dict.fromkeys(group[:active].tolist()):
        at = np.flatnonzero(group[:active] == g)
        spans.append((g, int(at[0]), int(at[-1])))

    title = (f"{plan.strategy}: {plan.model.name}, seq {plan.seq_len:,}, {plan.cluster.describe()}\n"
             + (f"{plan.num_groups} groups in ring order (dashed lines)" if plan.num_groups > 1 else "one group")
             + (f"; {n - active} parked (no tokens, no heads), apart on the grey band" if n > active else ""))
    # wrapped to the figure's width (at 9 pt about 14 characters an inch), so a long cluster is not clipped
    fig.suptitle("\n".join(textwrap.fill(line, int(width * 14)) for line in title.split("\n")), fontsize=9)

    def shade(ax, names=False):
        for _, first, _ in spans[1:]:
            ax.axvline(first - 0.5, color="0.4", lw=0.8, ls="--")
        if active < n:
            ax.axvspan(active - 0.5, n - 0.5, color="0.92", zorder=0)
            ax.axvline(active - 0.5, color="0.4", lw=0.8)
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_xticks(x)
        labels = ax.set_xticklabels([str(int(t.device[i])) for i in order], fontsize=7)
        for label, off in zip(labels, parked):
            if off:
                label.set_color("0.55")
        if names:  # each group named over its working devices, and the parked band
            for g, first, last in spans:
                ax.text((first + last) / 2, 1.01, f"g{g}: {last - first + 1}", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=7)
            if active < n:
                ax.text((active + n - 1) / 2, 1.01, f"parked: {n - active}", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=7, color="0.35")

    ax = axes[0]
    ax.bar(x, np.asarray(t.tokens)[order], color=bar_colours)
    ax.set_ylabel("tokens")
    for g in gpu_names:
        only_parked = all(p for p, name in zip(parked, gpu) if name == g)
        ax.bar([0], [0], color=gpu_colour[g], label=g + (" (parked only)" if only_parked else ""))
    if parked.any():  # devices the scheduler left out: marked, and their numbers greyed on every panel
        ax.plot(x[parked], np.zeros(int(parked.sum())), ls="", marker="x", color="0.3", clip_on=False,
                label=f"parked ({int(parked.sum())}: no tokens, no heads)")
    # legends sit outside the axes, to the right: inside, they covered the last devices' bars and the step line
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    shade(ax, names=True)

    ax = axes[1]
    ax.bar(x, np.asarray(t.head_count)[order], color=bar_colours)
    ax.set_ylabel("query heads")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    shade(ax)

    ax = axes[2]
    bottom = np.zeros(n)
    # every term of a device's busy time, in a colour of its own (the memory features' and the runtime's only
    # where some device has them)
    terms = (("gemm_s", "matmuls", "C0", True), ("mem_bound_s", "memory-bound", "C1", True),
             ("offload_s", "offloaded checkpoints' copies", "C8", False),
             ("tiling_s", "tiled MLP and loss", "C9", False),
             ("a2a_s", "all-to-all", "C2", True), ("attn_s", "attention", "C3", True),
             ("ring_exposed_s", "exposed ring", "C4", True), ("runtime_s", "runtime work", "C5", False))
    for name, label, colour, always in terms:
        v = np.asarray(t[name], dtype=float)[order]
        if always or np.any(v > 0):
            ax.bar(x, v, bottom=bottom, label=label, color=colour)
            bottom += v
    exposed = plan.phases["grad_exposed_s"]  # a term of the step, not of one device: said, not stacked
    # the step sums each phase's slowest device (or group), which may be different ones: no bar need reach it
    ax.axhline(plan.step_time_s, color="k", lw=1, label=f"step {plan.step_time_s:.3g} s: each phase's slowest\n"
               "device, summed" + (f", and {exposed:.3g} s of exposed\ngradient sync, not per device"
                                   if exposed > 0.005 * plan.step_time_s else ""))
    ax.axhline(plan.lower_bound_s, color="k", lw=1, ls=":", label=f"lower bound {plan.lower_bound_s:.3g} s")
    ax.set_ylabel("seconds per step\n(predicted)")
    ax.set_xlabel("device (layout order" + ("; parked devices last)" if active < n else ")"))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    shade(ax)

    if baselines:
        ax = axes[3]
        names = [plan.strategy] + list(baselines)
        values = [plan.tokens_per_s] + [p.tokens_per_s for p in baselines.values()]
        ax.barh(names, values, color=["C3"] + ["C7"] * len(baselines))
        ax.set_xlabel("predicted tokens/s")
        ax.set_title("strategies side by side (same cost model)", fontsize=8)
        ax.set_xlim(0, max(values) * 1.15)  # room for the figures written after the bars
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)

    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
