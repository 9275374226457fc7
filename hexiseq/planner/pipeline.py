"""Pipelines: the model's layers in stages over groups of devices, the step's sequences through them as micro-batches
under a one-forward-one-backward schedule.

A pipeline plan cuts the cluster at node boundaries into P stages of consecutive nodes (fast links inside a stage,
only activations over the links between stages), each stage's share of the cluster's matmul rate about 1/P. Each
stage holds consecutive layers (the embedding on the first, the output head on the last: Model.stage), sharded
inside the stage, and runs its layers over its own devices with its own asymmetric CP/HP layout, planned by the
scheduler for its part of the model. The layers are shared out by the stages' speeds and memory
(hexiseq_pipeline_split, over each stage's time per layer and fixed part as the cost model prices them), and the
step is timed by simulating the schedule (hexiseq_pipeline_schedule): every sequence is one micro-batch, its
activations and their gradients cross each stage boundary over the links between the two stages.

What each stage costs is the cost model's figure for its layout running the step's sequences on its part of the
model, divided over the micro-batches (a forward and a backward of 1 : 2, 1 : 3 with recomputation): the gradient
synchronisation inside the stage, once per step, is spread over them. Each stage's memory is the cost model's plus
the activations of the micro-batches it holds at once beyond the first (min(P - s, M) under 1F1B), each as large as
one sequence's (an upper figure: with checkpointing only the layers' inputs stay).

Not yet here: several pipelines side by side (data parallel replicas), stages inside a node, interleaved stages,
tensor parallelism, and a runtime (a pipeline plan is not returned by hexiseq.plan until one runs it)."""

import dataclasses
import time
from typing import List, Optional, Tuple

import numpy as np

from .. import _core
from .._validate import document_lengths, integer
from ..errors import MemoryFitError, UnsupportedError
from .cluster import Cluster
from .model import Model, Sharding, Training
from .floor import catalog_rate, compute_floor_s, model_flops, peak_flops
from .plan import Plan, Strategy, plan_one, resolve_inputs

__all__ = ["PipelinePlan", "Stage", "plan_pipeline", "stage_cuts"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipeline plan. devices: its cluster devices; first_layer, layers: the model's layers it holds;
    plan: its layout over its own devices (renumbered 0..) for its part of the model (plan.model) and the step's
    sequences, with the cost model's figures; forward_s, backward_s: one micro-batch's, as the schedule times it;
    idle_s: the step minus its work; in_flight: the most micro-batches whose activations it holds at once;
    memory_gib: its fullest device's memory with them (the cost model's total, plus the in-flight activations beyond
    one micro-batch's), against memory_cap_gib."""

    devices: Tuple[int, ...]
    first_layer: int
    layers: int
    plan: Plan = dataclasses.field(repr=False)
    forward_s: float
    backward_s: float
    idle_s: float
    in_flight: int
    memory_gib: float
    memory_cap_gib: float


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan (see hexiseq.planner.pipeline). Every time is a prediction.

    pipelines: each pipeline's Stages in pipeline order (the pipelines are data parallel replicas over runs of
    consecutive nodes); stages: the first's; micro_batches: the step's sequences; pack: the sequences packed into one
    micro-batch (as documents); micro_batches_of: how many micro-batches each pipeline runs; send_s: one micro-batch's activations across each stage boundary
    of the first pipeline (and as long for their gradient back); sync_s: the gradient all-reduce across the pipelines,
    each stage's devices with their counterparts (0 for one pipeline); step_time_s: the slowest pipeline's schedule
    plus sync_s; work_s: the busiest stage's work in that pipeline (its micro-batches x (forward + backward));
    bubble_s: step_time_s - sync_s - work_s; model_flops: the step's model FLOPs (the matmuls of the layers and the head, 6 per parameter and token,
    and the attention's visible pairs, 12 per pair, head dim and head); compute_floor_s: those FLOPs at the devices'
    rates (the matmuls at catalog peak x gemm_eff, the attention at peak x attn_eff, or the nodes' overrides), no
    parallelism's overheads: no plan is below it;
    alternatives: (pipelines, stages, pack, step_time_s or None where nothing fit) of every shape tried; solve_s: what
    planning took (measured)."""

    cluster: Cluster
    model: Model
    training: Training
    causal: bool
    seq_len: int
    micro_batches: int
    pack: int
    pipelines: Tuple[Tuple[Stage, ...], ...]
    micro_batches_of: Tuple[int, ...]
    send_s: Tuple[float, ...]
    sync_s: float
    step_time_s: float
    work_s: float
    bubble_s: float
    model_flops: float
    compute_floor_s: float
    alternatives: Tuple[Tuple[int, int, int, Optional[float]], ...] = dataclasses.field(default=(), repr=False)
    solve_s: float = 0.0

    @property
    def stages(self) -> Tuple[Stage, ...]:
        """The stages of the first pipeline (every pipeline has as many, over devices of the same kinds)."""
        return self.pipelines[0]

    @property
    def tokens_per_s(self) -> float:
        return self.micro_batches * self.seq_len / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the devices' dense peak: the fraction of peak the step would use."""
        return self.model_flops / (self.step_time_s * peak_flops(self.cluster, None))

    def to_dict(self) -> dict:
        return {"pipelines": [[{"devices": list(s.devices), "first_layer": s.first_layer, "layers": s.layers,
                                "layout": s.plan.layout.to_dict(), "forward_s": s.forward_s,
                                "backward_s": s.backward_s, "idle_s": s.idle_s, "in_flight": s.in_flight,
                                "memory_gib": s.memory_gib, "memory_cap_gib": s.memory_cap_gib} for s in stages]
                              for stages in self.pipelines],
                "micro_batches": self.micro_batches, "micro_batches_of": list(self.micro_batches_of),
                "seq_len": self.seq_len, "send_s": list(self.send_s),
                "predicted": {"step_time_s": self.step_time_s, "work_s": self.work_s, "bubble_s": self.bubble_s,
                              "sync_s": self.sync_s, "tokens_per_s": self.tokens_per_s,
                              "model_flops": self.model_flops, "compute_floor_s": self.compute_floor_s,
                              "mfu": self.mfu},
                "pack": self.pack,
                "alternatives": [{"pipelines": r, "stages": p, "pack": k, "step_time_s": t}
                                 for r, p, k, t in self.alternatives],
                "solve_s": self.solve_s}

    def explain(self) -> str:
        P, M, R = len(self.stages), self.micro_batches, len(self.pipelines)
        each = "/".join(str(k) for k in sorted(set(self.micro_batches_of)))
        lines = [f"pipeline plan: {M} sequence{'s' if M != 1 else ''} of {self.seq_len:,} tokens of "
                 f"{self.model.name} on {self.cluster.describe()}",
                 f"  {R} pipeline{'s' if R != 1 else ''} (data parallel) of {P} stage{'s' if P != 1 else ''} of "
                 f"consecutive nodes, {each} micro-batch(es) each of {self.pack} sequence(s) packed, one forward one "
                 "backward; "
                 f"planned in {self.solve_s:.2f} s",
                 f"  step (cost model per stage, schedule simulated) {self.step_time_s:.4g} s = the busiest stage's "
                 f"work {self.work_s:.4g} s + bubble {self.bubble_s:.4g} s + gradient sync across pipelines "
                 f"{self.sync_s:.3g} s",
                 f"  compute floor {self.compute_floor_s:.4g} s ({self.model_flops:.3g} model FLOPs at the devices' "
                 f"matmul and attention rates): the step is {self.step_time_s / self.compute_floor_s:.2f}x it; "
                 f"{100 * self.mfu:.1f}% of the devices' peak in model FLOPs"]
        fits = [a for a in self.alternatives if a[3] is not None]
        tried = ", ".join(f"{r}x{p} (pack {k}): {t:.4g} s" for r, p, k, t in sorted(fits, key=lambda a: a[3])[:6])
        if tried:
            lines.append(f"  the fastest shapes of {len(self.alternatives)} tried ({len(fits)} fit), pipelines x stages: "
                         f"{tried}")
        lines.append("  the first pipeline:")
        gpus, rows = self.cluster.device_gpus, []
        for i, s in enumerate(self.stages):
            kinds = {}
            for d in s.devices:
                kinds[gpus[d]] = kinds.get(gpus[d], 0) + 1
            span = f"{s.devices[0]}-{s.devices[-1]}" if len(s.devices) > 1 else f"{s.devices[0]}"
            held = f"{s.first_layer}-{s.first_layer + s.layers - 1}" + (" +emb" if i == 0 else "") + (
                " +head" if i == P - 1 else "")
            rows.append((f"{span} ({', '.join(f'{c}x {k}' for k, c in kinds.items())})", held, s))
        width = max([len("devices")] + [len(r[0]) for r in rows]) + 2
        held_width = max([len("layers")] + [len(r[1]) for r in rows]) + 2
        lines.append("  stage  " + "devices".ljust(width) + "layers".ljust(held_width) +
                     "  fwd (s)    bwd (s)   idle (s)  in flight  memory (GiB)")
        for i, (devices, held, s) in enumerate(rows):
            lines.append(f"  {i:>5}  {devices.ljust(width)}{held.ljust(held_width)}{s.forward_s:>9.4g}  "
                         f"{s.backward_s:>9.4g}  {s.idle_s:>9.4g}  {s.in_flight:>9}  {s.memory_gib:>6.1f} / "
                         f"{s.memory_cap_gib:.1f}")
        return "\n".join(lines)

    def __repr__(self):
        return (f"PipelinePlan(pipelines={len(self.pipelines)}, stages={len(self.stages)}, "
                f"micro_batches={self.micro_batches}, "
                f"step_time_s={self.step_time_s:.4g}, bubble_s={self.bubble_s:.4g})")


def stage_cuts(cluster: Cluster, stages: int) -> Optional[List[Tuple[int, ...]]]:
    """The cluster's nodes cut into `stages` runs of consecutive nodes, each run's share of the matmul rate as near
    1/stages as the nodes allow (each cut where the running share first reaches k/stages, the nearer side), as device
    lists; None when there are fewer nodes than stages."""
    nodes = cluster.nodes
    if stages > len(nodes):
        return None
    rate = [n.count * catalog_rate(n) for n in nodes]
    total, acc, cuts = sum(rate), 0.0, []
    for i, r in enumerate(rate[:-1]):
        before, acc = acc, acc + r
        k = len(cuts) + 1
        if k >= stages:
            break
        target = total * k / stages
        left = len(nodes) - (i + 1)  # nodes after this one
        if left == stages - k or (acc >= target and (acc - target <= target - before or not cuts or cuts[-1] < i)):
            cuts.append(i + 1)
    while len(cuts) < stages - 1:  # too few cuts (very uneven nodes): cut the last nodes one by one
        cuts.append(len(nodes) - (stages - 1 - len(cuts)))
    start = np.concatenate([[0], np.cumsum([n.count for n in nodes])])
    bounds = [0] + cuts + [len(nodes)]
    return [tuple(range(int(start[a]), int(start[b]))) for a, b in zip(bounds[:-1], bounds[1:])]


def _send_s(cluster: Cluster, a: Tuple[int, ...], b: Tuple[int, ...], seq_len: int, model: Model) -> float:
    """One micro-batch's activations (seq_len x hidden) from stage a to stage b: over min(|a|, |b|) device pairs
    side by side, each at the slowest link between the two stages, plus the largest latency."""
    if cluster.bandwidth_gbps is not None:
        gbps = float(np.min(cluster.bandwidth_gbps[np.ix_(a, b)]))
    else:
        nodes = cluster.device_nodes
        gbps = cluster.inter_node_gbps if nodes[a[-1]] != nodes[b[0]] else min(
            cluster.nodes[int(nodes[a[-1]])].intra_gbps, cluster.nodes[int(nodes[b[0]])].intra_gbps)
    lat = cluster.latency_us  # None: the core's defaults, 20 us between nodes, 10 inside one
    if lat is None:
        lat_us = 20.0 if cluster.device_nodes[a[-1]] != cluster.device_nodes[b[0]] else 10.0
    else:
        lat_us = float(lat) if isinstance(lat, float) else float(np.max(np.asarray(lat)[np.ix_(a, b)]))
    lat_s = lat_us * 1e-6
    return seq_len * model.hidden * model.dtype_bytes / (min(len(a), len(b)) * gbps * 1e9) + lat_s


def _memory(plan: Plan, in_flight: int) -> Tuple[float, float, bool]:
    """The fullest device of a stage's plan holding `in_flight` micro-batches' activations: (GiB, its cap, fits).
    Each micro-batch beyond the one the cost model counts adds what it keeps until its backward: with checkpointing
    each layer's input (tokens x hidden), else every activation the cost model counts for one."""
    t, m = plan.devices, plan.model
    if plan.training.checkpointing:
        stash = t.tokens * (m.layers * m.hidden * m.dtype_bytes) / 2.0 ** 30
    else:
        stash = t.mem_act_gib + t.mem_attn_gib
    need = t.mem_total_gib + (in_flight - 1) * stash
    i = int(np.argmax(need - t.mem_cap_gib))
    return float(need[i]), float(t.mem_cap_gib[i]), bool(np.all(need <= t.mem_cap_gib))


# the scheduler's plans of one plan_pipeline call, by stage shape: stages of the same devices, layers and
# micro-batches are planned once whatever their place in the pipeline (only their in-flight memory differs)
_SCHEDULED: dict = {}


def _stage_plan(sub, model, training, seq_len, causal, layers, first, last, in_flight, layout=None, docs=None):
    """The plan of a stage of `layers` layers for micro-batches of `seq_len` tokens (`docs`: the sequences packed in
    one, or None for one), the scheduler's or `layout` priced, if it fits with its in-flight micro-batches; None when
    no layout fits."""
    part = model.stage(layers, first, last)
    if layout is None:
        key = (repr(sub.to_dict()), part, training, seq_len, causal, None if docs is None else tuple(docs))
        if key not in _SCHEDULED:
            try:  # the scheduler alone (no search for what would fit when nothing does)
                _SCHEDULED[key] = plan_one(sub, part, training, seq_len, causal, Strategy.HEXISEQ, None,
                                           document_lengths(docs, seq_len))
            except (MemoryFitError, UnsupportedError):
                _SCHEDULED[key] = None
        p = _SCHEDULED[key]
    else:
        try:
            p = Plan(sub, part, training, seq_len, causal, "hexiseq", layout, documents=docs)
        except (MemoryFitError, UnsupportedError):
            return None
    return p if p is not None and p.fits and _memory(p, in_flight)[2] else None


def _trainings(training: Training) -> List[Training]:
    """The settings a stage may run: the user's and, under full sharding, the optimizer states alone sharded inside
    the stage (ZeRO-1: the stage's parameters and gradients whole on each of its devices, so no micro-batch gathers
    them again; a stage holds a fraction of the model, which often leaves the room)."""
    out = [training]
    if training.sharding == Sharding.FULL:
        out.append(dataclasses.replace(training, sharding=Sharding.OPT))
    return out


def _stage_base(sub, model, training, seq_len, causal, first, last, in_flight, guess, most, M, memo, docs):
    """(base plan, fixed_s, layer_s, cap) of a stage: the scheduler's layout at `guess` layers (or 1) under the user's
    setting (else ZeRO-1), priced under each setting that fits and the fastest kept; its time per micro-batch as
    fixed + layers x per layer; the most layers the layout holds with `in_flight` micro-batches. One scheduler run
    per stage shape (stages of the same devices price alike; `memo`)."""
    key = (repr(sub.to_dict()), first, last, in_flight, guess, most, M, seq_len)
    if key in memo:
        return memo[key]
    found = None
    for tr in _trainings(training):
        for n in (guess, 1):
            found = _stage_plan(sub, model, tr, seq_len, causal, n, first, last, in_flight, docs=docs)
            if found is not None:
                break
        if found is not None:
            break
    if found is None:
        memo[key] = None
        return None
    priced = [_stage_plan(sub, model, tr, seq_len, causal, found.model.layers, first, last, in_flight, found.layout,
                          docs) for tr in _trainings(training)]
    base = min((p for p in priced if p is not None), key=lambda p: p.step_time_s)
    tr = base.training
    t1 = Plan(sub, model.stage(1, first, last), tr, seq_len, causal, "hexiseq", base.layout,
              documents=docs).step_time_s
    t2 = Plan(sub, model.stage(2, first, last), tr, seq_len, causal, "hexiseq", base.layout,
              documents=docs).step_time_s if most >= 2 else t1
    lo, hi = base.model.layers, most  # the most layers the base layout holds: lo fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _stage_plan(sub, model, tr, seq_len, causal, mid, first, last, in_flight, base.layout, docs) is not None:
            lo = mid
        else:
            hi = mid - 1
    memo[key] = (base, max(t1 - (t2 - t1), 0.0) / M, max(t2 - t1, 0.0) / M, lo)
    return memo[key]


def _pipeline(cluster, model, training, seq_len, causal, cuts, memo, docs=None, polish=False):
    """One pipeline over the stages `cuts` (device lists of `cluster`) running training.sequences micro-batches of
    `seq_len` tokens (`docs`: the sequences packed in each, or None): (stages, send_s, the schedule's timing), or None
    when it does not fit. Each stage runs its base layout at its layers under the fastest setting that fits; polish:
    the scheduler plans each stage again at its layers, and the faster layout is kept (the chosen shape's last
    step)."""
    P, M, L = len(cuts), training.sequences, model.layers
    r = 3.0 if training.checkpointing else 2.0  # backward : forward, recomputation included
    subs = [cluster.subset(c) for c in cuts]
    in_flight = [min(P - s, M) for s in range(P)]
    most = L - (P - 1)
    guess = max(1, min(most, round(L / P)))
    made = [_stage_base(subs[s], model, training, seq_len, causal, s == 0, s == P - 1, in_flight[s], guess, most, M,
                        memo, docs) for s in range(P)]
    if any(m is None for m in made):
        return None
    try:
        layers, _ = _core.pipeline_split(L, [m[1] for m in made], [m[2] for m in made], [m[3] for m in made])
    except MemoryFitError:
        return None
    stage_plans = []
    for s in range(P):
        n, first, last = int(layers[s]), s == 0, s == P - 1
        key = ("final", repr(subs[s].to_dict()), first, last, in_flight[s], n, M, seq_len, polish)
        if key not in memo:
            # the base layout at these layers under each setting, and with polish the scheduler's own: the fastest
            tried = [_stage_plan(subs[s], model, tr, seq_len, causal, n, first, last, in_flight[s],
                                 made[s][0].layout, docs) for tr in _trainings(training)]
            if polish:
                tried += [_stage_plan(subs[s], model, tr, seq_len, causal, n, first, last, in_flight[s], docs=docs)
                          for tr in _trainings(training)]
            tried = [p for p in tried if p is not None]
            memo[key] = min(tried, key=lambda p: p.step_time_s) if tried else None
        if memo[key] is None:
            return None
        stage_plans.append(memo[key])
    forward = [p.step_time_s / (M * (1.0 + r)) for p in stage_plans]
    backward = [r * f for f in forward]
    send = [_send_s(cluster, cuts[s], cuts[s + 1], seq_len, model) for s in range(P - 1)]
    timing, idle, held = _core.pipeline_schedule(forward, backward, send if P > 1 else None, M)
    stages, first_layer = [], 0
    for s in range(P):
        mem, cap, _ = _memory(stage_plans[s], int(held[s]))
        stages.append(Stage(tuple(cuts[s]), first_layer, int(layers[s]), stage_plans[s], forward[s], backward[s],
                            float(idle[s]), int(held[s]), mem, cap))
        first_layer += int(layers[s])
    return tuple(stages), tuple(send), timing


def _node_runs(cluster: Cluster, count: int) -> List[Tuple[int, ...]]:
    """The cluster's nodes in `count` runs of consecutive nodes, as equal in node count as they divide (device lists)."""
    n = len(cluster.nodes)
    start = np.concatenate([[0], np.cumsum([node.count for node in cluster.nodes])])
    bounds = [round(k * n / count) for k in range(count + 1)]
    return [tuple(range(int(start[a]), int(start[b]))) for a, b in zip(bounds[:-1], bounds[1:])]


def _shares(cluster: Cluster, runs, M: int) -> List[List[int]]:
    """How the step's M sequences may be shared out among pipelines over `runs`: evenly, and in proportion to each
    run's matmul rate (largest remainders), when that differs."""
    R = len(runs)
    even = [M // R + (1 if r < M % R else 0) for r in range(R)]
    rate = np.array([peak_flops(cluster.subset(run)) for run in runs])
    want = M * rate / rate.sum()
    got = np.floor(want).astype(int)
    for r in np.argsort(-(want - got), kind="stable")[:M - int(got.sum())]:
        got[r] += 1
    by_rate = [int(x) for x in got]
    return [even] if by_rate == even or not any(by_rate) else [even, by_rate]


def _shape(cluster, model, training, seq_len, causal, runs, share, P, k, memo, polish=False):
    """(step_s, pipelines, micro-batches of each, send_s of the first, sync_s, the slowest's timing, k) of pipelines
    over `runs` with `share` sequences each, P stages, k sequences per micro-batch; None when one does not fit."""
    made, slowest = [], None
    for r, run in enumerate(runs):
        if share[r] == 0:  # a pipeline without sequences: idle this step, its gradients zero
            continue
        sub = cluster.subset(run)
        micro = -(-share[r] // k)
        tr = dataclasses.replace(training, sequences=micro)
        key = ("pipeline", repr(sub.to_dict()), P, micro, k, polish)
        if key not in memo:
            memo[key] = _pipeline(sub, model, tr, seq_len * k, causal, stage_cuts(sub, P), memo,
                                  None if k == 1 else [seq_len] * k, polish)
        one = memo[key]
        if one is None:
            return None
        made.append((one, run))
        if slowest is None or one[2]["step_s"] > slowest[2]["step_s"]:
            slowest = one
    pipes = tuple(_shift(one[0], run[0]) for one, run in made)
    sync = _sync_s(cluster, model, pipes)
    return (slowest[2]["step_s"] + sync, pipes, tuple(-(-x // k) for x in share if x), made[0][0][1], sync,
            slowest[2], k)


def _sync_s(cluster: Cluster, model: Model, pipelines) -> float:
    """The gradient all-reduce across pipelines: each stage's devices reduce the stage's gradients, split among them,
    with the same stage's devices of the other pipelines (2 (R - 1) / R of a share over the link between nodes, and
    2 (R - 1) latencies); stages run theirs side by side, so the step waits for the slowest stage."""
    R = len(pipelines)
    if R <= 1:
        return 0.0
    gbps = cluster.inter_node_gbps if cluster.bandwidth_gbps is None else float(np.min(
        cluster.bandwidth_gbps[np.ix_(pipelines[0][0].devices, pipelines[1][0].devices)]))
    worst = 0.0
    for s in range(len(pipelines[0])):
        part = pipelines[0][s].plan.model
        share = part.params * part.dtype_bytes / min(len(p[s].devices) for p in pipelines)
        worst = max(worst, 2.0 * (R - 1) / R * share / (gbps * 1e9) + 2.0 * (R - 1) * 20e-6)
    return worst


def _shift(stages, offset):
    """The stages of an identical pipeline `offset` devices further along the cluster."""
    return tuple(dataclasses.replace(s, devices=tuple(d + offset for d in s.devices)) for s in stages)


def plan_pipeline(cluster, *, model="gpt-7b", seq_len=131072, training=None, causal=True,
                  stages=None, pipelines=None, pack=None) -> PipelinePlan:
    """The fastest pipeline plan (see hexiseq.planner.pipeline) for `training.sequences` sequences of `seq_len`
    tokens: R pipelines (data parallel, each over a run of consecutive nodes, the sequences shared out among them) of
    P stages each, for R in 1, 2, 4, ... up to the sequences and the nodes, and P in 1, 2, 4, ... up to a pipeline's
    nodes and the model's layers (and that node count), and micro-batches of k sequences packed as documents, for k
    in 1, 2, 4, ... while a pipeline of several stages keeps at least as many micro-batches as stages; or the
    `pipelines`, `stages` and `pack` (k) given. One pipeline of one stage is the single group of today, timed the same
    way (with every sequence packed into one micro-batch: one pass, as a batch plan's group packs them).

    Raises MemoryFitError when no shape fits; InvalidArgumentError for bad input (pipelines out of [1, min(nodes,
    sequences)], stages out of [1, min(a pipeline's nodes, layers)])."""
    t0 = time.perf_counter()
    _SCHEDULED.clear()
    try:
        return _plan_pipeline(cluster, model, seq_len, training, causal, stages, pipelines, pack, t0)
    finally:
        _SCHEDULED.clear()


def _plan_pipeline(cluster, model, seq_len, training, causal, stages, pipelines, pack, t0):
    cluster, model, training, seq_len = resolve_inputs(cluster, model, training, seq_len)
    causal = bool(causal)
    nodes, M = len(cluster.nodes), training.sequences

    def powers(most):
        return sorted({1, most} | {1 << k for k in range(32) if (1 << k) <= most})

    replica_counts = powers(min(nodes, M)) if pipelines is None else [
        integer(pipelines, "pipelines", 1, min(nodes, M))]
    if pack is not None:
        pack = integer(pack, "pack", 1, -(-M // replica_counts[0]))  # at most a pipeline's sequences
    if stages is not None:
        stages = integer(stages, "stages", 1, min(nodes // replica_counts[0] if pipelines is not None else nodes,
                                                  model.layers))
    memo, results, best = {}, [], None
    for R in replica_counts:
        runs = _node_runs(cluster, R)
        per_node = nodes // R
        counts = powers(min(per_node, model.layers)) if stages is None else [stages]
        for P, share in ((P, share) for P in counts for share in _shares(cluster, runs, M)):
            if P > min(len({int(n) for n in cluster.device_nodes[list(run)]}) for run in runs):
                continue
            # sequences packed per micro-batch (as documents): 1, 2, 4, ... as long as the pipeline keeps at least
            # as many micro-batches as it has stages (fewer leave most stages idle), or `pack`
            # (one stage: one sequence per micro-batch, the single group of today; packing a group's passes is the
            # batch planner's, hexiseq.plan's, work)
            packs = [k for k in powers(max(share)) if k == 1 or (P > 1 and max(share) / k >= P)] if pack is None \
                else [k for k in (pack,) if k <= max(share)]
            for k in packs:
                shape = _shape(cluster, model, training, seq_len, causal, runs, share, P, k, memo)
                results.append((R, P, k, None if shape is None else shape[0]))
                if shape is not None and (best is None or shape[0] < best[0][0]):
                    best = (shape, (runs, share, P, k))
    if best is not None:  # the chosen shape once more, each stage's layout planned again at its layers
        runs, share, P, k = best[1]
        polished = _shape(cluster, model, training, seq_len, causal, runs, share, P, k, memo, polish=True)
        if polished is not None and polished[0] < best[0][0]:
            best = (polished, best[1])
        best = best[0]
    if best is None:
        raise MemoryFitError(f"no pipeline plan ({', '.join(f'{r} x {p} stages' for r, p, k, _ in results if k == 1)} "
                             f"tried) over {cluster.describe()} holds {model.name} at seq_len {seq_len:,}")
    step, pipes, share, send, sync, timing, k = best
    return PipelinePlan(cluster, model, training, causal, seq_len, M, k, pipes, share, send, sync, step,
                        timing["work_s"], timing["bubble_s"], sum(model_flops(model, seq_len, M, causal)),
                        compute_floor_s(cluster, model, seq_len, M, causal), tuple(results),
                        time.perf_counter() - t0)
