"""Run a plan of several groups: a step's sequences of unequal length on groups of unequal devices, each group with
its own layout.

Such a hexiseq.Plan (hexiseq.planner.BatchPlan, from hexiseq.BatchPlanner or hexiseq.plan) cuts the cluster into groups and gives each group some of
the step's sequences, packed into one or more passes; each pass has its own plan over the group's devices. Here:

- BatchContext(planner): made once per job, on every rank of the world (rank r = the planner's cluster device r).
  `step(batch_plan)` is collective: every rank checks it holds the same BatchPlan (a fingerprint), then every
  process group the step needs (each group's devices, its Gloo twin on NCCL, the all-to-all groups of its passes'
  plans) is made on every rank in the same order, once per job: torch names a group by a counter every rank must
  advance together, which is why no rank may make one alone (see hexiseq.runtime.comm).
- BatchStep: this rank's group and its passes; helpers put a global batch into each rank's inputs and per-sequence
  figures back in batch order.
- Pass: one packed pass: its plan, its context (hexiseq.nn.HexiSeqContext over the group's process group), its
  documents (each sequence one document, or its own documents), and this rank's shard of it.

Gradients: every rank computes the gradients of its own tokens' loss; the step's gradient is their sum over all
ranks (one all-reduce over the world; hexiseq.states' reduce-scatter over the world, with padded passes; or, as
the planner prices it, the states held once per group with hexiseq.states.shard_states(..., replicas=plan): a
reduce-scatter inside each group per pass, then sync_replicas across the groups once per step). Divide the
loss by the step's token count (BatchStep.total_tokens, or the count of labelled tokens) on every rank so that the
sum is the gradient of the batch's mean.
"""

import collections
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import geometry
from ..schedule import Schedule
from ..errors import InvalidArgumentError
from .comm import agree, collective_device, group_timeout, open_group, resolve_group, text_code
from .documents import DOCUMENTS_KWARG
from .nn import HexiSeqContext, close_at_exit, hexiseq_attn_func

__all__ = ["BatchContext", "BatchStep", "Pass", "EmptyPass", "BatchAttention"]

_CONTEXTS_KEPT = 32  # pass contexts kept for later steps with the same pass plan (a model calls one per layer)


class BatchContext:
    """What every step of a job of BatchPlans shares: the planner's cluster (rank r = device r of it), the process
    groups made so far (never made twice) and the pass contexts of recent steps.

    planner: the hexiseq.BatchPlanner the job plans its steps with (its cluster, model and candidate groups).
    causal, softmax_scale: of the attention, as for hexiseq.nn.HexiSeqContext (causal must be the planner's: a pass
    packs several sequences as documents, which only a causal mask keeps apart). timeout: for the groups made here.
    Collective to build: every rank of the world calls it with the same planner."""

    def __init__(self, planner, causal: Optional[bool] = None, softmax_scale: Optional[float] = None, timeout=None):
        self._group = resolve_group(None)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.planner = planner
        self.causal = getattr(planner, "causal", True) if causal is None else bool(causal)
        self.scale = softmax_scale
        self.timeout = timeout if timeout is not None else group_timeout(self.group)
        self.backend = str(dist.get_backend(self.group))
        error, identity = None, 0
        try:  # every check first: a rank whose planner is wrong still meets the others in the agreement below
            if not all(hasattr(planner, a) for a in ("cluster", "model", "training", "causal", "groups", "plan")) \
                    or hasattr(planner, "assignment"):
                raise InvalidArgumentError(f"planner must be a hexiseq.BatchPlanner (the job's planner, not one "
                                           f"step's BatchPlan), got {type(planner).__name__}")
            n = planner.cluster.num_devices
            if n != self.world:
                raise InvalidArgumentError(f"the planner's cluster has {n} devices but the world has {self.world} "
                                           "ranks (rank r runs device r)")
            if self.causal != planner.causal:
                raise InvalidArgumentError(f"causal={self.causal} but the planner plans causal={planner.causal}")
            self._identity = _job_identity(planner)
            identity = text_code(self._identity)
        except Exception as e:  # noqa: BLE001 - whatever it is, the other ranks must learn of it, not hang
            error = e
        self._cpu = self.group if "gloo" in self.backend else dist.new_group(backend="gloo", **self._timeout_kw())
        agree(self._cpu, [identity, int(self.causal), text_code(repr(softmax_scale))],
              ["planner", "causal", "softmax_scale"], error)
        self._groups: Dict[tuple, object] = {}
        self._contexts: "collections.OrderedDict[tuple, HexiSeqContext]" = collections.OrderedDict()
        self.steps = 0
        close_at_exit(self)

    @property
    def group(self):
        """The world process group the job runs over; after close() a HexiseqError."""
        return open_group(self._group, "this BatchContext", "one to run more steps")

    def _timeout_kw(self):
        return {"timeout": self.timeout} if self.timeout is not None else {}

    def _subgroup(self, ranks, backend):
        """A group made by _make_groups (Comm's subgroups provider)."""
        key = (tuple(sorted(ranks)), backend)
        if key not in self._groups:
            raise InvalidArgumentError(f"internal: no process group was made for ranks {list(key[0])} ({backend})")
        return self._groups[key]

    def _make_groups(self, needed):
        """Make every group of `needed` (a list of (ranks, backend) in an order every rank computes alike) that
        this job has not made yet: every rank takes part in every creation (no local synchronisation)."""
        for ranks, backend in needed:
            key = (tuple(sorted(ranks)), backend)
            if key in self._groups:
                continue
            if len(ranks) == self.world and backend is None:
                self._groups[key] = self.group
                continue
            self._groups[key] = dist.new_group(ranks=list(key[0]), backend=backend, **self._timeout_kw())

    def _needed(self, schedule):
        """The process groups every pass of every group of `schedule` runs on, in one order on every rank."""
        out = []
        gloo = "gloo" in self.backend
        for g, devices in enumerate(schedule.groups):
            if not schedule.passes[g]:
                continue
            out.append((tuple(devices), None))
            if not gloo:
                out.append((tuple(devices), "gloo"))
            for pass_layout in schedule.layouts[g]:
                lay = pass_layout.layout
                at, slots = 0, lay.device.tolist()
                for size in lay.group_size.tolist():
                    if size > 1:
                        out.append((tuple(devices[d] for d in slots[at:at + size]), None))
                    at += size
        return out

    def step(self, plan) -> "BatchStep":
        """This rank's part of `plan`: a hexiseq.Plan of the planner's cluster (of several groups, or of one group of
        every device), run as the hexiseq.schedule.Schedule it gives, which is all this reads of it.
        Collective: every rank calls it with the same plan, checked by fingerprint; a rank whose plan differs, or
        any invalid plan, makes every rank raise the same error."""
        self.group  # raises on a closed context, before any collective
        schedule = plan if isinstance(plan, Schedule) else getattr(plan, "schedule", None)
        error = self._plan_error(plan, schedule)
        code = text_code(schedule.fingerprint) if error is None else 0
        agree(self._cpu, [code], ["batch plan"], error)
        self._make_groups(self._needed(schedule))
        g = next(i for i, devices in enumerate(schedule.groups) if self.rank in devices)
        devices = tuple(schedule.groups[g])
        passes = []
        for sequences, pass_layout in zip(schedule.passes[g], schedule.layouts[g]):
            passes.append(Pass(self, pass_layout, self._context(devices, pass_layout), list(sequences), schedule,
                               devices.index(self.rank)))
        self.steps += 1
        return BatchStep(self, plan, g, devices, passes, schedule)

    def _plan_error(self, plan, schedule):
        # the runtime does not import the planner (a room below it): a plan is run as the Schedule it gives
        if not isinstance(schedule, Schedule):
            return InvalidArgumentError(f"plan must be a hexiseq.Plan (or the hexiseq.schedule.Schedule it runs "
                                        f"as), got {type(plan).__name__}")
        if schedule.job != self._identity:
            return InvalidArgumentError("plan was made for another cluster or model than this context's planner")
        covered = sorted(d for devices in schedule.groups for d in devices)
        if covered != list(range(self.world)):
            return InvalidArgumentError(f"plan's groups must hold every device once, got "
                                        f"{[list(g) for g in schedule.groups]}")
        unsorted = [list(g) for g in schedule.groups if list(g) != sorted(g)]
        if unsorted:
            return InvalidArgumentError(f"plan's groups must list their devices in increasing order (a process group "
                                        f"numbers its ranks so), got {unsorted[0]}")
        if not self.causal and any(len(p) > 1 or schedule.documents[p[0]] is not None
                                   for ps in schedule.passes for p in ps):
            return InvalidArgumentError("a pass packs several sequences (or documents) into one, which needs a causal "
                                        "context: plan a non-causal batch one sequence per pass")
        return None

    def _context(self, devices, pass_layout):
        """The HexiSeqContext of a pass's layout over the group of `devices`, reused while it is among the recent
        ones."""
        key = (devices, pass_layout.fingerprint)
        ctx = self._contexts.pop(key, None)
        if ctx is None:
            # agreed: step() compared the schedule's fingerprint, which covers every pass's layout, on every rank
            ctx = HexiSeqContext(pass_layout, group=self._subgroup(devices, None), causal=self.causal,
                                 softmax_scale=self.scale, subgroups=self._subgroup, agreed=True)
        self._contexts[key] = ctx
        while len(self._contexts) > _CONTEXTS_KEPT:
            self._contexts.popitem(last=False)[1].close()
        return ctx

    def close(self):
        """Release the contexts and the process groups this object made, and let go of the world group too (call it
        before destroy_process_group; the exit hook of hexiseq.runtime.nn does it otherwise: see
        HexiSeqContext.close). Idempotent; a closed BatchContext raises HexiseqError when asked for a step."""
        if self._group is None:
            return
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()
        made = {id(pg): pg for pg in self._groups.values() if pg is not self._group}
        if self._cpu is not self._group:
            made[id(self._cpu)] = self._cpu
        self._groups.clear()
        self._cpu = self._group = None
        for pg in made.values():
            if dist.is_initialized():
                try:
                    dist.destroy_process_group(pg)
                except (RuntimeError, ValueError):
                    pass


def _job_identity(p):
    """What a planner and the plans its context runs must share: the cluster and the model (a plan's training, its
    state shares say, changes nothing a step executes; the fingerprint the ranks compare covers it)."""
    return repr((p.cluster.to_dict(), p.model.to_dict()))


class Pass:
    """One packed pass of this rank's group: `sequences` (batch indices, in packed order) laid end to end as one
    sequence of `plan.seq_len` tokens, each a document (or its own documents), attended under `plan` (the pass's
    hexiseq.schedule.PassLayout) by `context`.

    local_rank: this rank's device index in the group (its rank in `plan`). tokens: how many of the pass's tokens
    this rank holds."""

    def __init__(self, batch_context, plan, context, sequences, schedule, local_rank):
        self.batch_context = batch_context
        self.plan = plan
        self.context = context
        self.sequences = sequences
        self.local_rank = local_rank
        docs = [list(schedule.documents[i] or (schedule.lengths[i],)) for i in sequences]
        self.document_lengths = tuple(L for d in docs for L in d)
        # one causal document needs no mask: the plain path
        self.documents = None if len(self.document_lengths) == 1 else self.document_lengths
        self.sequence_lengths = tuple(schedule.lengths[i] for i in sequences)
        self._positions = plan.positions(local_rank)
        self.positions = torch.as_tensor(self._positions, dtype=torch.int64)  # in the packed sequence
        self.tokens = int(self.positions.numel())

    def pack(self, batch: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The pass's packed sequence: batch[i] (each sequence's tensor, its tokens along `dim`, for every
        sequence of the step in batch order) of this pass's sequences, laid end to end along `dim`."""
        parts = []
        if self.sequences and len(batch) <= max(self.sequences):
            raise InvalidArgumentError(f"batch must hold every sequence of the step in batch order (this pass takes "
                                       f"sequence {max(self.sequences)}), got {len(batch)}")
        for i, n in zip(self.sequences, self.sequence_lengths):
            x = batch[i]
            if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != n:
                raise InvalidArgumentError(f"batch[{i}] must be a tensor with {n} tokens along dim {dim}, got "
                                           f"{type(x).__name__}{list(x.shape) if isinstance(x, torch.Tensor) else ''}")
            parts.append(x)
        return torch.cat(parts, dim)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a tensor over the pass's packed sequence (plan.shard)."""
        return geometry.take(x, self._positions, dim, self.plan.seq_len)

    def _document_index(self):
        """Per packed position, (its document's first position)."""
        starts = torch.zeros(self.plan.seq_len, dtype=torch.int64)
        at = 0
        for L in self.document_lengths:
            starts[at:at + L] = at
            at += L
        return starts

    def position_ids(self) -> torch.Tensor:
        """[tokens]: each of this rank's tokens' position in its document (what rotary embeddings take)."""
        return self.positions - self._document_index()[self.positions]

    def sequence_ids(self) -> torch.Tensor:
        """[tokens]: each of this rank's tokens' sequence (batch index)."""
        owner = torch.repeat_interleave(torch.as_tensor(self.sequences, dtype=torch.int64),
                                        torch.as_tensor(self.sequence_lengths, dtype=torch.int64))
        return owner[self.positions]

    def inputs(self, batch: Sequence[torch.Tensor], ignore_index: int = -100) -> dict:
        """This rank's inputs of a causal language model for the pass, from the step's token ids (batch[i]: 1-D,
        sequence i's tokens, every sequence of the step in batch order): input_ids, position_ids and labels, each
        [1, tokens]. A token's label is the next token of its document; the last token of each document has
        ignore_index (no token of another document is predicted)."""
        ids = self.pack(batch, 0)
        labels = torch.full_like(ids, ignore_index)
        at = 0
        for L in self.document_lengths:
            labels[at:at + L - 1] = ids[at + 1:at + L]
            at += L
        pos = self.positions.to(ids.device)
        return {"input_ids": ids[pos][None], "position_ids": self.position_ids().to(ids.device)[None],
                "labels": labels[pos][None]}

    def labels(self, batch: Sequence[torch.Tensor], ignore_index: int = -100) -> torch.Tensor:
        """[1, tokens] labels of this rank's tokens (inputs(batch)["labels"]; [1, 0] on a rank that holds none)."""
        return self.inputs(batch, ignore_index)["labels"]

    def hf_inputs(self, batch: Sequence[torch.Tensor]) -> dict:
        """The keyword arguments of a Hugging Face model patched with the BatchContext (hexiseq.hf.patch_model(model,
        context)) for this rank's tokens of the pass: input_ids and position_ids [1, tokens] (positions restarting at
        each document), an all-ones attention_mask and, for a pass of several documents, their lengths. Take the
        labels from labels(batch) (not through the model, which would shift them again). A rank that holds no token
        of the pass gets its empty shard, as from shard(), and the patched model takes it (it runs it as one
        placeholder token whose attention output is 0, so that its attention layers take part in the collectives,
        and returns logits of 0 tokens, which labels(batch) matches)."""
        got = self.inputs(batch)
        ids, pos = got["input_ids"], got["position_ids"]
        out = {"input_ids": ids, "position_ids": pos, "attention_mask": torch.ones_like(ids, dtype=torch.long)}
        if self.documents is not None:
            out[DOCUMENTS_KWARG] = self.documents
        return out

    def attention(self, q, k, v, window=None, softcap=None, sinks=None):
        """Attention of this rank's tokens of the pass (q [batch, tokens, heads, d], k/v with the kv heads), the
        pass's documents masked: hexiseq.nn.hexiseq_attn_func under the pass's context, with the layer's variant
        (window, softcap, sinks: as hexiseq_attn_func takes them)."""
        return hexiseq_attn_func(q, k, v, self.context, documents=self.documents, window=window, softcap=softcap,
                                 sinks=sinks)

    def __enter__(self):
        """`with pass_:` makes it the pass BatchAttention modules attend in."""
        self.batch_context._active = self
        return self

    def __exit__(self, *exc):
        self.batch_context._active = None
        return False

    def __repr__(self):
        return (f"Pass(sequences={self.sequences}, seq_len={self.plan.seq_len}, tokens={self.tokens}, "
                f"local_rank={self.local_rank})")


class EmptyPass:
    """A pass with no tokens, run by a rank whose group has fewer passes than the step's busiest group (none, for a
    group the plan left idle) so that every rank runs the model as many times: what collectives the model's own
    code makes per call (hexiseq.states' gathers of sharded parameters, FSDP's) then meet on every rank. Its
    inputs are one placeholder token (id 0, position 0, label ignore_index: models reshape with -1, which an empty
    sequence makes ambiguous) whose loss is 0; its attention returns zeros without communicating (tied to q, k, v
    so that the backward runs through the same modules)."""

    tokens = 0  # of the step's sequences
    context = None  # no group, no communication
    sequences: List[int] = []
    documents = None
    document_lengths = ()
    sequence_lengths = ()

    def __init__(self, batch_context):
        self.batch_context = batch_context

    def inputs(self, batch, ignore_index: int = -100) -> dict:
        device = batch[0].device if len(batch) else None
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        return {"input_ids": one, "position_ids": one.clone(), "labels": torch.full_like(one, ignore_index)}

    def labels(self, batch, ignore_index: int = -100):
        return self.inputs(batch, ignore_index)["labels"]

    def hf_inputs(self, batch) -> dict:
        got = self.inputs(batch)
        return {"input_ids": got["input_ids"], "position_ids": got["position_ids"],
                "attention_mask": torch.ones_like(got["input_ids"])}

    def position_ids(self):
        return torch.zeros(1, dtype=torch.long)

    def sequence_ids(self):
        return torch.zeros(0, dtype=torch.long)

    def attention(self, q, k, v, window=None, softcap=None, sinks=None):
        tied = q.sum() + k.sum() + v.sum() + (sinks.sum() if sinks is not None else 0.0)
        return q.new_zeros(q.shape) + 0.0 * tied

    __enter__ = Pass.__enter__
    __exit__ = Pass.__exit__

    def __repr__(self):
        return "EmptyPass()"


class BatchStep:
    """This rank's part of one step: its group (index `group`, global ranks `devices`) and the group's passes.

    passes: the group's packed passes. padded_passes(): the same followed by EmptyPass()es up to the step's busiest
    group's count, the same number on every rank: iterate those when the model makes collectives of its own per
    call (parameters sharded by hexiseq.states.shard_states or FSDP over ranks of different groups)."""

    def __init__(self, batch_context, plan, group, devices, passes: List[Pass], schedule):
        self.batch_context = batch_context
        self.plan = plan
        self.schedule = schedule  # what the step runs: plain data
        self.group = group
        self.devices = devices
        self.passes = passes

    def padded_passes(self) -> list:
        most = max(len(ps) for ps in self.schedule.passes)
        return list(self.passes) + [EmptyPass(self.batch_context) for _ in range(most - len(self.passes))]

    @property
    def sequences(self) -> List[int]:
        """The step's sequences this rank's group runs, in batch order."""
        return self.schedule.sequences_of(self.group)

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole step (every group's)."""
        return int(sum(self.schedule.lengths))

    def labelled_tokens(self) -> int:
        """Tokens of the whole step that have a label (every token but the last of each document)."""
        return int(sum(L - len(d or (L,)) for d, L in zip(self.schedule.documents, self.schedule.lengths)))

    def per_sequence(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-token figures of this rank (values[p]: [tokens] of pass p, a loss per token, say) summed per
        sequence over every rank: a float64 [sequences] tensor in batch order, the same on every rank (an
        all-reduce over the world, on the values' device; not differentiable). Collective: a rank whose values do
        not fit its passes makes every rank raise the same error."""
        n = len(self.schedule.lengths)
        error, out = None, None
        try:  # a rank whose values are wrong makes every rank raise, instead of leaving them in the all-reduce
            values = list(values)
            if len(values) != len(self.passes):  # padded passes' values may come along
                values = [v for v, p in zip(values, self.padded_passes()) if not isinstance(p, EmptyPass)]
            if len(values) != len(self.passes):
                raise InvalidArgumentError(f"values must hold one tensor per pass ({len(self.passes)}), got "
                                           f"{len(values)}")
            device = values[0].device if values else collective_device(self.batch_context.group)
            out = torch.zeros(n, dtype=torch.float64, device=device)
            for p, v in zip(self.passes, values):
                v = v.detach().reshape(-1)
                if v.numel() != p.tokens:
                    raise InvalidArgumentError(f"values of {p} must hold {p.tokens} entries, got {v.numel()}")
                out.index_add_(0, p.sequence_ids().to(device), v.to(torch.float64))
        except Exception as e:  # noqa: BLE001
            error = e
        agree(self.batch_context._cpu, [n], ["sequences"], error)
        dist.all_reduce(out, group=self.batch_context.group)
        return out

    def __repr__(self):
        return f"BatchStep(group={self.group}, devices={list(self.devices)}, passes={self.passes})"


class BatchAttention(torch.nn.Module):
    """Drop-in attention for a model trained on BatchPlans: attends in the pass made active by `with pass_:`
    (BatchStep.passes), so one model runs every pass of every step. The backward of a pass runs in that pass's
    context whenever it runs (after the pass, or after all of them). window, softcap: this layer's sliding window
    and logit soft-capping, as hexiseq.nn.HexiSeqAttention takes them; sinks per call."""

    def __init__(self, batch_context: BatchContext, window=None, softcap: Optional[float] = None):
        super().__init__()
        self.batch_context = batch_context
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v, sinks=None):
        active = getattr(self.batch_context, "_active", None)
        if active is None:
            raise InvalidArgumentError("BatchAttention runs inside `with pass_:` for a pass of BatchContext.step(...)")
        return active.attention(q, k, v, window=self.window, softcap=self.softcap, sinks=sinks)
