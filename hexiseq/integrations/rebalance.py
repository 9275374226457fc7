"""Re-balance a running plan when devices slow down (stragglers): token shares follow the ranks' measured speed.

A device of a mixed cluster does not keep the speed it was planned at: it throttles, a neighbour job takes its
cores or its link. `Rebalancer(attention)` watches the attention layer's own timers (HexiSeqContext.phase_s
["attn"], the seconds inside the block kernels) and, when the ranks' measured speeds have moved from what the plan
assumed, re-balances the token shares inside the plan's structure between two steps:

- every rank all-gathers its kernel seconds since the last check; each rank's ratio measured / predicted (the
  plan's per-device attention time) is normalised by the median ratio and smoothed over checks (exponentially,
  `smoothing`), so a uniformly slower run (a different input, a busier machine) moves nothing;
- when some rank's smoothed ratio is more than `threshold` away from 1 for `patience` checks in a row, the
  cluster's per-device rates are divided by the ratios of those last `patience` checks (each rank's median over
  them, unsmoothed: the smoothing is there to decide whether to act, and would lag behind a speed that has just
  changed; a first correction made on it left the step 1.12x a fresh calibrate and plan, below the threshold and so
  never corrected, in benchmarks/results/stragglers_cpu.md) and the plan's layout re-balanced on it
  (Plan.rebalanced(heads=True): the same groups, members and ring order; new S_g, token shares and head counts
  inside each group — a head-parallel group's attention work follows its heads, not its tokens) — every rank
  computes the same new plan from the same gathered figures, and the new context checks the fingerprint as any
  context does;
- the new context reuses the old one's process groups (the structure, hence every all-to-all group, is the same),
  and the model states keep their shares: nothing moves but the next step's token split.

With `replan=True` the Rebalancer also plans the slowed cluster afresh (the scheduler, as `hexiseq.plan` would on
a cluster calibrated now) and takes that plan when it is predicted faster than the re-balanced one: its structure
may differ (a head-parallel group where the ring was), so the new context makes the process groups it needs (a
collective every rank runs at the same check, a few milliseconds on a few ranks); the model states still keep
their shares. In benchmarks/results/stragglers_cpu.md a fresh plan under the competitor was a head-parallel group
of both ranks where the plan was a ring, and the ring re-balanced to the fresh plan's own split still ran 1.4x
its step in two runs of five.

For `3 x patience` checks after a re-balance the threshold is halved, so that a residual left by a correction made
while the speeds were still moving is corrected too.

Default threshold 0.2: the runtime's own step-to-step spread on a busy CPU host is about 5-10% (the benchmarks'
repeated runs), a share moved for less would chase noise; a device 25% slower than planned costs a balanced
ring about that much of the step. The caller re-shards each step's inputs with `rebalancer.plan` (it changes only
when `check()` says so). `check()` returns the event (old and new shares, the ratios, the reason) or None.
"""

import math
from typing import List, Optional

import numpy as np

from .. import geometry
from ..errors import InvalidArgumentError, MemoryFitError, UnsupportedError
from ..planner.cluster import Cluster, gpu_catalog
from ..planner.plan import evaluate
from ..planner.plan import plan_layout as make_plan
from .._validate import number
from ..runtime import wire
from ..runtime.comm import agree
from ..runtime.nn import HexiSeqContext

__all__ = ["Rebalancer", "RebalanceEvent"]

_RATES = ("gemm_tflops", "attn_tflops", "attn_causal_tflops", "attn_document_tflops")


class RebalanceEvent:
    """What a re-balance did: tokens per rank before and after, the smoothed speed ratios (measured / planned time,
    over the median) that triggered it, and a sentence."""

    def __init__(self, before: List[int], after: List[int], ratios: List[float], reason: str):
        self.before, self.after, self.ratios, self.reason = before, after, ratios, reason

    def __repr__(self):
        return f"RebalanceEvent({self.reason})"


def _scaled_cluster(cluster: Cluster, factors) -> Cluster:
    """The cluster with device d's compute rates multiplied by factors[d]. Devices without measured curves get
    flat curves at their catalog rates (peak x efficiency, the node's peak where it gives one) first, every device
    alike, so that only the factors change their ratios."""
    d = cluster.to_dict()
    catalog = {g["name"]: g for g in gpu_catalog()}
    nodes = cluster.nodes
    devices = d.get("devices") or [None] * cluster.num_devices
    out = []
    for i, (rates, f) in enumerate(zip(devices, factors)):
        node = nodes[int(cluster.device_nodes[i])]
        rates = dict(rates or {})
        entry = catalog.get(node.gpu, {})
        peak = node.peak_tflops or entry.get("peak_tflops", 1.0)
        for key in _RATES:
            if key not in rates or not rates[key]:
                eff = entry.get("gemm_eff", 0.5) if key == "gemm_tflops" else entry.get("attn_eff", 0.35)
                rates[key] = [[1.0, peak * eff]]
            rates[key] = [[n, r * f] for n, r in rates[key]]
        out.append(rates)
    d["devices"] = out
    return Cluster.from_dict(d)


def _structure(plan):
    """The groups' members in ring order: what decides the process groups a context needs."""
    return [tuple(g["devices"]) for g in plan.layout.to_dict()["groups"]]


def _show(field, value):
    """A Rebalancer setting in words (the floats travel as their bits)."""
    if field in ("threshold", "smoothing"):
        x = wire.bits_float(value)
        return "invalid" if math.isnan(x) else repr(x)
    return str(bool(value)) if field == "replan" else str(value)


class Rebalancer:
    """Re-balance `attention` (a HexiSeqAttention, or its HexiSeqContext) when the ranks' measured speeds move from
    the plan's. Call `check()` on every rank between steps (collective: one small all-gather); read `plan` to shard
    the next step's inputs. See the module's docstring."""

    def __init__(self, attention, *, threshold: float = 0.2, patience: int = 2, smoothing: float = 0.5,
                 replan: bool = False):
        self.owner = attention if hasattr(attention, "context") else None
        self.context: HexiSeqContext = attention.context if self.owner is not None else attention
        if not isinstance(self.context, HexiSeqContext):
            raise InvalidArgumentError(f"attention must be a hexiseq.nn.HexiSeqAttention or HexiSeqContext, got "
                                       f"{type(attention).__name__}")
        error = None
        try:  # checked here, then agreed by every rank: a rank alone with other settings would re-balance alone
            threshold, smoothing = number(threshold, "threshold"), number(smoothing, "smoothing")
            if not 0 < threshold < 10:
                raise InvalidArgumentError(f"threshold must be in (0, 10), got {threshold!r}")
            if isinstance(patience, bool) or not isinstance(patience, (int, np.integer)) or patience < 1:
                raise InvalidArgumentError(f"patience must be an int >= 1, got {patience!r}")
            if not 0 < smoothing <= 1:
                raise InvalidArgumentError(f"smoothing must be in (0, 1], got {smoothing!r}")
            if not isinstance(replan, bool):
                raise InvalidArgumentError(f"replan must be True or False, got {replan!r}")
        except InvalidArgumentError as e:
            error = e
        ok = error is None
        agree(self.context.comm._cpu_group, [wire.float_bits(threshold if ok else None), int(patience) if ok else 0,
                                              wire.float_bits(smoothing if ok else None), int(replan) if ok else 0],
              ["threshold", "patience", "smoothing", "replan"], error, show=_show)
        self.replan = replan
        self.threshold, self.patience, self.smoothing = float(threshold), int(patience), float(smoothing)
        self.ratios: Optional[np.ndarray] = None
        self._recent: List[np.ndarray] = []  # the last `patience` checks' ratios, unsmoothed
        self._settling = 0  # checks left at half the threshold, after a re-balance
        self._over = 0
        self.events: List[RebalanceEvent] = []
        self.context.reset_timers()

    @property
    def plan(self):
        return self.context.plan

    def _predicted(self):
        """Each rank's planned attention seconds (its slot's attn_s), by rank."""
        p = self.plan
        return np.array([float(p.devices.attn_s[geometry.slot(p.layout, r, p.cluster.num_devices)]) for r in range(self.context.world)])

    def check(self, measured_s: Optional[float] = None) -> Optional[RebalanceEvent]:
        """Gather every rank's kernel seconds since the last check (measured_s: this rank's, instead of its timer: for
        tests and for callers that time their own way) and re-balance when the speeds have moved."""
        ctx = self.context
        error, mine = None, 0.0
        try:  # a bad value on one rank: every rank raises, instead of that one alone while the others wait
            mine = ctx.comm.phase_s["attn"] if measured_s is None else number(measured_s, "measured_s")
            if mine < 0:
                raise InvalidArgumentError(f"measured_s must be >= 0, got {measured_s!r}")
        except InvalidArgumentError as e:
            error, mine = e, 0.0
        ctx.reset_timers()
        every = agree(ctx.comm._cpu_group, [int(round(mine * 1e9))], ["attn_ns"], error, free=("attn_ns",))
        measured = np.array([e[0] for e in every], dtype=np.float64) * 1e-9
        predicted = self._predicted()
        if (measured <= 0).any() or (predicted <= 0).any():
            return None  # a rank that attended nothing (parked, or no call since the last check): nothing to learn
        ratio = measured / predicted
        ratio = ratio / np.median(ratio)
        self.ratios = ratio if self.ratios is None else self.smoothing * ratio + (1 - self.smoothing) * self.ratios
        self._recent = (self._recent + [ratio])[-self.patience:]
        # for a few checks after a re-balance, half the threshold: the speeds were just seen to move, and a first
        # correction made while they still moved can leave a residual below the threshold that would otherwise
        # never be corrected (1.2x the fresh plan's step in one of four straggler runs)
        threshold = self.threshold / 2 if self._settling > 0 else self.threshold
        self._settling = max(0, self._settling - 1)
        if np.abs(self.ratios - 1.0).max() <= threshold:
            self._over = 0
            return None
        self._over += 1
        if self._over < self.patience:
            return None
        return self._rebalance()

    def _rebalance(self):
        ctx, old = self.context, self.plan
        # the plan's cluster with each device's rates divided by its ratio: a rank twice as slow as planned gets
        # rates half as high, and the layout's shares re-balanced on that cluster
        now = np.median(np.array(self._recent), axis=0)  # the speeds of the last checks, not the smoothed ones
        factors = np.ones(old.cluster.num_devices)
        for r in range(ctx.world):
            factors[r] = 1.0 / now[r]
        slowed = _scaled_cluster(old.cluster, factors)
        new = evaluate(slowed, model=old.model, seq_len=old.seq_len, layout=old.layout, training=old.training,
                       causal=old.causal, documents=old.documents).rebalanced(old.documents, heads=True)
        if self.replan:
            try:  # the scheduler on the slowed cluster; every rank computes the same plan from the same figures
                fresh = make_plan(slowed, model=old.model, seq_len=old.seq_len, training=old.training,
                                  causal=old.causal, strategy="hexiseq", documents=old.documents)
                if fresh.step_time_s < new.step_time_s * (1 - 1e-9):
                    new = fresh
            except (MemoryFitError, UnsupportedError):
                pass
        before = [geometry.tokens(old.layout, r, old.cluster.num_devices) for r in range(ctx.world)]
        after = [geometry.tokens(new.layout, r, new.cluster.num_devices) for r in range(ctx.world)]
        slow = int(np.argmax(np.abs(now - 1.0)))
        seen = [float(x) for x in now]
        reason = (f"rank {slow} ran {now[slow]:.2f}x its planned share of the attention time (over the median rank, "
                  f"in the last {len(self._recent)} check(s); threshold {self.threshold:g}, on the smoothed ratios); "
                  f"tokens per rank {before} -> {after}")
        same_structure = _structure(new) == _structure(old)
        if new.layout.to_dict() == old.layout.to_dict():  # (tokens, heads and structure all as they were)
            self._over = 0
            return None
        old_comm = ctx.comm
        groups = {tuple(sorted(old_comm._global)): old_comm.group}
        if old_comm.hp_group is not None:
            groups[tuple(sorted(old_comm._global[mb.rank] for mb in
                                ctx.topology.groups[ctx.topology.group_of(ctx.rank)]))] = old_comm.hp_group

        def subgroups(ranks, backend):  # the old context's groups: the structure, hence every group, is the same
            if backend == "gloo":
                return old_comm._cpu_group
            return groups[tuple(sorted(ranks))]
        # a new structure makes its own process groups (every rank here at the same check, in the same order)
        fresh = HexiSeqContext(new, group=old_comm.group, causal=ctx.causal, softmax_scale=ctx.scale,
                               timeout=old_comm.timeout, a2a_slices=len(ctx.slices) if same_structure else None,
                               subgroups=subgroups if same_structure else None)
        if not same_structure:
            reason += "; planned afresh: " + ", ".join(f"{len(g['devices'])}-device group" for g in
                                                      new.layout.to_dict()["groups"])
        self.context = fresh
        if self.owner is not None:
            self.owner.context = fresh
        self.ratios = np.ones(ctx.world)  # the new plan is made for the speeds just measured
        self._recent = []
        self._settling = 3 * self.patience
        self._over = 0
        event = RebalanceEvent(before, after, seen, reason)
        self.events.append(event)
        return event
