"""The communication of one rank executing a plan: its process groups, the uneven all-to-all inside its HP group,
tagged P2P batches for the ring, per-phase timers, and the distributed contract every collective call keeps.

The contract: ranks that disagree must fail together, with the same `HexiseqError` on every rank, within the
group's timeout, never an abort inside a collective (Gloo aborts the process when the sizes of an uneven
all-to-all disagree) or a silently wrong result. So:
- at construction the ranks compare the plan's fingerprint, the device count, the causal flag and the softmax
  scale (one all-gather);
- before every forward and backward call they compare a small descriptor of the call (batch, head dim, dtype,
  device kind, causal, scale, whether a backward will follow, a digest of the packed documents' lengths) and
  whether each rank's inputs passed validation:
  one all-gather of a few integers over a CPU group, so a CUDA run does not wait for the device. A rank whose
  inputs fail makes every rank raise the same error, naming the rank and the field;
- the HP subgroups inherit the parent group's timeout (torch would give them its 30-minute default).
Why every call rather than once per new shape: a rank cannot know that another rank's shape is new without
asking it; if one rank skipped the check while another made it, they would meet in different collectives,
which is the abort this avoids. The check costs one small all-gather per call (tens of microseconds on Gloo).
"""

import hashlib
import math
import struct
import time

import torch
import torch.distributed as dist

from .. import errors as errors_module
from . import wire
from ..errors import HexiseqError, InvalidArgumentError, RankMismatchError

# torch.distributed.nn.functional writes `group=group.WORLD` as the default of its ten collectives, evaluated when
# the module is first imported. torch imports it lazily (torch._dynamo does, on a job's first optimizer), and
# imported after init_process_group it binds the world process group itself: destroy_process_group() then cannot
# free it, and its Gloo worker threads run on into interpreter shutdown. A worker that is still letting go of the
# last collective's work when the interpreter finalises needs the GIL to drop the tensor's Python object, is ended
# by Python mid-unwind, and the process aborts ("terminate called without an active exception") after all work is
# done. Imported here, before the job initialises (where scripts import hexiseq.nn), the defaults are None and
# destroy_process_group() frees the world group and joins its threads. Imported after, it would pin the group: not
# then.
if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401,E402

# Message kinds, as P2P tags: K/V blocks, dK/dV accumulators, shared-kv-head reductions. Between one pair of
# ranks a K/V block and an accumulator can have the same shape; posting order alone keeps them apart, so the
# tags make a future reordering on one side fail to match (Gloo matches by tag) instead of swapping them.
# NCCL ignores tags and matches in posting order, which both sides keep.
TAG_KV, TAG_ACC, TAG_REDUCE = 1, 2, 3

_DEVICES = ["cpu", "cuda"]
# The fields of a call's descriptor, in order; each is an int64 on the wire.
# "plan" tells two contexts apart (ranks calling different layers' contexts at once); "phase" a forward from a
# backward (a rank that skipped a backward and went on to the next forward).
# "documents" is a digest of the call's document lengths (0: none), so that ranks packing different documents
# fail together instead of masking differently.
CALL_FIELDS = ("plan", "phase", "batch", "head_dim", "dtype", "device", "causal", "softmax_scale", "backward",
               "documents", "attention variant")
_PHASES = ["forward", "backward"]


def plan_code(plan):
    """The plan's fingerprint as a signed int64."""
    fp = int(plan.fingerprint, 16)
    return fp - (1 << 64) if fp >= (1 << 63) else fp


def describe_call(code, phase, q, causal, scale, backward, documents=None, variant=""):
    """The descriptor of a call as a tuple of ints in CALL_FIELDS order. code: the plan's plan_code (computed once
    per context: it hashes the whole plan, which took longer than a layer's kernels on one GPU at 8K tokens). q: the
    query (forward) or the output gradient (backward), [batch, tokens, heads, head_dim]. documents: the call's
    document lengths, one tuple of ints per batch row (None: none). variant: the layer's window, soft-capping and
    sinks as a text ("": none; see hexiseq.runtime.variants)."""
    return (code, _PHASES.index(phase), q.shape[0], q.shape[3], wire.code(wire.DTYPES, q.dtype),
            wire.code(_DEVICES, q.device.type), int(bool(causal)), wire.float_bits(scale), int(bool(backward)),
            documents_code(documents), text_code(variant) if variant else 0)


def documents_code(rows):
    """A nonzero signed int64 digest of document lengths (a sequence of tuples of ints, one per batch row), 0 for
    None. Equal lengths give equal digests on every rank; different ones collide with probability 2^-64."""
    if rows is None:
        return 0
    h = hashlib.sha256()
    for row in rows:
        h.update(struct.pack(f"<q{len(row)}q", len(row), *row))
    code = int.from_bytes(h.digest()[:8], "little", signed=True)
    return code or 1


def text_code(text):
    """A signed int64 digest of a text (an argument's canonical wording), for values that are not one int: equal
    texts give equal digests on every rank; different ones collide with probability 2^-64."""
    return int.from_bytes(hashlib.sha256(str(text).encode()).digest()[:8], "little", signed=True)


def _show(field, value):
    if field == "dtype":
        return wire.dtype_name(value)
    if field == "device":
        return _DEVICES[value] if value < len(_DEVICES) else "other"
    if field == "softmax_scale":
        s = wire.bits_float(value)
        return "default" if math.isnan(s) else repr(s)
    if field == "documents":
        return "none" if value == 0 else f"lengths digest {value % (1 << 64):016x}"
    if field in ("causal", "backward"):
        return str(bool(value))
    if field == "phase":
        return _PHASES[value]
    if field == "plan":
        return f"{value % (1 << 64):016x}"
    return str(value)


def group_timeout(group):
    """The timeout the process group was created with (None when torch does not say)."""
    for dev in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(dev).options._timeout
        except Exception:  # no backend for this device type, or an older torch without the attribute
            continue
    return None


def open_group(group, owner: str, remedy: str):
    """`group`, or, once close() has released it (None), a HexiseqError saying that `owner` is closed."""
    if group is None:
        raise HexiseqError(f"{owner} is closed: close() released its process groups; make a new {remedy}")
    return group


class Comm:
    """One rank's communication for a plan over `group` (default: the world). Collective to build: every rank
    of the group calls it with the same plan (a hexiseq.schedule.PassLayout). topology: its
    hexiseq.runtime.topology.Topology."""

    def __init__(self, plan, topology, group=None, causal=True, softmax_scale=None, timeout=None, subgroups=None,
                 agreed=False):
        """subgroups: where the subgroups come from instead of being made here, a function (global ranks, backend
        or None) -> process group, whose groups this object then neither makes nor destroys (the batch runtime's:
        it makes every group a step needs on every rank at once, see hexiseq.runtime.batch). agreed: every rank of
        the group is known to hold this plan, causal and softmax_scale (the batch runtime's step compared a
        fingerprint that covers every pass's plan), so the comparison at construction, a collective, is skipped."""
        self._group = resolve_group(group)
        self._subgroups = subgroups
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.timeout = timeout if timeout is not None else group_timeout(self.group)
        # Seconds this rank spent per phase since the last reset: "attn" (block kernels and merges), "a2a" (the
        # all-to-all calls), "ring_wait" (waiting for ring transfers and shared-head reductions the kernels did
        # not hide), "sync" (the call checks: each waits for every rank to reach the call, so a rank ahead of a
        # slower one waits there; the cost model puts that time in the slower rank's phases). With sync_timing
        # set, CUDA work is synchronised at every phase boundary so the clock sees the device, not the launches
        # (slower: for measurement only).
        self.phase_s = {"attn": 0.0, "a2a": 0.0, "ring_wait": 0.0, "sync": 0.0}
        self.p2p_bytes = 0  # bytes this rank has sent by P2P (ring steps, accumulators, co-holders' pieces)
        self.sync_timing = False
        self._global = [self._global_rank(r) for r in range(self.world)]
        self._check_construction(plan, causal, softmax_scale, agreed)
        backend = str(dist.get_backend(self.group))
        local = self.group is not dist.group.WORLD
        # The call descriptors travel on a CPU group: the group itself where it has Gloo, else a Gloo twin.
        if "gloo" in backend:
            self._cpu_group = self.group
        elif subgroups is not None:
            self._cpu_group = subgroups(tuple(self._global), "gloo")
        else:
            self._cpu_group = self._new_group(self._global, "gloo", local)
        # HP subgroups: every rank of `group` creates every HP group, in ring order. On the world, plainly: every
        # rank takes part in every creation, so the group names (a counter all ranks advance together) agree. On
        # a smaller group (another data-parallel replica with its own plan, say), with local synchronisation, so
        # ranks outside `group` need not take part. torch names a locally synchronised group by its ranks and by
        # how many groups the creating process holds, which differs between the members of an earlier partial
        # subgroup and the others: on the world that made a later all-ranks subgroup hang in its rendezvous.
        self.hp_group = None
        self.hp_order = [0]
        self.hp_me = 0  # this rank's place in its group's member order
        my_group = topology.group_of(self.rank)
        for g, members in enumerate(topology.groups):
            ranks = [self._global[mb.rank] for mb in members]
            if subgroups is not None:  # only its own group, made elsewhere
                pg = subgroups(tuple(ranks), None) if len(ranks) > 1 and g == my_group else None
            else:
                pg = self._new_group(ranks, None, local) if len(ranks) > 1 else None
            if g == my_group:
                self.hp_me = [mb.rank for mb in members].index(self.rank)
            if g == my_group and pg is not None:
                self.hp_group = pg
                # all_to_all_single orders its splits by rank inside the subgroup, not by our member order
                pos = [dist.get_group_rank(pg, r) for r in ranks]
                self.hp_order = sorted(range(len(ranks)), key=lambda i: pos[i])

    @property
    def group(self):
        """The process group the plan runs over; after close() a HexiseqError (a closed context holds no group)."""
        return open_group(self._group, "this HexiSeq context", "context to run the plan again")

    def _new_group(self, ranks, backend, local):
        kw = {"timeout": self.timeout} if self.timeout is not None else {}
        return dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=local, **kw)

    def _global_rank(self, r):
        if self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    # ------------------------------------------------------------------------------------------ the contract

    def _check_construction(self, plan, causal, softmax_scale, agreed=False):
        self.plan_code = plan_code(plan)
        if agreed:
            if plan.num_devices != self.world:  # the same on every rank: the plan is agreed
                raise InvalidArgumentError(f"the plan places {plan.num_devices} devices but the process "
                                           f"group has {self.world} ranks")
            return
        mine = torch.tensor([self.plan_code, plan.num_devices, int(bool(causal)),
                             wire.float_bits(softmax_scale)], dtype=torch.int64, device=collective_device(self.group))
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        every = [t.tolist() for t in every]
        if any(e[0] != every[0][0] for e in every):
            fps = ", ".join(f"rank {r}: {(e[0] % (1 << 64)):016x}" for r, e in enumerate(every))
            raise RankMismatchError(f"ranks disagree about the plan (fingerprints {fps}); every rank must use the "
                                    "same plan")
        if every[0][1] != self.world:
            raise RankMismatchError(f"the plan places {every[0][1]} devices but the process group has {self.world} "
                                    "ranks")
        for i, field in ((2, "causal"), (3, "softmax_scale")):
            if any(e[i] != every[0][i] for e in every):
                raise RankMismatchError(_disagreement(field, [e[i] for e in every]))

    def agree(self, call, error=None):
        """Compare this call's descriptor (describe_call) with every rank's, and learn whether any rank's inputs
        failed validation (`error`, the exception this rank would raise, or None). Raises the same error on
        every rank when they do not all agree and pass."""
        group = self.group  # raises on a closed context, before any collective
        t0 = time.perf_counter()
        try:
            # messages name global ranks: a plan over a subgroup (a batch plan's pass) numbers its devices from 0
            agree(self._cpu_group, call, CALL_FIELDS, error, ranks=None if group is dist.group.WORLD else
                  self._global)
        finally:
            self.phase_s["sync"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------ transfers

    def clock(self, device=None):
        if self.sync_timing and device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def wait(self, reqs, device):
        """Wait for posted P2P requests; the time counts as exposed ring communication."""
        t0 = self.clock(device)
        for r in reqs:
            r.wait()
        self.phase_s["ring_wait"] += self.clock(device) - t0

    def a2a(self, send_parts, recv_shapes, counts, unit, dtype, device):
        """Uneven all-to-all inside the HP group: send_parts[j], a list of tensors laid end to end, to member j;
        returns, per member, the received tensors shaped as recv_shapes[j] says. Members are in the topology's
        order. counts: the topology's (sent, received) elements per member, in `unit`s (batch x head_dim): the
        parts must be exactly what it says (what the cost model charges, tests/test_topology.py)."""
        return self.a2a_finish(self.a2a_start(send_parts, recv_shapes, counts, unit, dtype, device))

    def a2a_start(self, send_parts, recv_shapes, counts, unit, dtype, device):
        """Post the all-to-all of a2a() without waiting for it; a2a_finish(handle) returns what a2a() returns.

        Each part is copied once, straight into its place in the send buffer, and a member's own part is not
        copied at all: it travels with a zero split and comes back as the tensors it was given (reshaped to its
        receive shapes when they differ)."""
        if [sum(p.numel() for p in parts) for parts in send_parts] != [unit * n for n, _ in counts] or \
                [sum(math.prod(s) for s in shapes) for shapes in recv_shapes] != [unit * n for _, n in counts]:
            raise HexiseqError("internal: the all-to-all sends differ from the plan's topology")
        me = self.hp_me
        own = [p if tuple(p.shape) == tuple(s) else p.reshape(s) for p, s in zip(send_parts[me], recv_shapes[me])]
        if len(send_parts) == 1:
            return None, [own], device
        order = self.hp_order
        sizes = [0 if i == me else unit * counts[i][0] for i in order]
        recv_numels = [0 if i == me else unit * counts[i][1] for i in order]
        send = torch.empty(sum(sizes), dtype=dtype, device=device)
        at = 0
        for i in order:
            if i == me:
                continue
            for p in send_parts[i]:
                send[at:at + p.numel()].view(p.shape).copy_(p)
                at += p.numel()
        recv = torch.empty(sum(recv_numels), dtype=dtype, device=device)
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_numels, input_split_sizes=sizes,
                                      group=self.hp_group, async_op=True)
        return work, (recv, recv_numels, send, own, recv_shapes), device

    def a2a_finish(self, handle):
        """Wait for a posted all-to-all (the wait counts as exposed all-to-all time); the received parts, per
        member a list of tensors of its receive shapes."""
        work, got, device = handle
        if work is None:
            return got
        recv, recv_numels, _send, own, recv_shapes = got
        t0 = self.clock(device)
        work.wait()
        self.phase_s["a2a"] += self.clock(device) - t0
        parts = torch.split(recv, recv_numels)
        out = [None] * len(self.hp_order)
        for j, i in enumerate(self.hp_order):
            if i == self.hp_me:
                out[i] = own
                continue
            pieces, at = [], 0
            for shape in recv_shapes[i]:
                n = math.prod(shape)
                pieces.append(parts[j][at:at + n].view(shape))
                at += n
            out[i] = pieces
        return out

    def exchange(self, sends, recvs, send_tensor_of, recv_shape_of, dtype, device, tag):
        """Post a batch of asynchronous sends and receives: sends/recvs are (plan rank, lo, n) routes,
        send_tensor_of(lo, n) the tensor to send, recv_shape_of(lo, n) the shape to receive. Returns (requests,
        [(lo, n, received tensor)], the sent tensors, kept alive until the requests complete)."""
        posted, keep, out = [], [], []
        for peer, lo, n in sends:
            t = send_tensor_of(lo, n).contiguous()
            if t.numel():
                keep.append(t)
                posted.append(dist.P2POp(dist.isend, t, self._global[peer], tag=tag))
                self.p2p_bytes += t.numel() * t.element_size()
        for peer, lo, n in recvs:
            t = torch.empty(recv_shape_of(lo, n), dtype=dtype, device=device)
            out.append((lo, n, t))
            if t.numel():
                posted.append(dist.P2POp(dist.irecv, t, self._global[peer], tag=tag))
        reqs = dist.batch_isend_irecv(posted) if posted else []
        return reqs, out, keep

    def close(self):
        """Release the subgroups this object created, and let go of every process group it holds, the parent group
        too: a group still referenced when destroy_process_group() runs outlives it, and so do its Gloo threads,
        into interpreter shutdown (see the import of torch.distributed.nn.functional above). Idempotent."""
        if self._group is None:
            return
        groups = [self.hp_group] + ([self._cpu_group] if self._cpu_group is not self._group else [])
        if self._subgroups is not None:
            groups = []  # made, and destroyed, by whoever gave them
        self.hp_group = self._cpu_group = self._group = self._subgroups = None
        for pg in groups:
            if pg is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(pg)
                except (RuntimeError, ValueError):
                    pass  # already destroyed with the whole world


def resolve_group(group):
    """The process group of `group`: a process group, a one-dimensional torch DeviceMesh (a dimension of the job's
    mesh, e.g. mesh["cp"] of a torchtitan-style mesh: its group), or the world when None. Raises HexiseqError when
    torch.distributed is not initialised, InvalidArgumentError for a mesh of several dimensions (which group of
    it is meant is the caller's to say)."""
    if not dist.is_available() or not dist.is_initialized():
        raise HexiseqError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    if group is None:
        return dist.group.WORLD
    if type(group).__name__ == "DeviceMesh" and hasattr(group, "get_group"):
        if group.ndim != 1:
            raise InvalidArgumentError(f"group must be a process group or a one-dimensional DeviceMesh (one "
                                       f"dimension of the job's mesh, e.g. mesh['cp']), got a DeviceMesh of "
                                       f"{group.ndim} dimensions {list(group.mesh_dim_names or ())}")
        return group.get_group()
    return group


def collective_device(group):
    """The device the group's collectives take tensors on: the current CUDA device on an NCCL-only group, else
    the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, values, fields, error=None, show=_show, device=None, words=None, free=(), ranks=None):
    """Compare `values` (ints, the fields in order) with every rank's over `group`, and learn whether any rank
    failed validation (`error`, the exception this rank would raise, or None). Raises the same HexiseqError on
    every rank when they do not all pass and agree: the ranks' errors (their class when every failing rank raised
    the same HexiseqError class, else InvalidArgumentError) naming the ranks that failed and their messages, else
    RankMismatchError naming the first field that differs with every rank's value, and the other fields that
    differ. Every rank must send as many values: a rank that failed sends placeholders. fields: field names, one
    int each, or (name, width) for a field of `width` ints; show(name, value) words a value (an int, or a list for
    a wide field). words: this rank's value of each field in words (a list in fields order), for fields that
    travel as digests: gathered (one more collective, which every rank makes) only when the ranks disagree.
    free: names of fields that may differ between ranks (gathered, not compared: a rank's own token count, say).
    ranks: how messages name the group's ranks (their global ranks, say; default: their rank in the group)."""
    world = dist.get_world_size(group)
    if world == 1:  # no one to agree with: the same outcome without a collective (it is paid on every call)
        if error is not None:
            cls = type(error) if isinstance(error, HexiseqError) else InvalidArgumentError
            raise cls(f"invalid input on 1 of 1 ranks (rank {0 if ranks is None else ranks[0]}: {error})")
        return [list(values)]
    mine = torch.tensor([0 if error is None else 1, *values], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    if any(e[0] for e in every):
        # one more (rare) collective, which every rank makes since every rank saw the flag
        messages = [None] * world
        dist.all_gather_object(messages, None if error is None else (type(error).__name__, str(error)),
                               group=group)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        text = "; ".join(f"rank {r if ranks is None else ranks[r]}: {m}" for r, (_, m) in failed)
        kinds = {kind for _, (kind, _) in failed}
        cls = getattr(errors_module, kinds.pop(), None) if len(kinds) == 1 else None
        if not (isinstance(cls, type) and issubclass(cls, HexiseqError)):
            cls = InvalidArgumentError
        raise cls(f"invalid input on {len(failed)} of {world} ranks ({text})")
    at, differ = 1, []
    for i, field in enumerate(fields):
        name, width = (field, 1) if isinstance(field, str) else field
        got = [e[at] if isinstance(field, str) else e[at:at + width] for e in every]
        if name not in free and any(g != got[0] for g in got):
            differ.append((i, name, got))
        at += width
    if differ:
        i, name, got = differ[0]
        also = [n for _, n, _ in differ[1:]]
        if words is not None:
            said = [None] * world
            dist.all_gather_object(said, [str(w) for w in words], group=group)
            got, show = [s[i] for s in said], lambda _field, value: value
        raise RankMismatchError(_disagreement(name, got, show, also, ranks))
    return [e[1:] for e in every]


def _disagreement(field, values, show=_show, also=(), ranks=None):
    shown = ", ".join(f"rank {r if ranks is None else ranks[r]}: {show(field, v)}" for r, v in enumerate(values))
    more = ""
    if also:
        listed = ", ".join(also[:8]) + (f" and {len(also) - 8} more" if len(also) > 8 else "")
        more = f"; they also disagree about {listed}"
    return f"ranks disagree about {field} ({shown}){more}; every rank must make the same call"
