"""The plan of one training step's batch (hexiseq.planner.batch): its groups, the assignment of its sequences, each
group's passes and their plans, and the predicted figures. Made by hexiseq.planner.batch.BatchPlanner."""

import dataclasses
import functools
import hashlib
import json
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from ..schedule import Schedule
from .cluster import Cluster
from .model import Training
from .plan import Plan


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A step's sequences assigned to groups of devices (see hexiseq.planner.batch). Every time is a prediction.

    groups: the devices of each group (device indices of the cluster).
    assignment: the group index of each sequence, in batch order.
    lengths: each sequence's tokens (documents: their sum); documents: each sequence's document lengths or None.
    group_time_s: each group's time, its passes scored exactly by the cost model (plan_for) in an exact plan; in a
    per-step plan (plan(..., exact=False)) the linear pricing, no pass scored; model_group_time_s: the same priced
    linearly, as the search ranked plans; searched_s: the best step the search found under that
    pricing (before the finalists were scored exactly); passes: the
    sequences of each group's packed passes (one pass unless they exceed what the group holds at once); capacity:
    the tokens one pass of each group holds; sync_s: the gradient
    synchronisation across groups; step_time_s: the slowest group plus sync_s (so scored by the cost model in an
    exact plan, priced linearly in a per-step one); lower_bound_s: a bound on the step of any cut of the candidate
    tree and any assignment under the linear pricing (a bound of model_step_time_s: an exact plan's step_time_s may
    be below it); solve_s: what choosing the groups and the assignment took
    (seconds of this process, measured)."""

    cluster: Cluster
    model: object
    training: Training
    causal: bool
    groups: Tuple[Tuple[int, ...], ...]
    assignment: Tuple[int, ...]
    lengths: Tuple[int, ...]
    documents: Tuple[Optional[Tuple[int, ...]], ...]
    group_time_s: Tuple[float, ...]
    sync_s: float
    step_time_s: float
    lower_bound_s: float
    candidates: int
    solve_s: float
    exact_assignment: bool
    passes: Tuple[Tuple[Tuple[int, ...], ...], ...]
    capacity: Tuple[int, ...]
    model_group_time_s: Tuple[float, ...]
    searched_s: float
    pass_plans: Tuple[Tuple[Plan, ...], ...] = dataclasses.field(repr=False, compare=False)
    # per number of groups, the best step found for a cut of that many groups, and whether it was scored exactly
    # (else the search's linear pricing): why this many groups and not fewer or more
    alternatives: Tuple[Tuple[int, float, bool], ...] = dataclasses.field(default=(), repr=False, compare=False)
    # split_documents: (sequence of the caller's batch, document index in it) of each planned sequence; None when
    # the plan's sequences are the caller's own
    origin: Optional[Tuple[Tuple[int, int], ...]] = None
    # plan(..., time_limit_s=...) ran out of time before every finalist cut was scored: the best of those scored
    stopped_early: bool = False
    # group_time_s scores every pass with the cost model (an exact plan); False: the linear pricing (a per-step
    # plan, whose passes are resolved all the same, from the bases of their kind of group)
    scored: bool = True

    @property
    def gap_to_bound(self) -> float:
        """model_step_time_s / lower_bound_s (1.0 is ideal): how far the plan is from the best any grouping could
        reach, both under the search's linear pricing (the bound is one of that pricing, and step_time_s, scored
        exactly, may be above or below it)."""
        return self.model_step_time_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf

    @property
    def tokens_per_s(self) -> float:
        return float(sum(self.lengths)) / self.step_time_s

    def split_batch(self, batch: Sequence, dim: int = 0) -> list:
        """The caller's batch (one token tensor per sequence, its tokens along `dim`) as the plan's sequences: with
        split_documents each document of a packed sequence is a sequence of the plan, cut out of its own at its
        boundaries; else the batch as it is. What BatchContext's passes take."""
        if self.origin is None:
            return list(batch)
        # where document j of caller sequence i starts: after its documents 0 .. j - 1, wherever the plan lists them
        start, docs = {}, {}
        for k, (i, j) in enumerate(self.origin):
            docs.setdefault(i, []).append((j, k))
        for i, listed in docs.items():
            at = 0
            for j, k in sorted(listed):
                start[k] = at
                at += self.lengths[k]
        out = []
        for k, (i, _) in enumerate(self.origin):
            x, a = batch[i], start[k]
            out.append(x.narrow(dim, a, self.lengths[k]) if hasattr(x, "narrow") else
                       x[(slice(None),) * dim + (slice(a, a + self.lengths[k]),)])
        return out

    def per_caller_sequence(self, values: Sequence) -> list:
        """Figures of the plan's sequences (losses, token counts: one per planned sequence, in plan order) summed
        per sequence of the caller's batch (the identity without split_documents)."""
        if self.origin is None:
            return list(values)
        out = [None] * (max(i for i, _ in self.origin) + 1)
        for (i, _), v in zip(self.origin, values):
            out[i] = v if out[i] is None else out[i] + v
        return out

    def sequences_of(self, g) -> List[int]:
        """The sequences group g runs, in batch order."""
        return [i for i, a in enumerate(self.assignment) if a == g]

    def passes_of(self, g) -> List[List[int]]:
        """The sequences group g runs in each of its packed passes (one unless they exceed its capacity)."""
        return [list(p) for p in self.passes[g]]

    def plan_for(self, g, p=0) -> Plan:
        """The plan group g runs its pass p with (devices renumbered 0.. in the order of `groups[g]`) over that pass's
        packed sequence (each sequence a document, or its own documents), made when this plan was: in an exact plan
        the scheduler's plan for it or one of the base layouts of the group's kind re-balanced to it, whichever the
        cost model scores fastest (group_time_s sums these); in a per-step plan the fastest of the bases re-balanced
        to it."""
        if not _index(g, len(self.groups)):
            raise InvalidArgumentError(f"g must be a group of the plan, in [0, {len(self.groups)}), got {g!r}")
        if not _index(p, len(self.passes[g])):
            raise InvalidArgumentError(f"group {g} makes {len(self.passes[g])} pass(es), got pass {p!r}")
        return self.pass_plans[g][p]

    @property
    def model_step_time_s(self) -> float:
        """The step as the search priced it (f + a S + b P per pass, see hexiseq.planner.batch), beside step_time_s,
        which scores every pass exactly: how far the search's linear pricing was from the cost model."""
        return max(self.model_group_time_s) + self.sync_s

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything a step's execution depends on (the cluster, model and training, causal, the groups,
        the assignment, the passes, the batch, and every pass's plan); ranks compare it before running a step.
        Hashed once (the planner does it when it makes the plan)."""
        plans = [[self.plan_for(g, p).fingerprint for p in range(len(self.passes[g]))] for g in range(len(self.groups))]
        canon = json.dumps({"cluster": self.cluster.to_dict(), "model": self.model.to_dict(),
                            "training": self.training.to_dict(), "causal": self.causal,
                            "groups": [list(g) for g in self.groups], "assignment": list(self.assignment),
                            "passes": [[list(p) for p in ps] for ps in self.passes], "lengths": list(self.lengths),
                            "documents": [None if d is None else list(d) for d in self.documents], "plans": plans},
                           sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The plan as the runtime runs it (hexiseq.schedule.Schedule): the groups, the passes, the batch, and
        every pass's resolved layout as plain data; its fingerprint is the plan's."""
        return Schedule(self.cluster.num_devices, self.causal, tuple(tuple(g) for g in self.groups),
                        tuple(tuple(tuple(p) for p in ps) for ps in self.passes), tuple(self.lengths),
                        tuple(self.documents),
                        tuple(tuple(p.pass_layout for p in plans) for plans in self.pass_plans),
                        repr((self.cluster.to_dict(), self.model.to_dict())),
                        self.fingerprint)

    def to_dict(self) -> dict:
        """The plan as plain data: groups, assignment, each group's passes (sequence indices), the batch, and the
        predicted figures: step_time_s and group_time_s (the cost model's score of every pass when "scored" is true,
        an exact plan; else, a per-step plan, the linear pricing), model_step_time_s (the linear pricing), sync_s,
        lower_bound_s (the linear pricing's bound: model_step_time_s is at or above it, a scored step may be below)."""
        return {"groups": [list(g) for g in self.groups], "assignment": list(self.assignment),
                "passes": [[list(p) for p in ps] for ps in self.passes],
                "lengths": list(self.lengths), "documents": [None if d is None else list(d) for d in self.documents],
                "predicted": {"step_time_s": self.step_time_s, "group_time_s": list(self.group_time_s),
                              "model_step_time_s": self.model_step_time_s, "sync_s": self.sync_s,
                              "lower_bound_s": self.lower_bound_s, "tokens_per_s": self.tokens_per_s},
                "scored": self.scored,
                "origin": None if self.origin is None else [list(o) for o in self.origin],
                "candidates": self.candidates, "solve_s": self.solve_s,
                **({"stopped_early": True} if self.stopped_early else {}),
                "alternatives": [{"groups": k, "step_time_s": t, "scored": e} for k, t, e in self.alternatives]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def explain(self) -> str:
        gpus = self.cluster.device_gpus
        what = f"{len(self.lengths)} sequence{'s' if len(self.lengths) != 1 else ''}"
        if self.origin is not None:
            what = (f"{len({i for i, _ in self.origin})} sequences, split at their documents into "
                    f"{len(self.lengths)}")
        lines = [f"batch plan: {what} ({sum(self.lengths):,} tokens, the longest "
                 f"{max(self.lengths):,}) on {self.cluster.describe()}",
                 f"  {len(self.groups)} group{'s' if len(self.groups) != 1 else ''} chosen from {self.candidates} candidates in "
                 f"{self.solve_s * 1e3:.0f} ms" + (" (STOPPED EARLY at the time limit: the best cut scored by then)"
                                                  if self.stopped_early else "")] + self._step_lines()
        why = self._why()
        if why:
            lines.append(why)
        heads = []
        for g, devs in enumerate(self.groups):
            kinds = {}
            for d in devs:
                kinds[gpus[d]] = kinds.get(gpus[d], 0) + 1
            what = ", ".join(f"{c}x {k}" for k, c in kinds.items())
            span = f"{devs[0]}" if len(devs) == 1 else f"{devs[0]}-{devs[-1]}"
            heads.append(f"  {g:>5}  {span:>9} ({what})")
        width = max([43] + [len(h) + 1 for h in heads])  # the devices column as wide as its longest entry
        lines.append("  group  devices".ljust(width) + "sequences  tokens       time (s, "
                     + ("scored)" if self.scored else "priced)"))
        for g, head in enumerate(heads):
            seqs = self.sequences_of(g)
            lines.append(head.ljust(width) + f"{len(seqs):>9}  "
                         f"{sum(self.lengths[i] for i in seqs):>11,}  {self.group_time_s[g]:>9.4g}")
        return "\n".join(lines)

    def _step_lines(self) -> List[str]:
        """The step's figures, each labelled by what it is: the cost model's score of every pass (exact plans), the
        search's linear pricing, and that pricing's lower bound (which bounds the pricing, not the scored step)."""
        parts = (f"= slowest group {max(self.group_time_s):.4g} s + gradient sync across groups {self.sync_s:.3g} s")
        bound = (f"bound of the linear pricing: at least {self.lower_bound_s:.4g} s for any grouping priced so "
                 f"(gap {self.gap_to_bound:.2f}x)")
        if not self.scored:
            return [f"  step (priced, linear) {self.step_time_s:.4g} s {parts}; the per-step mode: the cost model "
                    "scores no pass", f"  {bound}"]
        below = self.step_time_s < self.lower_bound_s
        return [f"  step (cost model, each pass scored) {self.step_time_s:.4g} s {parts}",
                f"  step (priced, linear) {self.model_step_time_s:.4g} s, as the search ranked the groupings",
                f"  {bound}" + ("; the scored step is below it: the bound holds for the linear pricing only"
                                if below else "")]

    def _why(self) -> str:
        """One line on why this many groups: the best step the search priced with the nearest fewer and more groups
        (empty when the search priced no other count)."""
        n = len(self.groups)
        fewer = [a for a in self.alternatives if a[0] < n and math.isfinite(a[1])]
        more = [a for a in self.alternatives if a[0] > n and math.isfinite(a[1])]
        parts = [f"with {k} group{'s' if k != 1 else ''} {t:.4g} s ({'scored' if e else 'priced'})"
                 for k, t, e in (fewer[-1:] + more[:1])]
        if not parts:
            return ""
        return (f"  why {n} group{'s' if n != 1 else ''}: the best step found {' and '.join(parts)}, against "
                f"{self.step_time_s:.4g} s {'scored' if self.scored else 'priced'} (fewer groups spread each "
                "sequence over more devices; more groups pay more gradient sync and hold fewer devices each)")

    def __repr__(self):
        return (f"BatchPlan(groups={len(self.groups)}, sequences={len(self.lengths)}, "
                f"step_time_s={self.step_time_s:.4g}, lower_bound_s={self.lower_bound_s:.4g})")


def _index(i, count) -> bool:
    """Whether i is an index in [0, count) (an int, not a bool: no negative indexing from the end)."""
    return not isinstance(i, bool) and isinstance(i, (int, np.integer)) and 0 <= i < count
