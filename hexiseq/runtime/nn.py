"""Execute a HexiSeq plan in PyTorch: attention over torch.distributed (NCCL on GPUs, Gloo on CPU).

Each rank holds its token shard (`plan.shard(x, dim, rank)`; rank r is cluster device r). The public layer is
here; the work is in rooms of one concern each:
- hexiseq.runtime.topology: who holds which heads and tokens, who sends what to whom (no processes);
- hexiseq.runtime.comm: process groups, the all-to-all, tagged P2P, timers, and the contract that ranks which disagree
  fail together with the same error instead of aborting or hanging;
- hexiseq.runtime.ring: one layer forward and backward (all-to-all in, ring attention, all-to-all out);
- hexiseq.runtime.blocks: the attention of one block pair, the C kernels or the PyTorch path, chosen once per dtype;
- hexiseq.runtime.documents: packed documents per call, checked, and turned into each query chunk's document starts.
"""

import atexit
import math
import weakref
from typing import Optional

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover
    raise ImportError("hexiseq.nn needs PyTorch (pip install torch)") from e

from . import blocks, compiled, fused, ring
from . import documents as documents_mod
from .variants import PLAIN, variant as make_variant
from .comm import Comm, describe_call, resolve_group
from .. import geometry
from ..schedule import as_pass
from ..errors import InvalidArgumentError, UnsupportedError
from .topology import Topology

__all__ = ["HexiSeqAttention", "HexiSeqContext", "hexiseq_attn_func", "gather_sequence", "BatchContext", "BatchStep",
           "Pass", "BatchAttention", "TiledMLP", "tiled_cross_entropy", "OffloadCheckpoints", "offloaded_checkpoint"]

_live_contexts = weakref.WeakSet()


def close_at_exit(context):
    """Have the exit hook close `context` (anything with close()) unless it is closed or gone by then."""
    _live_contexts.add(context)


@atexit.register
def _close_contexts():
    for context in list(_live_contexts):
        context.close()


class HexiSeqContext:
    """Everything one rank needs to execute a plan: its topology, its communication, its block kernels. Build it
    once (collective: every rank of `group` calls it with the same plan, causal and softmax_scale) and reuse it
    for every layer; `HexiSeqAttention` does that for you.

    Ranks that disagree (about the plan at construction; about batch, head dim, dtype, causal, scale, whether
    a backward follows or the documents at a call) or whose inputs fail validation raise the same HexiseqError
    on every rank instead of aborting or hanging. timeout: for the subgroups it creates (default: the group's own).
    a2a_slices: how many slices of kv heads a layer is pipelined in, so that all-to-alls travel while attention
    runs (default: HEXISEQ_A2A_SLICES, else 1; see hexiseq.runtime.ring.slice_count). subgroups: see
    hexiseq.runtime.comm.Comm (the batch runtime passes the groups it made for the whole step), and so does agreed
    (the batch runtime has compared the step's plan, which covers this one, on every rank)."""

    def __init__(self, plan, group=None, causal: bool = True, softmax_scale: Optional[float] = None, timeout=None,
                 a2a_slices: Optional[int] = None, subgroups=None, agreed: bool = False):
        self.pass_layout = as_pass(plan, "HexiSeqContext")  # all the context reads of the plan: plain data
        # the plan of that one layout, for the callers that ask it (hexiseq.rebalance)
        self.plan = plan.one_layout("HexiSeqContext") if hasattr(plan, "one_layout") else plan
        self.causal = bool(causal)
        self.scale = softmax_scale
        self.topology = Topology(self.pass_layout, self.causal)
        self.comm = Comm(self.pass_layout, self.topology, group, self.causal, softmax_scale, timeout, subgroups,
                         agreed)
        self.slices = self.topology.slices(ring.slice_count(self.topology, a2a_slices))
        close_at_exit(self)
        self.world, self.rank = self.comm.world, self.comm.rank
        self.me = self.topology.member(self.rank)
        self._kernels = {}  # one BlockKernels per (device, dtype), decided at first use
        self._documents = {}  # (document lengths, device) -> the rank's document mask (chunk_starts), recent ones
        compiled.register(self)  # the id torch.compile's custom ops know this context by (hexiseq.runtime.compiled)

    # Seconds per phase since reset_timers() ("attn", "a2a", "ring_wait", "sync"; see hexiseq.runtime.comm), and whether CUDA
    # work is synchronised at phase boundaries so the clock sees the device (for measurement only).
    phase_s = property(lambda self: self.comm.phase_s)
    sync_timing = property(lambda self: self.comm.sync_timing,
                           lambda self, on: setattr(self.comm, "sync_timing", bool(on)))
    kernel_s = property(lambda self: self.comm.phase_s["attn"],
                        lambda self, s: self.comm.phase_s.__setitem__("attn", float(s)),
                        doc="Seconds spent inside attention kernels since the last reset (phase_s['attn']).")

    def reset_timers(self):
        for key in self.comm.phase_s:
            self.comm.phase_s[key] = 0.0

    group = property(lambda self: self.comm.group, doc="The process group the plan runs over (the world by default); "
                     "after close() a HexiseqError.")

    def close(self):
        """Release this context's subgroups and its references to every process group, the parent group too. Call it
        before torch.distributed.destroy_process_group(); an exit hook does it otherwise, before the interpreter
        finalises. A Gloo process group still referenced when destroy_process_group() runs outlives it with its
        worker threads, and a worker still letting go of the last collective's tensor when the interpreter finalises
        aborts the process. Idempotent; a closed context raises HexiseqError when called."""
        self.comm.close()

    def _scale(self, d):
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def _input_error(self, q, k, v):
        """The InvalidArgumentError this rank's inputs deserve, or None."""
        for name, t, heads in (("q", q, self.topology.heads), ("k", k, self.topology.kv_heads),
                               ("v", v, self.topology.kv_heads)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                return InvalidArgumentError(f"{name} must be a 4-D tensor [batch, tokens, heads, head_dim], got "
                                            f"{type(t).__name__}{list(t.shape) if isinstance(t, torch.Tensor) else ''}")
            if t.shape[1] != self.me.tokens or t.shape[2] != heads:
                return InvalidArgumentError(f"{name} must be [batch, {self.me.tokens}, {heads}, head_dim] on rank "
                                            f"{self.rank} under this plan{self._global_note()}, got {list(t.shape)}")
        if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            return InvalidArgumentError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not agree")
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            return InvalidArgumentError(f"q, k and v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                                        f"on {q.device}/{k.device}/{v.device}")
        if q.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            return InvalidArgumentError(f"q dtype must be float64, float32, bfloat16 or float16, got {q.dtype}")
        return None

    def _global_note(self):
        """', global rank g' where the plan's rank numbering (its group's) is not the world's."""
        g = dist.get_global_rank(self.group, self.rank) if self.group is not dist.group.WORLD else self.rank
        return "" if g == self.rank else f" (global rank {g})"

    def _call(self, phase, t, error, backward, documents, variant=""):
        """Agree on a call with every rank (raising the same error on all when any fails or they differ); the
        document mask of this rank's query chunks, or None. variant: the layer's variant as a text."""
        if error is None:
            error, lengths = documents_mod.check(documents, self.pass_layout.seq_len, self.causal, t.shape[0])
        if error is not None:
            t, lengths = torch.empty(0, 0, 0, 0), None
        rows = None if lengths is None else lengths if isinstance(lengths[0], tuple) else (lengths,) * t.shape[0]
        self.comm.agree(describe_call(self.comm.plan_code, phase, t, self.causal, self.scale, backward, rows, variant),
                        error)
        if lengths is None:
            return None
        # Every layer's forward and backward of a step pass the same documents: their mask is built and copied to
        # the device once (a host-to-device copy waits for the device, which kept the host from running ahead).
        key = (lengths, t.device)
        docs = self._documents.get(key)
        if docs is None:
            if len(self._documents) >= 8:
                self._documents.pop(next(iter(self._documents)))
            docs = self._documents[key] = documents_mod.chunk_starts(self.topology, self.rank, lengths, t.device)
        return docs

    def refuse(self, error):
        """Take part in a forward call's agreement with `error`, found on this rank before the call (an adapter's
        own check of its inputs), so that every rank raises the same error at once instead of this rank raising
        while the others wait in the call until the group's timeout. Always raises."""
        self._call("forward", None, error, False, None)
        raise error  # not reached: the agreement raises on every rank when one rank brings an error

    def forward(self, q, k, v, backward: bool = False, documents=None, variant=PLAIN, sinks=None,
                lse: bool = False):
        """q [B, s_r, A, d], k/v [B, s_r, A_kv, d] -> (o [B, s_r, A, d], what backward needs), and with lse the
        log-sum-exp [B, A, s_r] third (hexiseq.runtime.ring.layer_lse). backward: whether this rank will run the
        backward of this call (every rank must agree, as about lse). documents, variant (a
        hexiseq.runtime.variants.Variant) and sinks ([A] or None): see hexiseq_attn_func."""
        error = self._input_error(q, k, v) or _sinks_error(sinks, self.topology.heads)
        docs = self._call("forward", q, error, backward, documents, _describe(variant, sinks) + (" lse" if lse else ""))
        kern = self._block_kernels(q)
        o, saved = ring.layer_forward(self.comm, self.slices, kern, q, k, v, self.causal, self._scale(q.shape[3]),
                                      docs, variant, sinks)
        if not lse:
            return o, saved
        return o, saved, ring.layer_lse(self.comm, self.slices, saved, q.shape, q.device)

    def backward(self, do, saved, documents=None, variant=PLAIN, sinks=None):
        """dO of this rank's output and forward's saved tensors -> (dq, dk, dv), and with sinks their gradient
        (this rank's part, see hexiseq.runtime.ring.layer_backward). documents, variant, sinks: the forward's."""
        docs = self._call("backward", do, None, True, documents, _describe(variant, sinks))
        kern = self._block_kernels(do)
        return ring.layer_backward(self.comm, self.slices, kern, do, saved, self.causal, self._scale(do.shape[3]),
                                   docs, variant, sinks)


    def _block_kernels(self, t):
        """The BlockKernels for t's device and dtype; on the first call for a GPU, the block backends a calibration
        of the plan's cluster chose for this rank's device are adopted (hexiseq.runtime.fused.prefer), so the
        runtime runs what the cost model priced instead of measuring again."""
        if (t.device, t.dtype) not in self._kernels and t.device.type == "cuda":
            adopt_calibrated_backends(self.pass_layout, self.rank, t.device, t.dtype)
        return blocks.kernels_for(t.device, t.dtype, self._kernels)


def adopt_calibrated_backends(plan, rank, device, dtype):
    """Prefer the block backends recorded for cluster device `rank` by the calibration the plan's cluster came
    from (calibration.block_backends), where it measured this dtype; a cluster without one changes nothing."""
    cal = as_pass(plan).calibration or {}
    chosen = cal.get("block_backends")
    if (not isinstance(chosen, list) or len(chosen) != as_pass(plan).num_devices or not isinstance(chosen[rank], dict)
            or cal.get("dtype") != str(dtype).replace("torch.", "") or "head_dim" not in cal):
        return
    fused.prefer(device, dtype, cal["head_dim"], **{k: chosen[rank].get(k) for k in ("pairs", "documents")})


def _describe(variant, sinks):
    return variant.describe() + (" sinks" if sinks is not None else "")


def _sinks_error(sinks, heads):
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,) or not sinks.is_floating_point():
        return InvalidArgumentError(f"sinks must be a floating tensor [heads] = [{heads}], got "
                                    f"{type(sinks).__name__}{list(sinks.shape) if isinstance(sinks, torch.Tensor) else ''}")
    return None


class _HexiSeqAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, context, backward, documents, variant=PLAIN, sinks=None, lse=False):
        o, saved, *rest = context.forward(q, k, v, backward, documents, variant, sinks, lse)
        ctx.context, ctx.documents, ctx.variant, ctx.sinks = context, documents, variant, sinks
        ctx.n_lse = [len(s[3]) for s in saved]  # per slice: Qg, KV, Og, then its lse chunks
        ctx.save_for_backward(*[t for s in saved for t in (*s[:3], *s[3])])
        if lse:
            ctx.mark_non_differentiable(rest[0])  # as flash-attn's: the lse is returned, not differentiated
            return o, rest[0]
        return o

    @staticmethod
    def backward(ctx, do, *_):
        flat, saved = list(ctx.saved_tensors), []
        for n in ctx.n_lse:
            saved.append((*flat[:3], flat[3:3 + n]))
            flat = flat[3 + n:]
        grads = ctx.context.backward(do, saved, ctx.documents, ctx.variant, ctx.sinks)
        dsinks = grads[3] if ctx.sinks is not None else None
        return grads[0], grads[1], grads[2], None, None, None, None, dsinks, None


def hexiseq_attn_func(q, k, v, context: HexiSeqContext, documents=None, window=None, softcap=None, sinks=None,
                      return_lse: bool = False):
    """Attention of this rank's token shard under a plan, with autograd.

    q: [batch, s_r, heads, head_dim]; k, v: [batch, s_r, kv_heads, head_dim], where s_r is this rank's token
    count in the plan (`plan.devices.tokens` of its slot; shard with `plan.shard(x, 1, rank)`). A rank the plan
    parks calls it too, with its empty shard (s_r = 0), since its collectives are part of every rank's.
    documents: packed sequences, per call: the documents' lengths in sequence order over the FULL sequence (ints
    > 0 summing to plan.seq_len), one list for every batch row or one list per batch row; a query then sees only
    the keys of its own document, up to itself (document-causal; needs a causal context). Every rank passes the
    same documents (checked: a digest travels with the call). None: one causal document per sequence.

    window, softcap, sinks: the layer's attention variant, per call (layers of one model may differ: sliding and
    global layers share one context). window: (left, right) as in hexiseq.ops.attention_forward (a Hugging Face
    sliding_window of W tokens is (W - 1, 0)); block pairs that lie outside every query's window are skipped.
    softcap: logit soft-capping. sinks: the layer's sink logits [heads] (a parameter: it gets its gradient, this
    rank's part of it, summed over ranks with the other parameters). Every rank passes the same variant (checked).
    Returns the output [batch, s_r, heads, head_dim] for the same tokens; with return_lse, (output, lse): the
    log-sum-exp of each of the rank's tokens' scaled scores per head, [batch, heads, s_r] (flash-attn's layout),
    float32 (float64 for float64 inputs), sinks included, not differentiable (as flash-attn's). Every rank of the
    context's group must call it (it communicates), all with or all without gradients, all with or all without
    return_lse (checked)."""
    grads_of = (q, k, v) + ((sinks,) if sinks is not None else ())
    backward = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in grads_of)
    documents = documents_mod.frozen(documents)
    try:
        variant = make_variant(window, softcap, context.causal)
        if not isinstance(return_lse, bool):
            raise InvalidArgumentError(f"return_lse must be True or False, got {return_lse!r}")
    except InvalidArgumentError as error:  # every rank raises it, not this one alone while the others wait
        context.refuse(error)
    if torch.compiler.is_compiling():
        # under torch.compile the layer is one custom op each way: no graph break
        if return_lse:
            raise UnsupportedError("return_lse under torch.compile: keep this call out of the compiled region "
                                   "(torch.compiler.disable)")
        if isinstance(documents, tuple) and documents and isinstance(documents[0], tuple):
            raise UnsupportedError("per-row documents (one list per batch row) under torch.compile: give one "
                                   "document list for the whole batch, or keep this call out of the compiled "
                                   "region (torch.compiler.disable)")
        return compiled.attn(q, k, v, context, backward, documents, variant, sinks)
    if return_lse:
        return _HexiSeqAttentionFn.apply(q, k, v, context, backward, documents, variant, sinks, True)
    if variant.plain and sinks is None:
        return _HexiSeqAttentionFn.apply(q, k, v, context, backward, documents)
    return _HexiSeqAttentionFn.apply(q, k, v, context, backward, documents, variant, sinks)


class HexiSeqAttention(torch.nn.Module):
    """Drop-in attention for a model whose sequence is sharded by a HexiSeq plan.

    plan: a hexiseq.Plan whose devices are the ranks of `group` (rank r = cluster device r).
    group: the process group, or a one-dimensional torch DeviceMesh such as mesh["cp"] (default: the world).
    causal: causal masking by absolute positions.
    softmax_scale: default 1/sqrt(head_dim). timeout: for the subgroups it creates (default: the group's).
    a2a_slices: see HexiSeqContext. window, softcap: this layer's sliding window and logit soft-capping (see
    hexiseq_attn_func).
    Construction is collective: every rank checks the plan's fingerprint against the others'."""

    def __init__(self, plan, group=None, causal: bool = True, softmax_scale: Optional[float] = None, timeout=None,
                 a2a_slices: Optional[int] = None, window=None, softcap: Optional[float] = None):
        super().__init__()
        self.context = HexiSeqContext(plan, group=group, causal=causal, softmax_scale=softmax_scale, timeout=timeout,
                                      a2a_slices=a2a_slices)
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v, documents=None, sinks=None):
        """documents: the packed documents' lengths of this call (see hexiseq_attn_func), or None; sinks: the
        layer's sink logits [heads], or None."""
        return hexiseq_attn_func(q, k, v, self.context, documents, window=self.window, softcap=self.softcap,
                                 sinks=sinks)


def gather_sequence(x, plan, dim: int = 1, group=None):
    """All-gather every rank's shard of `x` along `dim` and return the full sequence in position order."""
    group = resolve_group(group)
    world = dist.get_world_size(group)
    pl = as_pass(plan, "gather_sequence")
    sizes = [pl.tokens(r) for r in range(world)]
    biggest = max(sizes)
    pad = list(x.shape)
    pad[dim] = biggest - x.shape[dim]
    xp = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
    bufs = [torch.empty_like(xp) for _ in range(world)]
    dist.all_gather(bufs, xp.contiguous(), group=group)
    shards = [b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)]
    return geometry.unshard(pl.layout, shards, dim, pl.num_devices)


_LAZY = {"BatchAttention": "batch", "BatchContext": "batch", "BatchStep": "batch", "Pass": "batch",
         "TiledMLP": "tiled", "tiled_cross_entropy": "tiled", "OffloadCheckpoints": "offload",
         "offloaded_checkpoint": "offload"}


def __getattr__(name):
    """The public names of the batch runtime (hexiseq.runtime.batch, which builds on this module), of the tiled
    token-local work (hexiseq.runtime.tiled) and of the offloaded checkpoints (hexiseq.runtime.offload), loaded on
    first use so that any of the modules may be imported first."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
