"""Pictures of a plan: per-device shares and time breakdown (matplotlib, imported only when drawing)."""

import numpy as np

from ..errors import HexiseqError

__all__ = ["plot_plan"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt  # headless machines fall back to Agg by themselves
    except ImportError:
        raise HexiseqError("plotting needs matplotlib: pip install matplotlib") from None
    return plt


def plot_plan(plan, path=None, baselines=None):
    """Draw a plan: per device its token share, head count and predicted time terms; groups shaded.

    plan: a hexiseq.Plan. path: write a PNG there (else return the figure). baselines: optional
    {name: Plan} drawn as step-time bars beside the plan's."""
    plt = _pyplot()
    t = plan.devices
    n = len(t)
    x = np.arange(n)
    rows = 4 if baselines else 3
    fig, axes = plt.subplots(rows, 1, figsize=(max(8.0, 0.28 * n + 3), 2.6 * rows), constrained_layout=True)
    colours = plt.cm.tab10(np.arange(10))
    gpu_names = sorted(set(t.gpu.tolist()))
    gpu_colour = {g: colours[i % 10] for i, g in enumerate(gpu_names)}
    bar_colours = [gpu_colour[g] for g in t.gpu.tolist()]
    parked = (np.asarray(t.tokens) == 0) & (np.asarray(t.head_count) == 0)

    def shade(ax):
        edges = np.cumsum(plan.layout.group_size.tolist())[:-1]
        for e in edges:
            ax.axvline(e - 0.5, color="0.4", lw=0.8, ls="--")
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_xticks(x)
        labels = ax.set_xticklabels([str(d) for d in t.device.tolist()], fontsize=7)
        for label, off in zip(labels, parked):
            if off:
                label.set_color("0.55")

    ax = axes[0]
    ax.bar(x, t.tokens, color=bar_colours)
    ax.set_ylabel("tokens")
    ax.set_title(f"{plan.strategy}: {plan.model.name}, seq {plan.seq_len:,}, {plan.cluster.describe()}  "
                 f"(groups in ring order, dashed)", fontsize=9)
    for g in gpu_names:
        ax.bar([0], [0], color=gpu_colour[g], label=g)
    if parked.any():  # devices the scheduler left out: marked, and their numbers greyed on every panel
        ax.plot(x[parked], np.zeros(int(parked.sum())), ls="", marker="x", color="0.3", clip_on=False,
                label=f"parked ({int(parked.sum())}: no tokens, no heads)")
    # legends sit outside the axes, to the right: inside, they covered the last devices' bars and the step line
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    shade(ax)

    ax = axes[1]
    ax.bar(x, t.head_count, color=bar_colours)
    ax.set_ylabel("query heads")
    shade(ax)

    ax = axes[2]
    bottom = np.zeros(n)
    for name, label in (("gemm_s", "matmuls"), ("mem_bound_s", "memory-bound"), ("a2a_s", "all-to-all"), ("attn_s", "attention"),
                        ("ring_exposed_s", "exposed ring")):
        ax.bar(x, t[name], bottom=bottom, label=label)
        bottom += t[name]
    exposed = plan.phases["grad_exposed_s"]  # a term of the step, not of one device: said, not stacked
    ax.axhline(plan.step_time_s, color="k", lw=1, label=f"step {plan.step_time_s:.3g} s" + (
        f" ({exposed:.3g} s of it exposed\ngradient sync, not per device)" if exposed > 0.005 * plan.step_time_s
        else ""))
    ax.axhline(plan.lower_bound_s, color="k", lw=1, ls=":", label=f"lower bound {plan.lower_bound_s:.3g} s")
    ax.set_ylabel("seconds per step\n(predicted)")
    ax.set_xlabel("device (layout order)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    shade(ax)

    if baselines:
        ax = axes[3]
        names = [plan.strategy] + list(baselines)
        values = [plan.tokens_per_s] + [p.tokens_per_s for p in baselines.values()]
        ax.barh(names, values, color=["C3"] + ["C7"] * len(baselines))
        ax.set_xlabel("predicted tokens/s")
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)

    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
