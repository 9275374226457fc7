"""Uneven sharding of the model states (ZeRO-3 with unequal shares), for plans whose devices differ in memory.

FSDP and DeepSpeed give every rank 1/N of the parameters, gradients and optimizer states; a plan from
`hexiseq.plan` may instead give each device a share proportional to its free memory (`plan.state_shares`).
`shard_states(model, plan)` realises such a plan over torch.distributed. At even shares it hands the model to
torch's FSDP2 (hexiseq.runtime.fsdp2 says why); what follows is hexiseq's own engine, for unequal shares (or any,
with engine="hexiseq"):

- The parameters are grouped in units (by default the elements of the model's outermost `nn.ModuleList`s, e.g.
  the decoder layers, plus one root unit of every other parameter). A unit's parameters are flattened into one
  vector of T elements; rank r keeps the contiguous slice [off_r, off_r + n_r), n_r from its share by largest
  remainder, as an `nn.Parameter` registered on the unit's module under the name `hexiseq_shard`. The original
  parameters leave the module, so `model.parameters()` yields the local shards and an optimizer built afterwards
  keeps optimizer states for the local shards only: the uneven optimizer-state memory.
- Before a unit's forward, its flat vector is all-gathered and its parameters are set as views of it (plain
  tensor attributes). After the forward the views are dropped; what autograd saved of them is kept as a small
  marker (saved-tensor hooks) and gathered again, once per unit, when the backward needs it. So a unit's full
  parameters live only while its forward or its backward runs, never in between.
- The backward of the gather reduces the unit's full gradient to its owners (a padded reduce-scatter), divided
  by the group size for reduce="mean" (FSDP's semantics: the mean of the ranks' gradients), not for "sum".
- Overlap (_Comm): from the second step on, each unit's gather posts the next unit's (in the order the last step
  gathered them) before waiting for its own, and the reductions are posted in the backward and waited for at its
  end, where the shards' gradients are set. Besides the units whose forward encloses others' (the root), at
  most two are gathered at once, as in FSDP2.
- A parameter that gets no gradient in a step is part of its unit's flat shard, which gets a gradient: its part
  is zero, and the optimizer updates it as it updates a parameter with a zero gradient (momentum and weight decay
  move it), as FSDP's flat parameters of old did; torch (a plain module, FSDP2) skips such a parameter.
- Gradient clipping must see the whole gradient: `clip_grad_norm_(module, max_norm)` here (torch's function on
  the shards would clip every rank by its own shard's norm).

Cost: collectives padded to the largest shard, N x max share times an even collective's bytes (1.5x for shares
[0.5, 0.3, 0.2]); two gathers and one reduction per unit and step, as in ZeRO-3 (docs/runtime.md).

What a user must not do (the ranks would meet in different collectives and hang until the group's timeout, or
compute wrong gradients):
- run a unit on some ranks only, or a different number of times, or in a different order, or run the backward
  through a unit on some ranks only: every gather and every reduction is a collective of the whole group.
  Autograd runs the same graph in the same order on every rank;
- use a unit's parameters outside its forward (between forwards they are placeholders on the meta device), or
  call `unit.forward(...)` directly (the gather runs in the module's forward hooks, i.e. through `unit(...)`);
- change the shards between a forward and its backward (raises, as autograd does for in-place changes);
- move the model to another device or dtype after sharding, or build the optimizer before sharding;
- read saved tensors by hand (`grad_fn._saved_*`): each read is a gather;
- ask for the shards' gradients with torch.autograd.grad, or hook their gradient accumulation: the shards'
  gradients are set when a backward ends (.backward(), as FSDP sets them), not passed through autograd.
Ranks must shard (and load with `load_full_state_dict`) the same weights: both compare a digest of sampled
elements of every parameter (_digests) and refuse, on every rank alike, weights that differ between ranks.
Activation checkpointing (torch.utils.checkpoint, reentrant or not) around units works on this engine: the
recomputation gathers again by itself (under FSDP2, at even shares, FSDP2's limits: see hexiseq.runtime.fsdp2).
Other saved-tensor hooks active around a unit (e.g. save_on_cpu) take precedence.
"""

import math
import weakref
from fractions import Fraction

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .._validate import number
from . import fsdp2, wire
from .comm import agree, collective_device, resolve_group, text_code
from .replicas import ReplicaSync, check_replicas
from ..errors import InvalidArgumentError
from .fsdp2 import sum_fsdp2_gradients

__all__ = ["shard_states", "sync_replicas", "full_state_dict", "load_full_state_dict", "shard_sizes",
           "sum_fsdp2_gradients", "clip_grad_norm_"]

SHARD_NAME = "hexiseq_shard"
REDUCES = ("mean", "sum")
ENGINES = ("auto", "hexiseq", "fsdp2")  # "auto": FSDP2 at even shares where torch has it, else hexiseq's own
SEQUENCE_LIMIT = 1 << 14  # gathers a step's sequence keeps per phase (a loop of forwards without a backward)
SHARE_TOLERANCE = 1e-9

# Gathered flat vectors whose unit's forward is running, by storage address: what the pack hook turns into
# markers. A weak set of every gathered vector still alive, for tests that check what outlives a forward.
_active = {}
_gathered = weakref.WeakSet()
# Tests switch this off to show that without the saved-tensor hooks the gathered parameters outlive the forward.
_free_after_forward = True


def shard_sizes(shares, total):
    """Elements of a flat vector of `total` per rank: the floor of each rank's exact quota share * total, and the
    leftover elements one each to the largest remainders (ties to the lower rank). Exact rational arithmetic on
    the float shares, so every rank computes the same sizes and they sum to `total`; a zero share gets nothing."""
    exact = [Fraction(s) for s in shares]
    whole = sum(exact)
    quotas = [q * total / whole for q in exact]
    sizes = [math.floor(q) for q in quotas]
    order = sorted(range(len(sizes)), key=lambda r: (sizes[r] - quotas[r], r))
    for r in order[:total - sum(sizes)]:
        sizes[r] += 1
    return sizes


def _check_shares(shares, world, replicas=None):
    """The shares as a list of floats; InvalidArgumentError naming the argument and the value otherwise. "even":
    equal shares over the group, or within each replica."""
    if isinstance(shares, str) and shares == "even":
        return [1.0 / len(ranks) for r in range(world) for ranks in (replicas or (range(world),)) if r in ranks]
    if isinstance(shares, torch.Tensor):
        shares = shares.tolist()
    elif isinstance(shares, np.ndarray):
        shares = shares.tolist()
    if isinstance(shares, (str, bytes, dict)) or not isinstance(shares, (list, tuple)):
        raise InvalidArgumentError(f"shares must be a list of floats, one per rank, \"even\", or a plan with "
                                   f"state_shares; got {shares!r}")
    if len(shares) != world:
        raise InvalidArgumentError(f"shares must hold one share per rank of the group ({world}), got {len(shares)}: "
                                   f"{list(shares)!r}")
    out = [number(s, f"shares[{i}]") for i, s in enumerate(shares)]
    for i, s in enumerate(out):
        if s < 0:
            raise InvalidArgumentError(f"shares[{i}] must be >= 0, got {s!r}")
    for j, ranks in enumerate(replicas or (range(world),)):  # each replica holds a whole copy of the states
        total = math.fsum(out[r] for r in ranks)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            if replicas is None:
                raise InvalidArgumentError(f"shares must sum to 1 (within {SHARE_TOLERANCE:g}), got {out!r} "
                                           f"(sum {total!r})")
            raise InvalidArgumentError(f"the shares of replicas[{j}] (ranks {list(ranks)}) must sum to 1 (within "
                                       f"{SHARE_TOLERANCE:g}): each replica holds a whole copy of the states; got "
                                       f"{[out[r] for r in ranks]!r} (sum {total!r})")
    return out


# ------------------------------------------------------------------------------------------------ units

class _Param:
    """One original parameter of a unit: where it sits in the flat vector, and every (module, name) it was
    registered under (more than one when it is tied inside the unit)."""

    def __init__(self, names, shape, offset):
        self.names = names
        self.shape = shape
        self.numel = math.prod(shape)
        self.offset = offset
        self.places = []  # (owner module, attribute name)


class _Saved:
    """What the pack hook keeps instead of a saved view of a unit's gathered parameters."""

    __slots__ = ("unit", "version", "size", "stride", "offset")

    def __init__(self, unit, t):
        self.unit, self.version = unit, unit.shard._version
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _storage_key(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse tensors, tensor subclasses without storage
        return None


def _pack(t):
    unit = _active.get(_storage_key(t))
    if unit is None:
        # kept as autograd would keep it (detached, so the packed value does not point back at t), with its
        # version: autograd skips its in-place check for tensors that went through hooks, so we make it
        return t.detach(), t._version
    return _Saved(unit, t)


def _unpack(saved):
    if isinstance(saved, _Saved):
        return saved.unit.saved_view(saved)
    t, version = saved
    if t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: a {t.dtype} tensor of shape {list(t.shape)} is at version {t._version}, "
                           f"it was saved at version {version}")
    return t


def _top_hooks():
    # Where torch lacks this query (older releases) our hooks are always pushed: a non-reentrant checkpoint
    # inside a unit then keeps its activations (correct gradients, no memory saved).
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _in_backward():
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _should_push_hooks():
    """Push our saved-tensor hooks around a unit's forward only when nothing else decides what is saved: not
    when our hooks are already on top (an outer unit's: they cover every active unit), nor under someone else's
    (a non-reentrant checkpoint discards what is saved and recomputes, gathering again; save_on_cpu copies),
    nor inside a backward (a reentrant checkpoint's recomputation, whose saved tensors are used at once)."""
    if not _free_after_forward or not torch.is_grad_enabled() or _in_backward():
        return False
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return False
    return _top_hooks() is None


class _Gather(torch.autograd.Function):
    """shard -> the unit's parameters, as views of its gathered flat vector; the backward writes their gradients
    into one flat gradient and reduces it to the shard owners.

    One output per parameter, not the flat vector: autograd would take each view's gradient back to the flat
    vector through its own slice backward, a zeroed vector of the unit's full size per parameter, summed; one
    copy per gradient into a flat buffer is all the reduction needs (a backward of 1.3x FSDP2's became 1.0x)."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        unit.flat = flat = unit.gather(ahead=True)
        return tuple(unit.views(flat))

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        # every node that used this call's views has run: what the backward gathered for them can go
        unit.backward_flat = None
        # the reduction is posted, not waited for: the shard's gradient is set when the backward ends
        unit.comm.reduce_later(unit, unit.flat_grad(grads))
        return None, None


class _Unit:
    """A group of parameters gathered together: the flat layout, this rank's shard, the forward hooks."""

    def __init__(self, index, module, name, params, comm):
        self.index, self.module, self.name, self.params = index, module, name, params
        self.comm = comm
        first = params[0][1]
        self.dtype, self.device, self.requires_grad = first.dtype, first.device, first.requires_grad
        self.total = sum(p.numel() for _, p in params)
        self.shard = None
        self.flat = None
        self.backward_flat = None
        self.pushed = []

    def check(self):
        """A message when the unit cannot be flattened into one vector, else None."""
        for kind, get in (("dtype", lambda p: p.dtype), ("device", lambda p: p.device),
                          ("requires_grad", lambda p: p.requires_grad)):
            seen = {}
            for names, p in self.params:
                seen.setdefault(get(p), names[0])
            if len(seen) > 1:
                shown = ", ".join(f"{n} {v}" for v, n in seen.items())
                return (f"the parameters of unit {self.name or '<root>'} differ in {kind} ({shown}); a unit is "
                        "flattened into one vector: pass units that separate them")
        if not self.dtype.is_floating_point:
            return f"unit {self.name or '<root>'} holds {self.dtype} parameters; only floating point ones shard"
        return None

    def describe(self):
        names = ";".join(f"{names[0]}{list(p.shape)}" for names, p in self.params)
        return [self.total, wire.code(wire.DTYPES, self.dtype), int(self.requires_grad), len(self.params),
                text_code(names)]

    def lay_out(self):
        """Where each parameter sits in the unit's flat vector (the names and shapes the state dicts and
        checkpoints of either engine go by)."""
        self.layout, offset = [], 0
        for names, p in self.params:
            self.layout.append(_Param(names, tuple(p.shape), offset))
            offset += self.layout[-1].numel

    def build(self, sizes, rank):
        """Cut this rank's shard out of the parameters and take the originals off their modules."""
        self.sizes = sizes
        self.offsets = [sum(sizes[:r]) for r in range(len(sizes))]
        self.width = max(sizes)
        self.rank = rank
        self.lay_out()
        lo, n = self.offsets[rank], sizes[rank]
        pieces = []
        for entry, (_, p) in zip(self.layout, self.params):
            a, b = max(lo, entry.offset), min(lo + n, entry.offset + entry.numel)
            if a < b:
                pieces.append(p.detach().reshape(-1)[a - entry.offset:b - entry.offset])
        with torch.no_grad():
            data = torch.cat(pieces) if pieces else torch.empty(0, dtype=self.dtype, device=self.device)
            self.shard = nn.Parameter(data.clone(), requires_grad=self.requires_grad)
        self.module.register_parameter(SHARD_NAME, self.shard)

    def place(self, places):
        """Replace the original parameters with placeholders: meta tensors of the original shape and dtype, so a
        use outside the unit's forward fails loudly instead of reading stale values."""
        for entry, owners in zip(self.layout, places):
            entry.places = owners
            for owner, attr in owners:
                owner._parameters.pop(attr, None)
        self._set_views(None)

    def views(self, flat):
        """The unit's parameters as views of its flat vector, one per layout entry."""
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.layout]

    def _set_views(self, views):
        for i, entry in enumerate(self.layout):
            t = torch.empty(entry.shape, dtype=self.dtype, device="meta") if views is None else views[i]
            for owner, attr in entry.places:
                owner.__dict__[attr] = t  # a plain attribute, as nn.Module keeps non-parameter values

    def flat_grad(self, grads):
        """The parameters' gradients as one flat vector (zeros for a parameter the step did not use)."""
        if len(grads) == 1 and grads[0] is not None:
            return grads[0].reshape(-1)
        unused = any(g is None for g in grads)
        out = (torch.zeros if unused else torch.empty)(self.total, dtype=self.dtype, device=self.device)
        for entry, g in zip(self.layout, grads):
            if g is not None:
                out[entry.offset:entry.offset + entry.numel].view(entry.shape).copy_(g)
        return out

    # -------------------------------------------------------------------------------------- collectives

    def gather(self, ahead=False):
        """The unit's full flat vector: every rank sends its shard padded to the widest, one all-gather of
        N x width, then the real elements are copied out in rank order (no copy when the shards are even).
        ahead: also post the gather of the unit expected next (see _Comm.gathered)."""
        with torch.no_grad():
            flat = self.comm.gathered(self, ahead)
        _gathered.add(flat)
        return flat

    def post_gather(self):
        """Post this unit's all-gather: (unit, work to wait for or None, receive buffer, the shard's version)."""
        shard = self.shard.detach()
        if self.width == 0:
            return self, None, shard.new_empty(0), self.shard._version
        send = shard if shard.numel() == self.width else torch.cat([shard, shard.new_zeros(self.width -
                                                                                            shard.numel())])
        recv = shard.new_empty(len(self.sizes) * self.width)
        return self, self.comm.all_gather(recv, send), recv, self.shard._version

    def unpad(self, recv):
        if all(n == self.width for n in self.sizes):
            return recv
        return torch.cat([recv[r * self.width:r * self.width + n] for r, n in enumerate(self.sizes)])

    # -------------------------------------------------------------------------------------- hooks

    def before(self, module, args):
        if torch.is_grad_enabled() and self.shard.requires_grad:
            views = _Gather.apply(self.shard, self)  # sets self.flat
        else:
            self.flat = self.gather(ahead=True)
            views = self.views(self.flat)
        if self.flat.numel():
            _active[_storage_key(self.flat)] = self
        self._set_views(views)
        push = _should_push_hooks()
        if push:
            torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
        self.pushed.append(push)

    def after(self, module, args, output):
        # runs even when the forward raised (always_call): a checkpoint's recomputation stops early that way
        if self.pushed and self.pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if self.flat is not None and self.flat.numel():
            _active.pop(_storage_key(self.flat), None)
        self.flat = None
        self._set_views(None)

    def saved_view(self, saved):
        """A saved view of the gathered parameters, for the backward: gathered again once per unit per backward
        (kept until the unit's gather node has run, or the backward ends)."""
        if self.shard._version != saved.version:
            raise RuntimeError(f"the shard of unit {self.name or '<root>'} was modified between the forward and "
                               "the backward (an optimizer step or an in-place change): its gradients would be "
                               "computed with other parameters than the forward's")
        flat = self.backward_flat
        if flat is None:
            flat = self.gather(ahead=True)
            if _in_backward():
                self.backward_flat = flat
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return flat.as_strided(saved.size, saved.stride, saved.offset)

    def _end_of_backward(self):
        self.backward_flat = None


class _Comm:
    """The collectives of a sharded module over `group`, and what they overlap with.

    Gathers: the sequence in which the units gather, in the forward and in the backward, is learnt from the
    last step (a step ends at the first forward gather after a backward; the backward's order is not simply the
    forward's reversed when a unit encloses others, as the root unit does). A unit's gather posts the gather of
    the unit expected next before waiting for its own, so that one overlaps this unit's compute; at most one is
    posted ahead, and one that does not come next (the order changed) is waited for and dropped.
    Reductions: each unit's gradient reduce-scatter is posted in the backward and waited for when the backward
    ends, where the shards' gradients are set (added to any already there). Every rank learns the same order and
    posts the same collectives, as the contract of use requires of the units' calls.
    Backends without the single-tensor collectives (Gloo in older torch) fall back to the list all-gather and an
    all-reduce of the whole gradient, both waited for at once."""

    def __init__(self, group, reduce, divisor=None):
        self.group, self.reduce = group, reduce
        self.world = dist.get_world_size(group)
        self.divisor = divisor or self.world  # of reduce="mean": the ranks whose gradients are summed in the end
        self._gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.single_gather = self.single_reduce = True
        self.orders = ([], [])  # the units in the order they gathered, forward and backward: the last step's
        self.seen = ([], [])  # this step's
        self.cursor = [0, 0]  # where this step stands in the last one's, per phase
        self.ahead = None  # a gather posted ahead (see _Unit.post_gather)
        self.taken = self.dropped = 0  # gathers posted ahead that a unit took, and that none took
        self.pending = []  # posted reductions: (unit, work or None, this rank's slice, buffers kept until done)
        self.flush_queued = False
        self.units = []

    def probe(self, device, dtype):
        """Whether the backend has the single-tensor collectives: a backend without one refuses it on every
        rank before communicating, so every rank comes to the same answer."""
        x = torch.zeros(self.world, dtype=dtype, device=device)
        self.single_gather = _supported(lambda: self._gather_single(x, x[:1].clone(), group=self.group))
        self.single_reduce = _supported(lambda: self._rs_single(x[:1].clone(), x, group=self.group))

    def all_gather(self, recv, send):
        """Post the all-gather of `send` into `recv`: its work, or None when it is done already."""
        if self.single_gather:
            return self._gather_single(recv, send, group=self.group, async_op=True)
        parts = list(recv.chunk(self.world))  # the list form: the same bytes on the wire, one more copy
        dist.all_gather(parts, send, group=self.group)
        return None

    def gathered(self, unit, ahead):
        """`unit`'s flat vector: the gather posted ahead for it (when its shard has not changed since), else one
        posted now; with `ahead`, the next unit's gather is posted before this one is waited for."""
        if (self.pending or self.flush_queued) and not _in_backward():
            self.abandon()
        posted, self.ahead = self.ahead, None
        if posted is not None and (posted[0] is not unit or posted[3] != unit.shard._version):
            _wait(posted[1])  # not the one expected, or stale: every rank drops it alike
            posted = None
            self.dropped += 1
        elif posted is not None:
            self.taken += 1
        if posted is None:
            posted = unit.post_gather()
        if ahead:
            following = self._following(unit, _in_backward())
            if following is not None:
                self.ahead = following.post_gather()
        _wait(posted[1])
        return unit.unpad(posted[2])

    def abandon(self):
        """Forget what a backward that raised left behind: its posted reductions (waited for, dropped: that
        backward's gradients are partial), its flush (queued on a graph task that never ended) and the flat
        vectors it gathered for its saved tensors (their parameters may have changed since)."""
        for _, work, _, _ in self.pending:
            _wait(work)
        self.pending, self.flush_queued = [], False
        for u in self.units:
            u.backward_flat = None

    def _following(self, unit, backward):
        """Record `unit`'s gather in this step's sequence and return the unit gathered after it in the last step's:
        the next one at the same place when this step so far went as the last one did, else after the unit's next
        call there (a unit called twice, a branch taken in one step and not in the next)."""
        if not backward and self.seen[1]:  # a new step: what the last one did is the sequence to expect
            self.orders, self.seen, self.cursor = self.seen, ([], []), [0, 0]
        seq, order, at = self.seen[backward], self.orders[backward], self.cursor[backward]
        if len(seq) < SEQUENCE_LIMIT:
            seq.append(unit)
        if not (at < len(order) and order[at] is unit):
            at = next((i for i in range(at, len(order)) if order[i] is unit),
                      next((i for i in range(min(at, len(order))) if order[i] is unit), None))
            if at is None:
                return None
        self.cursor[backward] = at + 1
        return order[at + 1] if at + 1 < len(order) else None

    def reduce_later(self, unit, grad):
        """Post this rank's slice of the sum over ranks of `unit`'s flat gradient: a padded reduce-scatter, which
        moves (N - 1) x width elements per rank; or, without one, an all-reduce of the whole gradient (T
        elements), which moves about 2 (N - 1) / N x T per rank and holds the whole sum on every rank."""
        if unit.width == 0:
            return
        lo, n = unit.offsets[unit.rank], unit.sizes[unit.rank]
        if not self.single_reduce:
            summed = grad.clone()
            dist.all_reduce(summed, group=self.group)
            self.pending.append((unit, None, summed[lo:lo + n], None))
        else:
            if all(k == unit.width for k in unit.sizes):
                padded = grad.contiguous()
            else:
                padded = grad.new_zeros(len(unit.sizes), unit.width)
                for r, (a, k) in enumerate(zip(unit.offsets, unit.sizes)):
                    padded[r, :k] = grad[a:a + k]
                padded = padded.reshape(-1)
            out = grad.new_empty(unit.width)
            work = self._rs_single(out, padded, group=self.group, async_op=True)
            self.pending.append((unit, work, out[:n], padded))
        if not self.flush_queued:
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self):
        """At a backward's end: wait for its reductions and add them to the shards' gradients; drop a gather
        posted ahead that no unit took."""
        self.flush_queued = False
        pending, self.pending = self.pending, []
        for unit, work, piece, _ in pending:
            _wait(work)
            if self.reduce == "mean":
                piece.div_(self.divisor)
            shard = unit.shard
            if shard.grad is None:
                whole = piece.numel() * piece.element_size() == piece.untyped_storage().nbytes()
                shard.grad = piece if whole else piece.clone()  # not a view holding a padded or whole buffer
            else:
                shard.grad.add_(piece)
        if self.ahead is not None:
            _wait(self.ahead[1])
            self.ahead = None
            self.dropped += 1


def _wait(work):
    if work is not None:
        work.wait()


def _supported(call):
    try:
        call()
        return True
    except (RuntimeError, NotImplementedError) as e:
        if "support" not in str(e).lower():
            raise  # a failure of the collective itself, not a missing operation
        return False


class _Record:
    """What shard_states left on a module: its units, the original state dict's keys in order, and the engine
    that shards it ("hexiseq", or "fsdp2": the units' layouts then only name the parameters)."""

    def __init__(self, units, comm, keys, hooks, engine="hexiseq", parent=None, replicas=None):
        self.units, self.comm, self.keys, self.hooks, self.engine = units, comm, keys, hooks, engine
        self.parent = comm.group if parent is None else parent  # the group every rank of the module is in
        self.replicas = replicas  # a hexiseq.runtime.replicas.ReplicaSync, or None (one copy of the states)

    def parameter(self, module, entry):
        """The FSDP2 parameter (a DTensor) of a layout entry."""
        return module.get_parameter(entry.names[0])


# ------------------------------------------------------------------------------------------------ the API

def _default_units(module):
    """The elements of the outermost ModuleLists (a ModuleList inside an element stays in that element's unit:
    an expert list, say, whose members may not run on every rank, gathered with its layer). A ModuleList that is
    itself an element is entered, since only callable modules can gather in their forward hooks."""
    units = []

    def walk(m):
        if isinstance(m, nn.ModuleList):
            for child in m:
                walk(child) if isinstance(child, nn.ModuleList) else units.append(child)
        else:
            for child in m.children():
                walk(child)

    walk(module)
    return units


def _find_units(module, units):
    """The units as (module, qualified name, [(names, parameter)]) in module order, root first; an error
    message instead when the units are not submodules or a parameter is tied across units."""
    paths = {}  # each module's first qualified name, in module order
    for name, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    rank_of = {key: i for i, key in enumerate(paths)}
    if units is None:
        units = _default_units(module)
    else:
        units = list(units)
        for i, u in enumerate(units):
            if not isinstance(u, nn.Module) or id(u) not in paths:
                return None, f"units[{i}] must be a submodule of the module, got {type(u).__name__}"
    chosen = {id(module): module}
    for u in units:
        chosen.setdefault(id(u), u)
    modules = dict(module.named_modules(remove_duplicate=False))
    owner_of, places = {}, {}
    for full, p in module.named_parameters(remove_duplicate=False):
        prefix, _, attr = full.rpartition(".")
        parts = prefix.split(".") if prefix else []
        unit = module
        for k in range(1, len(parts) + 1):
            m = modules[".".join(parts[:k])]
            if id(m) in chosen:
                unit = m
        if id(p) in owner_of and owner_of[id(p)][0] is not unit:
            first = owner_of[id(p)][1][0]
            return None, (f"parameter {full} is the same tensor as {first}, which is in another unit; tied "
                          "parameters must be in the same unit (pass units that keep them together)")
        owner_of.setdefault(id(p), (unit, [], p))[1].append(full)
        places.setdefault(id(p), []).append((modules[prefix], attr))
    found = []
    for m in sorted(chosen.values(), key=lambda m: rank_of[id(m)]):
        params = [(names, p) for u, names, p in owner_of.values() if u is m]
        if params:
            found.append((m, paths[id(m)], params, [places[id(p)] for _, p in params]))
    return found, None


def shard_states(module, shares, *, group=None, replicas=None, units=None, reduce="mean", engine="auto"):
    """Shard `module`'s parameters over the ranks of `group` (default: the world) in unequal parts; returns the
    module. Collective: every rank calls it with the same shares and an identical module.

    shares: one non-negative float per rank of the group, summing to 1 (within 1e-9), "even", or a plan (anything
    with a `state_shares` attribute). A zero share is allowed: that rank holds no states but takes part in every
    collective.

    replicas: None (one copy of the states, sharded over the whole group), or the ranks of the group cut into
    replicas (a list of lists of ranks, or a batch plan or schedule, whose groups are taken), each holding a whole
    copy sharded over its own ranks, by their shares, which then sum to 1 within each replica (HSDP with replicas
    of unequal size and unequal shares). Gathers and gradient reduce-scatters stay inside a replica, so replicas
    may run different numbers of forwards and backwards in a step (the groups of a batch plan do); after the
    step's last backward, `sync_replicas(module)` (collective over the whole group) sums the gradients across the
    replicas, each rank with the ranks of other replicas holding the same elements (hexiseq.runtime.replicas).
    Needs the world as the group and the own engine. units: the submodules whose parameters are gathered together (default: every element of the
    outermost nn.ModuleLists); every other parameter belongs to the root unit, the module itself. A parameter
    tied across units is refused; tied inside one unit it is stored once. reduce: "mean" (default) divides the
    summed gradient by the group size, "sum" does not.

    engine: "auto" (default) hands even shares to torch's FSDP2 (`fully_shard` on each unit, then on the module;
    see hexiseq.runtime.fsdp2 for why) and shards uneven ones itself; "hexiseq" shards itself at any shares;
    "fsdp2" requires even shares. Under FSDP2, `module.parameters()` are DTensors under their original names.

    Build the optimizer after sharding: `module.parameters()` then yields this rank's shards (hexiseq's own
    engine: one flat parameter per unit, named `hexiseq_shard` on the unit's module). See the module docstring
    for how it works, what it costs and what a user must not do. `full_state_dict` gathers the full parameters
    back, `load_full_state_dict` loads them, and hexiseq.checkpoint saves and loads, alike for both engines.

    Raises InvalidArgumentError (bad shares, units, reduce or engine on any rank) or RankMismatchError (ranks
    disagree about the shares, reduce, the engine, the units' sizes, dtypes, parameter names and shapes, or the
    parameters' values: a digest of sampled elements, see _digests) with the same message on every rank."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise InvalidArgumentError("this process is not a member of the group it shards over")
    shares = getattr(shares, "state_shares", shares)
    error, found, checked, use_fsdp2, reps = None, [], None, False, None
    try:  # every local check first: a rank that fails still meets the others in the agreement below
        if not isinstance(module, nn.Module):
            raise InvalidArgumentError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if "_hexiseq_states" in module.__dict__:
            raise InvalidArgumentError("module is already sharded by shard_states")
        if reduce not in REDUCES:
            raise InvalidArgumentError(f"reduce must be one of {list(REDUCES)}, got {reduce!r}")
        if engine not in ENGINES:
            raise InvalidArgumentError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
        if replicas is not None:
            reps = check_replicas(replicas, world)
            if group is not dist.group.WORLD:
                raise InvalidArgumentError("replicas need the world as the group (their process groups are made by "
                                           "every rank of it)")
            if engine == "fsdp2":
                raise InvalidArgumentError("engine 'fsdp2' does not take replicas of unequal shares: use engine "
                                           "'auto' or 'hexiseq'")
        checked = _check_shares(shares, world, reps)
        use_fsdp2 = reps is None and _fsdp2_engine(engine, checked)
        found, message = _find_units(module, units)
        if message is not None:
            raise InvalidArgumentError(message)
    except Exception as e:  # noqa: BLE001  (whatever it is, the other ranks must learn of it, not hang)
        error, found = e, []
    comm = _Comm(group, reduce if reduce in REDUCES else REDUCES[0])
    made = [_Unit(i, m, name, params, comm) for i, (m, name, params, _) in enumerate(found)]
    comm.units = made
    for u in made:
        message = u.check()
        if message is not None and error is None:
            error = InvalidArgumentError(message)
    device = collective_device(group)
    # the engine asked for and the one it comes to: ranks that ask alike but differ (FSDP2 missing on some) too
    header = [wire.code(REDUCES, reduce), 2 * wire.code(ENGINES, engine) + int(use_fsdp2), len(made),
              text_code(repr(reps))]
    header += [wire.float_bits(s) for s in (checked or [0.0] * world)]
    # in words when they disagree: the replicas travel as a digest
    words = [_show_field("reduce", header[0]), _show_field("engine", header[1]), str(len(made)),
             "none" if reps is None else repr([list(r) for r in reps]), _show_field("shares", header[4:])]
    agree(group, header, ("reduce", "engine", "units", "replicas", ("shares", world)), error, _show_field, device,
          words=words)
    fields = [f"units[{i}].{f}" for i in range(len(made))
              for f in ("numel", "dtype", "requires_grad", "parameters", "names and shapes")]
    agree(group, [v for u in made for v in u.describe()], fields, None, _show_field, device)
    # the values each rank shards: ranks that loaded different weights (another seed, another checkpoint) would
    # otherwise each keep their slice of their own weights, and the gathered parameters would mix them
    params = [(names[0], p) for u in made for names, p in u.params]
    _agree_values(group, [f"the values of {n}" for n, _ in params], [p for _, p in params], None, device)

    keys = list(module.state_dict(keep_vars=True).keys())
    if use_fsdp2:
        for u in made:
            u.lay_out()
            u.params = None  # the originals become FSDP2's DTensors: hold no reference to them
        fsdp2.shard(module, [u.module for u in made], group, made[0].device.type if made else "cpu", reduce)
        module.__dict__["_hexiseq_states"] = _Record(made, comm, keys, [], engine="fsdp2")
        return module
    mine, sync = tuple(range(world)), None
    if reps is not None:
        sync = ReplicaSync(group, reps, lambda i, j: shard_sizes([checked[r] for r in reps[j]], made[i].total),
                           [u.total for u in made], rank)
        mine = reps[sync.mine]
        comm.group, comm.world, comm.divisor = sync.group, len(mine), world
    if made:
        comm.probe(made[0].device, made[0].dtype)
    hooks = []
    for u, (_, _, _, places) in zip(made, found):
        u.build(shard_sizes([checked[r] for r in mine], u.total), mine.index(rank))
        u.place(places)
        hooks.append(u.module.register_forward_pre_hook(u.before, prepend=True))  # before hooks that read them
        hooks.append(u.module.register_forward_hook(u.after, always_call=True))
    module.__dict__["_hexiseq_states"] = _Record(made, comm, keys, hooks, parent=group, replicas=sync)
    return module


def sync_replicas(module):
    """Sum the gradients of a module sharded with replicas (shard_states(..., replicas=...)) across the replicas:
    call it once per step, after the step's last backward and before the optimizer step (and before
    clip_grad_norm_). Collective over the module's whole group: every rank calls it once per step, whatever
    number of passes its replica ran (a rank that ran none takes part with zero gradients). Each rank all-reduces
    what it holds with the ranks of other replicas that hold the same elements (hexiseq.runtime.replicas). A
    module sharded without replicas has nothing to sum: a no-op."""
    rec = sharding_of(module)
    if rec.replicas is not None:
        rec.replicas.sync(rec.units)


def _fsdp2_engine(engine, shares):
    """Whether FSDP2 shards (see shard_states' engine); InvalidArgumentError for "fsdp2" where it cannot."""
    even = max(shares) - min(shares) <= SHARE_TOLERANCE
    if engine == "fsdp2":
        if not even:
            raise InvalidArgumentError(f"engine 'fsdp2' needs even shares (FSDP2 shards evenly), got {shares!r}: "
                                       "use engine 'auto' or 'hexiseq' for shares by memory")
        if not fsdp2.available():
            raise InvalidArgumentError(f"engine 'fsdp2' needs torch's FSDP2 (torch >= 2.6), this is torch "
                                       f"{torch.__version__}")
    return engine == "fsdp2" or (engine == "auto" and even and fsdp2.available())


SAMPLES = 16  # elements of each tensor read for its digest


def _digests(tensors):
    """One signed int64 per tensor (None: absent, digest 0): a digest of its shape, its dtype and SAMPLES of its
    elements, evenly spaced from the first to the last, read exactly (as float64). It catches what ranks loading
    different states almost always produce: other shapes or dtypes, other initialisations (another seed), another
    checkpoint or step, a tensor missing on some ranks. It cannot catch a difference confined to elements it does
    not read (a few edited rows of a large matrix), nor the buffers (not sharded: each rank keeps its own). Cost:
    SAMPLES elements per tensor copied to the host, no pass over the tensors; one all-gather of one integer per
    tensor at construction and per load."""
    import hashlib
    import struct

    out = []
    for t in tensors:
        if t is None:
            out.append(0)
            continue
        flat = t.detach().reshape(-1)
        n = flat.numel()
        at = torch.linspace(0, n - 1, min(SAMPLES, n), device=flat.device).round().long() if n else None
        picked = flat[at].to("cpu", torch.float64) if n else torch.empty(0, dtype=torch.float64)
        h = hashlib.sha256(struct.pack(f"<q{t.dim()}q", t.dim(), *t.shape) + str(t.dtype).encode())
        h.update(picked.numpy().tobytes())
        out.append(int.from_bytes(h.digest()[:8], "little", signed=True) or 1)
    return out


def _agree_values(group, fields, tensors, error, device):
    """Every rank's digests of `tensors` (one per field) compared: ranks whose tensors differ raise the same
    RankMismatchError on every rank, naming the first tensor that differs with each rank's digest and the
    others that differ; `error` (this rank's, or None) as agree takes it."""
    agree(group, _digests(tensors) if error is None else [0] * len(fields), fields, error,
          lambda _field, value: "absent" if value == 0 else f"digest {value % (1 << 64):016x}", device)


def _show_field(field, value):
    if field == "shares":
        return repr([wire.bits_float(b) for b in value])
    if field == "reduce":
        return REDUCES[value] if value < len(REDUCES) else "other"
    if field == "engine":
        asked = repr(ENGINES[value // 2]) if value // 2 < len(ENGINES) else "other"
        return f"{asked}, sharding with {'FSDP2' if value % 2 else 'its own engine'}"
    if field.endswith(".dtype"):
        return wire.dtype_name(value)
    if field.endswith(".requires_grad"):
        return str(bool(value))
    if field.endswith(".names and shapes"):
        return f"digest {value % (1 << 64):016x}"
    return str(value)


def sharding_of(module):
    """What shard_states left on `module` (its units, group, keys and engine), for the modules that work on a
    sharded module's states (checkpoint.py); InvalidArgumentError when it is not sharded."""
    rec = module.__dict__.get("_hexiseq_states")
    if rec is None:
        raise InvalidArgumentError("module is not sharded: call hexiseq.shard_states(module, shares) first")
    return rec


def clip_grad_norm_(module, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """torch.nn.utils.clip_grad_norm_ for a module sharded by shard_states: the norm of the whole gradient, every
    rank's shard together, and the same scale applied on every rank; returns that norm (a 0-d tensor, the same on
    every rank). Collective over the module's group. torch's own function on the own engine's shards would clip
    each rank by the norm of its shard alone, a different scale on every rank; under FSDP2 (even shares) torch's
    function reduces over the DTensors itself and is called."""
    rec = sharding_of(module)
    max_norm = number(max_norm, "max_norm", positive=True)
    norm_type = math.inf if norm_type in (math.inf, "inf") else number(norm_type, "norm_type", positive=True)
    if rec.engine == "fsdp2":
        total = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type, error_if_nonfinite)
        return total.full_tensor() if fsdp2.is_dtensor(total) else total
    grads = [u.shard.grad for u in rec.units if u.shard.grad is not None]
    device = grads[0].device if grads else collective_device(rec.comm.group)
    if norm_type == math.inf:
        local = max((g.detach().abs().max() for g in grads if g.numel()), default=torch.zeros((), device=device))
        local = local.to(device, torch.float64).reshape(1)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=rec.comm.group)
        total = local[0]
    else:
        local = sum((g.detach().to(torch.float64).abs().pow(norm_type).sum() for g in grads),
                    torch.zeros((), dtype=torch.float64, device=device)).reshape(1)
        dist.all_reduce(local, group=rec.comm.group)
        total = local[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), "
                           "so it cannot be clipped")
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)


def full_state_dict(module, device=None):
    """The module's state dict with the full parameters under their original names and shapes, as before
    sharding (buffers as they are now). Collective: every rank calls it, and every rank gets the whole dict,
    gathered one unit at a time. device: where the full tensors go (e.g. "cpu", so the full model need not fit
    beside the shards on the accelerator); default: the parameters' device."""
    rec = sharding_of(module)
    full = {}
    for u in rec.units:
        flat = u.gather() if rec.engine == "hexiseq" else None
        for entry in u.layout:
            if flat is None:  # FSDP2: one all-gather per parameter, in the same order on every rank
                t = rec.parameter(module, entry).full_tensor().detach()
                t = t.to(device) if device is not None else t
            else:
                t = flat[entry.offset:entry.offset + entry.numel].view(entry.shape)
                t = t.to(device, copy=True) if device is not None else t.clone()
            for name in entry.names:
                full[name] = t
        del flat
    now = module.state_dict()
    shard_keys = {k for k in now if k.rpartition(".")[2] == SHARD_NAME}
    out = {k: full[k] if k in full else now[k] for k in rec.keys if k in full or k in now}
    out.update((k, v) for k, v in now.items() if k not in out and k not in shard_keys)
    return out


def load_full_state_dict(module, state_dict, strict=True):
    """Load a full state dict (as full_state_dict returns, or the unsharded model's) into a sharded module: each
    rank copies its own slice of every unit's parameters; buffers load as usual. strict: every parameter must be
    present, and no unknown key, else InvalidArgumentError.

    Collective: every rank of the module's group calls it with the same state dict. Before anything is loaded the
    ranks compare a digest of the parameters each one takes (shape, dtype and sampled elements, see _digests) and
    whether each rank's dict passed its checks: a rank that read another checkpoint would otherwise keep its slice
    of it beside the others' slices of theirs, a silent mix. Raises, on every rank alike, InvalidArgumentError
    when any rank's dict fails its checks, RankMismatchError naming the parameters that differ and each rank's
    digest of the first."""
    rec = sharding_of(module)
    group = rec.parent  # every rank, every replica: ranks of two replicas loading different dicts would mix them
    error, taken, picks, rest = None, set(), [], {}
    try:  # every local check first: a rank that fails still meets the others in the agreement below
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise InvalidArgumentError(f"state_dict must be a mapping of names to tensors, got "
                                       f"{type(state_dict).__name__}")
        for u in rec.units:
            for entry in u.layout:
                name = next((k for k in entry.names if k in state_dict), None)
                t = None
                if name is None:
                    if strict:
                        raise InvalidArgumentError(f"state_dict lacks the parameter {entry.names[0]}")
                else:
                    t = state_dict[name]
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != entry.shape:
                        shown = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                        raise InvalidArgumentError(f"state_dict[{name!r}] has shape {shown}, the parameter "
                                                   f"{list(entry.shape)}")
                    taken.update(k for k in entry.names if k in state_dict)
                picks.append((u, entry, t))
        rest = {k: state_dict[k] for k in state_dict.keys() if k not in taken}
        now = module.state_dict(keep_vars=True)
        sharded = {n for u in rec.units for entry in u.layout for n in entry.names}
        unexpected = [k for k in rest if k not in now]
        missing = [k for k in now if k.rpartition(".")[2] != SHARD_NAME and k not in sharded and k not in rest]
        if strict and (unexpected or missing):
            raise InvalidArgumentError(f"state_dict does not match the module: unexpected keys {unexpected}, "
                                       f"missing keys {missing}")
        for k, v in rest.items():
            if k in now and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(now[k].shape):
                raise InvalidArgumentError(f"state_dict[{k!r}] has shape {list(v.shape)}, the module's "
                                           f"{list(now[k].shape)}")
    except Exception as e:  # noqa: BLE001  (whatever it is, the other ranks must learn of it, not hang)
        error = e
    names = [entry.names[0] for u in rec.units for entry in u.layout]
    _agree_values(group, [f"state_dict[{n!r}]" for n in names], [t for _, _, t in picks] if error is None else
                  [None] * len(names), error, collective_device(group))
    if rec.engine == "fsdp2":
        for _, entry, t in picks:
            if t is not None:
                fsdp2.copy_full(rec.parameter(module, entry), t)
    for u in rec.units if rec.engine == "hexiseq" else ():
        lo, n = u.offsets[u.rank], u.sizes[u.rank]
        pieces = []
        for pu, entry, t in picks:
            if pu is not u:
                continue
            a, b = max(lo, entry.offset), min(lo + n, entry.offset + entry.numel)
            if a < b:
                part = u.shard.detach()[a - lo:b - lo] if t is None else t.detach().reshape(-1)[
                    a - entry.offset:b - entry.offset]
                pieces.append(part.to(u.shard.device, u.shard.dtype))
        if pieces:
            with torch.no_grad():
                u.shard.copy_(torch.cat(pieces))
    module.load_state_dict(rest, strict=False)
    return module

