"""The runtime's attention as torch.library custom ops, the path hexiseq.nn.hexiseq_attn_func takes under
torch.compile: the whole layer (agreement, all-to-alls, ring, block kernels, timers) is one opaque op forward and one
backward, so Dynamo traces a model around it without a graph break (fullgraph=True works) and never looks inside.

- hexiseq::attention(q, k, v, context, backward, documents, window, softcap, sinks) -> (out, handle). `context`
  names a HexiSeqContext (register()); `handle` is a 0-d int64 tensor that keys what the backward needs, which the
  op keeps in the context (its saved tensors may be the inputs themselves, which a custom op may not return).
  window, softcap, sinks: the layer's variant (hexiseq.runtime.variants), or None.
- hexiseq::attention_backward(dout, handle, q, k, v, context, documents, window, softcap, sinks) -> (dq, dk, dv[,
  dsinks]); q, k, v only give the fake implementation its shapes.
Eager calls keep the autograd Function of hexiseq.runtime.nn (no custom-op dispatch on the hot path); both run the
same context methods, so compiled and eager results are the same numbers.
"""

import itertools
import weakref
from typing import List, Optional

import torch

from ..errors import HexiseqError

_contexts = weakref.WeakValueDictionary()  # id -> HexiSeqContext
_ids = itertools.count(1)


def register(context) -> int:
    """The id the ops know `context` by (made once per context)."""
    cid = getattr(context, "_op_id", None)
    if cid is None:
        cid = next(_ids)
        context._op_id = cid
        context._op_saved = {}
        context._op_next = itertools.count(1)
        _contexts[cid] = context
    return cid


def _context(cid):
    context = _contexts.get(cid)
    if context is None:
        raise HexiseqError(f"internal: no HexiSeq context {cid} (closed, or made in another process)")
    return context


def _documents(documents):
    return None if documents is None else tuple(int(x) for x in documents)


def _variant(window, softcap):
    from .variants import Variant
    return Variant(None if window is None else (int(window[0]), int(window[1])), softcap)


@torch.library.custom_op("hexiseq::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, backward: bool,
              documents: Optional[List[int]], window: Optional[List[int]], softcap: Optional[float],
              sinks: Optional[torch.Tensor]) -> List[torch.Tensor]:
    ctx = _context(context)
    o, saved = ctx.forward(q, k, v, backward, _documents(documents), _variant(window, softcap), sinks)
    handle = 0
    if backward:
        handle = next(ctx._op_next)
        ctx._op_saved[handle] = saved
    # nor may it share storage with what the op keeps for its backward (the output of a rank alone in its group is
    # the attention's own Og): the compiled graph owns its outputs and may reuse their memory
    kept = [t for s in saved for t in (*s[:3], *s[3])] if backward else []
    token = torch.tensor(handle, dtype=torch.int64)
    if backward:
        # what the backward needs lives as long as the handle, which autograd keeps for the backward: a graph
        # dropped without its backward (an evaluation with gradients on, a skipped step) frees it, as eager does
        weakref.finalize(token, ctx._op_saved.pop, handle, None)
    return _unaliased([o], (q, k, v, *kept)) + [token]


def _unaliased(outputs, inputs):
    """The outputs, each cloned where it shares storage with an input or an earlier output (a custom op's outputs
    may alias nothing: dK and dV, say, come out of one [2, ...] accumulator)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return out


@attention.register_fake
def _attention_fake(q, k, v, context, backward, documents, window, softcap, sinks):
    return [q.new_empty(q.shape), torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("hexiseq::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       context: int, documents: Optional[List[int]], window: Optional[List[int]],
                       softcap: Optional[float], sinks: Optional[torch.Tensor]) -> List[torch.Tensor]:
    ctx = _context(context)
    saved = ctx._op_saved.pop(int(handle), None)
    if saved is None:
        raise HexiseqError("internal: a compiled HexiSeq attention's backward ran twice or without its forward")
    grads = ctx.backward(dout.contiguous(), saved, _documents(documents), _variant(window, softcap), sinks)
    return _unaliased(list(grads), (dout, q, k, v) + (() if sinks is None else (sinks,)))


@attention_backward.register_fake
def _attention_backward_fake(dout, handle, q, k, v, context, documents, window, softcap, sinks):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + ([] if sinks is None else [sinks.new_empty(sinks.shape)])


def _setup_context(ctx, inputs, output):
    q, k, v, context, backward, documents, window, softcap, sinks = inputs
    ctx.context, ctx.documents, ctx.window, ctx.softcap = context, documents, window, softcap
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(output[1], q, k, v, *([sinks] if sinks is not None else []))


def _backward(ctx, grads):
    handle, q, k, v, *sinks = ctx.saved_tensors
    sinks = sinks[0] if ctx.has_sinks else None
    out = attention_backward(grads[0], handle, q, k, v, ctx.context, ctx.documents, ctx.window, ctx.softcap, sinks)
    return out[0], out[1], out[2], None, None, None, None, None, out[3] if sinks is not None else None


attention.register_autograd(_backward, setup_context=_setup_context)


def attn(q, k, v, context, backward, documents, variant=None, sinks=None):
    """hexiseq_attn_func's compiled path: the output of hexiseq::attention. documents: one list for the whole batch
    (a frozen tuple of ints) or None; variant: a hexiseq.runtime.variants.Variant or None; sinks: [heads] or None.
    The context was registered when it was made (register() mutates it, which a traced function should not)."""
    window = None if variant is None or variant.window is None else list(variant.window)
    softcap = None if variant is None else variant.softcap
    return attention(q, k, v, context._op_id, backward, None if documents is None else list(documents), window,
                     softcap, sinks)[0]
