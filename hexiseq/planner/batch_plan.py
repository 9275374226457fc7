"""A plan of several groups (hexiseq.planner.batch): one training step's sequences assigned to groups of devices,
each group's passes and their plans, and the predicted figures. Made by hexiseq.planner.batch.BatchPlanner and by
hexiseq.plan when groups are faster.

A BatchPlan is a hexiseq.Plan: the one type a plan has, a step as groups x passes. What a plan of one layout
answers about that layout (its device table, positions, shards, re-balancing, plot) is asked of one pass here:
`plan.plan_for(g, p)`; asked of the whole step it raises NotOneLayoutError, which names the pass to ask."""

import dataclasses
import functools
import hashlib
import json
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from .._validate import integer, integers, number
from ..errors import InternalError, InvalidArgumentError
from ..schedule import PassLayout, Schedule
from . import floor
from .cluster import Cluster
from .model import Model, Training
from .plan import PLAN_FORMAT_VERSION, Layout, Plan


class NotOneLayoutError(InvalidArgumentError, AttributeError):
    """A question about one layout asked of a plan of several groups or passes. Also an AttributeError, so that
    hasattr(plan, "layout") is False for such a plan."""


# What a plan of one layout answers about it, which a plan of several groups answers per pass (plan_for(g, p))
ONE_LAYOUT = ("layout", "devices", "seq_len", "strategy", "num_groups", "phases", "fits", "state_shares",
              "memory_features", "group_positions", "group_chunks", "rebalanced", "group_of", "device_row",
              "positions", "shard", "unshard", "table", "_slot", "_identity")


@dataclasses.dataclass(frozen=True)
class BatchPlan(Plan):
    """A step's sequences assigned to groups of devices (see hexiseq.planner.batch); a hexiseq.Plan of several
    groups (or passes). Every time is a prediction.

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
    groups: Tuple[Tuple[int, ...], ...] = dataclasses.field()  # a field, not Plan's one-group answer
    assignment: Tuple[int, ...] = dataclasses.field()
    lengths: Tuple[int, ...] = dataclasses.field()
    documents: Tuple[Optional[Tuple[int, ...]], ...]
    group_time_s: Tuple[float, ...] = dataclasses.field()
    sync_s: float = dataclasses.field()
    step_time_s: float = dataclasses.field()
    lower_bound_s: float = dataclasses.field()
    candidates: int
    solve_s: float
    exact_assignment: bool
    passes: Tuple[Tuple[Tuple[int, ...], ...], ...] = dataclasses.field()
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

    @property
    def compute_floor_s(self) -> float:
        """The step's model FLOPs (every sequence, its documents' mask) at the devices' catalog matmul and attention
        rates, nothing else paid (hexiseq.planner.floor): no plan of any parallelism is below it, unlike
        lower_bound_s, which bounds the search's linear pricing only."""
        docs = [list(d) if d is not None else [n] for n, d in zip(self.lengths, self.documents)]
        return floor.compute_floor_s(self.cluster, self.model, 0, 0, self.causal, docs)

    def split_batch(self, batch: Sequence, dim: int = 0) -> list:
        """The caller's batch (one token tensor per sequence, its tokens along `dim`) as the plan's sequences: with
        split_documents each document of a packed sequence is a sequence of the plan, cut out of its own at its
        boundaries; else the batch as it is. What BatchContext's passes take."""
        wants = self._caller_lengths()
        if isinstance(batch, (str, bytes, dict)) or not hasattr(batch, "__len__") or len(batch) != len(wants):
            got = len(batch) if hasattr(batch, "__len__") and not isinstance(batch, (str, bytes, dict)) else \
                type(batch).__name__
            raise InvalidArgumentError(f"batch must hold the {len(wants)} sequence(s) the plan was made for, one "
                                       f"tensor each, got {got}")
        for i, (x, want) in enumerate(zip(batch, wants)):
            shape = getattr(x, "shape", None)
            if shape is None or isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
                raise InvalidArgumentError(f"batch[{i}] must be a tensor or array with a dimension {dim!r} (its "
                                           f"tokens), got {type(x).__name__}"
                                           + (f" of shape {tuple(shape)}" if shape is not None else ""))
            if int(shape[dim]) != want:
                raise InvalidArgumentError(f"batch[{i}] holds {int(shape[dim])} tokens along dim {dim}; the plan was "
                                           f"made for {want}")
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
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or \
                len(values) != len(self.lengths):
            got = len(values) if hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict)) else \
                type(values).__name__
            raise InvalidArgumentError(f"values must hold one figure per sequence of the plan ({len(self.lengths)}, "
                                       f"in plan order), got {got}")
        if self.origin is None:
            return list(values)
        out = [None] * (max(i for i, _ in self.origin) + 1)
        for (i, _), v in zip(self.origin, values):
            out[i] = v if out[i] is None else out[i] + v
        return out

    def _caller_lengths(self) -> List[int]:
        """The tokens of each sequence of the caller's batch: the plan's own, or with split_documents the sum of the
        documents each was split into."""
        if self.origin is None:
            return list(self.lengths)
        out = [0] * (max(i for i, _ in self.origin) + 1)
        for (i, _), n in zip(self.origin, self.lengths):
            out[i] += n
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

    @property
    def pass_layout(self) -> PassLayout:
        """The one pass's layout as plain data, for a plan of one group and one pass; else NotOneLayoutError."""
        return self.one_layout("pass_layout").pass_layout

    def one_layout(self, where: str = "this call") -> Plan:
        """The plan of the step's one layout when the step is one group making one pass; else NotOneLayoutError
        naming `where` and the door that runs a step of several groups or passes (hexiseq.nn.BatchContext)."""
        if len(self.groups) == 1 and len(self.passes[0]) == 1:
            return self.pass_plans[0][0]
        raise NotOneLayoutError(
            f"{where} runs one layout; this plan runs {self._shape()}: run it with hexiseq.nn.BatchContext "
            "(one pass after another on each group), or plan with batch=False for one layout over every device")

    def _shape(self) -> str:
        n, p = len(self.groups), sum(len(ps) for ps in self.passes)
        return f"{n} group{'s' if n != 1 else ''} of devices making {p} pass{'es' if p != 1 else ''}"

    def to_json(self, indent: Optional[int] = None) -> str:
        """JSON of everything needed to rebuild the plan without planning again (the cluster, model and training,
        the groups, passes and batch, and every pass's layout), plus its predictions, as for a plan of one layout:
        the same format ("hexiseq-plan"), read by hexiseq.Plan.from_json. Each pass is priced again on load (its
        fingerprint must match); the step's figures are the planner's, as written."""
        clusters, refs = [], []
        for g, plans in enumerate(self.pass_plans):
            row = []
            for p in plans:
                c = p.cluster.to_dict()
                if c not in clusters:
                    clusters.append(c)
                row.append({"cluster": clusters.index(c), "training": p.training.to_dict(), "strategy": p.strategy,
                            "seq_len": p.seq_len, "layout": p.layout.to_dict(),
                            **({"documents": p.documents.tolist()} if p.documents is not None else {})})
            refs.append(row)
        summary = self.to_dict()
        summary["predicted"]["model_group_time_s"] = list(self.model_group_time_s)
        summary["predicted"]["searched_s"] = None if math.isnan(self.searched_s) else self.searched_s
        for a in summary["alternatives"]:  # a count of groups whose cuts held no batch: no step
            a["step_time_s"] = a["step_time_s"] if math.isfinite(a["step_time_s"]) else None
        doc = {"format": "hexiseq-plan", "format_version": PLAN_FORMAT_VERSION, "hexiseq_version": _core.VERSION,
               "cluster": self.cluster.to_dict(), "model": self.model.to_dict(),
               "training": self.training.to_dict(), "causal": self.causal, **summary,
               "capacity": list(self.capacity), "exact_assignment": self.exact_assignment,
               "pass_clusters": clusters, "pass_plans": refs, "fingerprint": self.fingerprint}
        try:
            return json.dumps(doc, indent=indent, allow_nan=False)
        except ValueError as e:  # a prediction the planner should never give
            raise InternalError(f"plan has a non-finite figure, cannot be written as JSON: {e}") from None

    @classmethod
    def reads(cls, doc: dict) -> bool:
        return "groups" in doc

    @classmethod
    def from_doc(cls, doc: dict) -> "BatchPlan":
        """The plan a to_json document (already parsed, its format checked) describes; see hexiseq.Plan.from_json."""
        need = ("cluster", "model", "training", "causal", "groups", "assignment", "passes", "lengths", "documents",
                "predicted", "capacity", "pass_clusters", "pass_plans")
        missing = [k for k in need if k not in doc]
        if missing:
            raise InvalidArgumentError(f"not a plan of several groups: missing field(s) {missing}")
        cluster, model = Cluster.from_dict(doc["cluster"]), Model.from_dict(doc["model"])
        training = Training.from_dict(doc["training"])
        causal = _flag(doc["causal"], "causal")
        groups = _lists(doc["groups"], "groups", 0, cluster.num_devices - 1)
        if sorted(d for g in groups for d in g) != list(range(cluster.num_devices)):
            raise InvalidArgumentError(f"plan groups must hold each of the cluster's {cluster.num_devices} devices "
                                       f"once, got {groups}")
        lengths = integers(doc["lengths"], "lengths", 1)
        n = len(lengths)
        assignment = integers(doc["assignment"], "assignment", 0, len(groups) - 1)
        passes = doc["passes"]
        if not isinstance(passes, list) or len(passes) != len(groups):
            raise InvalidArgumentError(f"plan passes must list each of its {len(groups)} groups' passes")
        passes = [_lists(ps, f"passes[{g}]", 0, n - 1) for g, ps in enumerate(passes)]
        if len(assignment) != n or sorted(i for ps in passes for p in ps for i in p) != list(range(n)) or any(
                assignment[i] != g for g, ps in enumerate(passes) for p in ps for i in p):
            raise InvalidArgumentError("plan passes and assignment must place each sequence in one pass of its group")
        documents = doc["documents"]
        if not isinstance(documents, list) or len(documents) != n:
            raise InvalidArgumentError(f"plan documents must hold one entry per sequence ({n})")
        documents = [None if d is None else integers(d, f"documents[{i}]", 1) for i, d in enumerate(documents)]
        clusters = [Cluster.from_dict(c) for c in _list(doc["pass_clusters"], "pass_clusters")]
        refs = doc["pass_plans"]
        if not isinstance(refs, list) or [len(r) if isinstance(r, list) else -1 for r in refs] != \
                [len(ps) for ps in passes]:
            raise InvalidArgumentError("plan pass_plans must hold one plan per pass of each group")
        pass_plans = []
        for g, row in enumerate(refs):
            made = []
            for j, ref in enumerate(row):
                where = f"pass_plans[{g}][{j}]"
                if not isinstance(ref, dict) or any(k not in ref for k in ("cluster", "training", "strategy",
                                                                           "seq_len", "layout")):
                    raise InvalidArgumentError(f"{where} must hold cluster, training, strategy, seq_len and layout")
                c = integer(ref["cluster"], f"{where}.cluster", 0, len(clusters) - 1)
                if clusters[c].num_devices != len(groups[g]):
                    raise InvalidArgumentError(f"{where} is a plan of {clusters[c].num_devices} devices; group {g} "
                                               f"has {len(groups[g])}")
                if not isinstance(ref["strategy"], str):
                    raise InvalidArgumentError(f"{where}.strategy must be a string, got {ref['strategy']!r}")
                seq_len = integer(ref["seq_len"], f"{where}.seq_len", 1)
                if seq_len != sum(lengths[i] for i in passes[g][j]):
                    raise InvalidArgumentError(f"{where}.seq_len is {seq_len}; its pass holds "
                                               f"{sum(lengths[i] for i in passes[g][j])} tokens")
                made.append(Plan(clusters[c], model, Training.from_dict(ref["training"]), seq_len, causal,
                                 ref["strategy"], Layout.from_dict(ref["layout"]), documents=ref.get("documents")))
            pass_plans.append(tuple(made))
        predicted = doc["predicted"]
        if not isinstance(predicted, dict):
            raise InvalidArgumentError(f"plan predicted must be an object, got {predicted!r}")
        group_time = _times(predicted.get("group_time_s"), "predicted.group_time_s", len(groups))
        model_time = _times(predicted.get("model_group_time_s", group_time), "predicted.model_group_time_s",
                            len(groups))
        sync, bound = (_times([predicted.get(k)], f"predicted.{k}", 1)[0] for k in ("sync_s", "lower_bound_s"))
        searched = predicted.get("searched_s")
        searched = math.nan if searched is None else _times([searched], "predicted.searched_s", 1)[0]
        origin = doc.get("origin")
        if origin is not None:
            origin = tuple(tuple(o) for o in _lists(origin, "origin", 0))
            if len(origin) != n or any(len(o) != 2 for o in origin):
                raise InvalidArgumentError(f"plan origin must hold (sequence, document) of each of its {n} sequences")
        alternatives = []
        for i, a in enumerate(_list(doc.get("alternatives", []), "alternatives")):
            if not isinstance(a, dict) or any(k not in a for k in ("groups", "step_time_s", "scored")):
                raise InvalidArgumentError(f"plan alternatives[{i}] must hold groups, step_time_s and scored")
            t = a["step_time_s"]
            alternatives.append((integer(a["groups"], f"alternatives[{i}].groups", 1),
                                 math.inf if t is None else float(t), _flag(a["scored"], f"alternatives[{i}].scored")))
        capacity = integers(doc["capacity"], "capacity", 1)
        if len(capacity) != len(groups):
            raise InvalidArgumentError(f"plan capacity must hold one entry per group ({len(groups)})")
        out = cls(cluster, model, training, causal, tuple(tuple(g) for g in groups), tuple(assignment),
                  tuple(lengths), tuple(None if d is None else tuple(d) for d in documents), tuple(group_time), sync,
                  max(group_time) + sync, bound, integer(doc.get("candidates", 0), "candidates", 0),
                  _times([doc.get("solve_s", 0.0)], "solve_s", 1)[0],
                  _flag(doc.get("exact_assignment", False), "exact_assignment"),
                  tuple(tuple(tuple(p) for p in ps) for ps in passes), tuple(capacity), tuple(model_time), searched,
                  tuple(pass_plans), tuple(alternatives), origin, _flag(doc.get("stopped_early", False),
                                                                        "stopped_early"),
                  _flag(doc.get("scored", True), "scored"))
        if "fingerprint" in doc and doc["fingerprint"] != out.fingerprint:
            raise InvalidArgumentError(f"plan fingerprint mismatch: file says {doc['fingerprint']}, "
                                       f"contents hash to {out.fingerprint}")
        return out

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


def _one_layout_only(name):
    def refuse(self):
        raise NotOneLayoutError(f"plan.{name} is of one layout; this plan runs {self._shape()}: ask one pass, "
                                f"plan.plan_for(g, p).{name}")
    return property(refuse)


for _name in ONE_LAYOUT:
    setattr(BatchPlan, _name, _one_layout_only(_name))


def _flag(value, field) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"plan {field} must be true or false, got {value!r}")
    return value


def _list(value, field) -> list:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"plan {field} must be a list, got {type(value).__name__}")
    return value


def _lists(value, field, lo, hi=None) -> list:
    """A list of lists of integers in [lo, hi]."""
    return [integers(v, f"{field}[{i}]", lo, hi) for i, v in enumerate(_list(value, field))]


def _times(value, field, count) -> list:
    """`count` finite non-negative seconds."""
    if not isinstance(value, list) or len(value) != count:
        raise InvalidArgumentError(f"plan {field} must hold {count} figure(s), got {value!r}")
    out = []
    for v in value:
        v = number(v, field)
        if v < 0:
            raise InvalidArgumentError(f"plan {field} must be >= 0, got {v}")
        out.append(v)
    return out


def _index(i, count) -> bool:
    """Whether i is an index in [0, count) (an int, not a bool: no negative indexing from the end)."""
    return not isinstance(i, bool) and isinstance(i, (int, np.integer)) and 0 <= i < count
