"""A plan as the runtime runs it: plain data, resolved when the plan is made, with nothing of the planner.

A step is groups of devices x passes: each group runs its passes one after another, each pass one packed sequence
(its sequences laid end to end, each a document) under its own resolved layout. A plan of one sequence over every
device is the one-group, one-pass case. The planner's plans give theirs as data (`Plan.schedule`,
`Plan.pass_layout`, `BatchPlan.schedule`); the runtime (hexiseq.nn's contexts, the batch runtime) reads only these,
so what runs is what was planned and a step never plans.

- PassLayout: one pass, over its group's devices numbered 0.. (rank r of the pass = slot `layout.device == r`): the
  layout (hexiseq.Layout: groups in ring order, token shares, head ranges, chunking), the kv heads each slot reads
  and first-holds (as the core computed them for the cost model), the attention's head counts, the sequence length
  and the plan's fingerprint. hexiseq.geometry turns it into positions and shards.
- Schedule: the step: its groups (cluster device ids), each group's passes (the step's sequence indices), the
  sequences' lengths and documents, each pass's PassLayout, and a fingerprint over all of it."""

import dataclasses
from typing import Optional, Tuple

import numpy as np

from . import geometry
from .errors import InvalidArgumentError

__all__ = ["PassLayout", "Schedule", "as_pass"]


@dataclasses.dataclass(frozen=True, eq=False)
class PassLayout:
    """One pass's resolved layout over `num_devices` devices (see the module's docstring). kv_lo, kv_count,
    first_lo, first_count: per layout slot, read-only int arrays. calibration: the cluster's calibration record
    (its block backends per device), or None."""

    num_devices: int
    seq_len: int
    heads: int
    kv_heads: int
    layout: object
    kv_lo: np.ndarray
    kv_count: np.ndarray
    first_lo: np.ndarray
    first_count: np.ndarray
    fingerprint: str
    calibration: Optional[dict] = None

    def positions(self, rank) -> np.ndarray:
        """The absolute positions rank `rank` of the pass holds, in the order of its shard."""
        return geometry.positions(self.layout, rank, self.num_devices)

    def tokens(self, rank) -> int:
        """How many of the pass's tokens rank `rank` holds."""
        return geometry.tokens(self.layout, rank, self.num_devices)

    def __repr__(self):
        return (f"PassLayout(devices={self.num_devices}, seq_len={self.seq_len}, "
                f"groups={self.layout.group_size.tolist()}, fingerprint={self.fingerprint!r})")


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A step (see the module's docstring). groups: each group's cluster devices, in increasing order; passes[g]:
    the sequences (indices into lengths) of each of group g's passes, in packed order; lengths: each sequence's
    tokens; documents: each sequence's document lengths, or None for one document; layouts[g][p]: the PassLayout
    of group g's pass p over the group's devices (pass rank i = cluster device groups[g][i]); job: what the plans
    of one job share (the cluster and the model, as text); fingerprint: a hash of all of it."""

    num_devices: int
    causal: bool
    groups: Tuple[Tuple[int, ...], ...]
    passes: Tuple[Tuple[Tuple[int, ...], ...], ...]
    lengths: Tuple[int, ...]
    documents: Tuple[Optional[Tuple[int, ...]], ...]
    layouts: Tuple[Tuple[PassLayout, ...], ...]
    job: str
    fingerprint: str

    def layout_of(self, g, p=0) -> PassLayout:
        """The PassLayout of group g's pass p."""
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or not 0 <= g < len(self.groups):
            raise InvalidArgumentError(f"g must be a group of the schedule, in [0, {len(self.groups)}), got {g!r}")
        count = len(self.passes[g])
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)) or not 0 <= p < count:
            raise InvalidArgumentError(f"group {g} makes {count} pass(es), got pass {p!r}")
        return self.layouts[g][p]

    def sequences_of(self, g) -> list:
        """The sequences group g runs, in batch order."""
        return sorted(i for ps in self.passes[g] for i in ps)

    def __repr__(self):
        return (f"Schedule(groups={len(self.groups)}, passes={sum(len(ps) for ps in self.passes)}, "
                f"sequences={len(self.lengths)}, fingerprint={self.fingerprint!r})")


def as_pass(plan, where: str = "plan") -> PassLayout:
    """The PassLayout a context runs: `plan` itself, or the one pass of a plan's schedule (or of a Schedule) of one
    group making one pass. Raises InvalidArgumentError naming `where` otherwise."""
    if isinstance(plan, PassLayout):
        return plan
    schedule = plan if isinstance(plan, Schedule) else getattr(plan, "schedule", None)
    if not isinstance(schedule, Schedule):
        raise InvalidArgumentError(f"{where} must be a hexiseq.Plan (or a hexiseq.schedule.PassLayout), got "
                                   f"{type(plan).__name__}")
    if len(schedule.groups) == 1 and len(schedule.passes[0]) == 1:
        return schedule.layouts[0][0]
    groups, passes = len(schedule.groups), sum(len(ps) for ps in schedule.passes)
    raise InvalidArgumentError(f"{where} runs one layout; this plan runs {groups} group{'s' if groups != 1 else ''} "
                               f"of devices making {passes} pass{'es' if passes != 1 else ''}: run it with "
                               "hexiseq.nn.BatchContext (one pass after another on each group), or plan with "
                               "batch=False for one layout over every device")
