"""Attention over a process group without a cluster file or a plan, as ring-flash-attn's `ring_flash_attn_func(q, k, v,
group=...)` and yunchang's `LongContextAttention` are called: each rank passes its shard of the sequence and the
layout is made from the group and the shards' sizes.

- `group_attention(q, k, v, group=None, ...)`: every rank of `group` holds a contiguous shard of the sequence in rank
  order (chunking="contiguous", as ring-flash-attn's ring_flash_attn_func) or the zigzag pair of chunks r and
  2 world - 1 - r (chunking="zigzag", as its zigzag_ring_flash_attn_func and torch's context_parallel shard a causal
  sequence; with unequal shards, rank r's tokens are its front chunk then its back chunk, each half of them, the
  front chunk taking the extra token). Contiguous shards may be of any sizes (the ranks' token counts are gathered
  at each call): give a fast device more tokens. Zigzag takes ulysses=1. `ulysses` > 1 puts that many consecutive ranks in one head-parallel group (heads split as
  evenly as the kv heads allow), the groups in a ring, as yunchang's ulysses_degree x ring_degree.
  `cu_seqlens` (flash-attn's varlen form: cumulative lengths of the packed sequences over the WHOLE sequence, a
  list or a 1-D tensor starting at 0) masks each query to its own sequence.
- `GroupAttention(group=None, ...)`: the same as a module.
The layout is an ordinary hexiseq layout, so every path of the runtime (ring, all-to-all, documents, the contract
that refuses on every rank at once) is the one a plan runs. A context is made per (group, shapes, shares) and kept.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._validate import number
from ..errors import InvalidArgumentError
from ..planner.cluster import Cluster
from ..planner.model import Model
from ..planner.plan import evaluate
from ..runtime import wire
from ..runtime.comm import agree, collective_device, resolve_group
from ..runtime.nn import HexiSeqContext, hexiseq_attn_func

__all__ = ["group_attention", "GroupAttention", "sequence_parallel"]

_CHUNKINGS = ("contiguous", "zigzag")
_contexts = {}  # key -> HexiSeqContext
_KEPT = 16


def _layout(tokens, heads, kv_heads, ulysses, chunking):
    """{"groups": ...} for `tokens` per rank (rank order), `ulysses` consecutive ranks per group."""
    world = len(tokens)
    groups = []
    per_kv = heads // kv_heads
    for g0 in range(0, world, ulysses):
        members = list(range(g0, g0 + ulysses))
        # heads split in whole kv heads where they can be, the remainder to the first members
        base, extra = divmod(kv_heads, ulysses)
        kv = [base + (1 if i < extra else 0) for i in range(ulysses)]
        if base == 0:  # fewer kv heads than members: query heads split evenly instead
            hb, he = divmod(heads, ulysses)
            counts = [hb + (1 if i < he else 0) for i in range(ulysses)]
        else:
            counts = [n * per_kv for n in kv]
        groups.append({"devices": members, "seq": sum(tokens[r] for r in members),
                       "tokens": [tokens[r] for r in members], "heads": counts})
    return {"groups": groups, "chunking": chunking}


def _context(group, q, k, causal, scale, chunking, ulysses, error):
    """The context of this call's layout. Every call gathers the ranks' token counts with the call's other figures
    and any rank's refusal (hexiseq.runtime.comm.agree: one small all-gather), so that every rank decides alike
    whether the layout changed, and a rank whose arguments fail makes every rank raise the same error."""
    ok = error is None
    values = [q.shape[1] if ok else 0, q.shape[2] if ok else 0, k.shape[2] if ok else 0, q.shape[3] if ok else 0,
              _CHUNKINGS.index(chunking) if ok else -1, ulysses if ok else 0, int(bool(causal)),
              wire.float_bits(scale if ok else None)]
    # the scale too: the context is kept per scale, and ranks that made theirs with different scales would meet in
    # different collectives
    every = agree(group, values, ["tokens", "heads", "kv_heads", "head_dim", "chunking", "ulysses", "causal",
                                  "softmax_scale"], error, device=collective_device(group), free=("tokens",))
    world = len(every)
    tokens = [int(e[0]) for e in every]
    key = (id(group), tuple(q.shape[2:]), k.shape[2], causal, scale, chunking, ulysses, tuple(tokens))
    ctx = _contexts.get(key)
    if ctx is not None:
        return ctx
    H, d, Hkv = q.shape[2], q.shape[3], k.shape[2]
    model = Model(layers=1, hidden=H * d, heads=H, kv_heads=Hkv, head_dim=d, ffn=4 * H * d, vocab=8,
                     name="group-attention")
    cluster = Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": world, "intra_gbps": 300.0}]})
    plan = evaluate(cluster, model=model, seq_len=sum(tokens), causal=causal,
                       layout=_layout(tokens, H, Hkv, ulysses, chunking))
    ctx = HexiSeqContext(plan, group=group, causal=causal, softmax_scale=scale)
    if len(_contexts) >= _KEPT:
        _contexts.pop(next(iter(_contexts))).close()
    _contexts[key] = ctx
    return ctx


def _documents(cu_seqlens):
    """The sequences' lengths of flash-attn's cumulative cu_seqlens (0, then increasing integers)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor) and (cu_seqlens.is_floating_point() or cu_seqlens.is_complex()):
        raise InvalidArgumentError(f"cu_seqlens must hold integers, got a {cu_seqlens.dtype} tensor")
    c = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if any(isinstance(x, bool) or not isinstance(x, int) for x in c):
        raise InvalidArgumentError(f"cu_seqlens must hold integers, got {c[:8]}")
    if len(c) < 2 or c[0] != 0:
        raise InvalidArgumentError(f"cu_seqlens must start at 0 and hold at least one sequence, got {c[:8]}")
    for i in range(1, len(c)):
        if c[i] <= c[i - 1]:
            raise InvalidArgumentError(f"cu_seqlens must increase: cu_seqlens[{i}] = {c[i]} after {c[i - 1]}")
    return [b - a for a, b in zip(c[:-1], c[1:])]


def group_attention(q, k, v, group=None, *, causal: bool = True, softmax_scale: Optional[float] = None,
                    chunking: str = "contiguous", ulysses: int = 1, cu_seqlens: Optional[Sequence[int]] = None,
                    window=None, softcap: Optional[float] = None, sinks=None, return_lse: bool = False):
    """Attention of this rank's shard (q [batch, s_r, heads, d], k/v [batch, s_r, kv_heads, d]) of a sequence
    spread over the ranks of `group` (a process group or a one-dimensional DeviceMesh; default: the world) as
    `chunking` says; returns the output for the same tokens, with autograd. window, softcap, sinks: the layer's
    variant, as hexiseq.nn.hexiseq_attn_func takes them (a sliding window (left, right) by absolute positions, logit
    soft-capping, sink logits [heads]). return_lse: also return the log-sum-exp of each of the rank's tokens' scaled
    scores per head, [batch, heads, s_r] float32 (float64 for float64 inputs), not differentiable, as flash-attn's
    functions return it: (output, lse). Collective: every rank of the group calls it with the same heads, chunking,
    ulysses, cu_seqlens, variant and return_lse (checked, as every call of the runtime: a rank that differs makes every rank
    raise the same error). Each call gathers the ranks' token counts (one small all-gather) before the layer. See
    the module's docstring."""
    group = resolve_group(group)
    error, documents = _arguments_error(group, q, k, v, chunking, ulysses) or _scale_error(softmax_scale), None
    if error is None:
        try:
            documents = _documents(cu_seqlens)
        except InvalidArgumentError as e:
            error = e
    ctx = _context(group, q, k, bool(causal), softmax_scale, chunking, ulysses, error)
    return hexiseq_attn_func(q, k, v, ctx, documents=documents, window=window, softcap=softcap, sinks=sinks,
                             return_lse=return_lse)


def _scale_error(scale):
    try:
        number(scale, "softmax_scale", positive=True, optional=True)
    except InvalidArgumentError as e:
        return e
    return None


def _arguments_error(group, q, k, v, chunking, ulysses):
    """The InvalidArgumentError this rank's arguments deserve, or None (raised on every rank by the agreement)."""
    world = dist.get_world_size(group)
    if chunking not in _CHUNKINGS:
        return InvalidArgumentError(f"chunking must be one of {list(_CHUNKINGS)}, got {chunking!r}")
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
        return InvalidArgumentError(f"ulysses must be a positive integer dividing the group's {world} ranks, got "
                                    f"{ulysses!r}")
    if chunking == "zigzag" and ulysses > 1:
        # the layout would zigzag per head-parallel group and split each group's tokens among its members, which is
        # not the chunks r and 2 world - 1 - r a caller shards by
        return InvalidArgumentError(f"chunking='zigzag' takes ulysses=1 (each rank its pair of chunks), got "
                                    f"ulysses={ulysses}; use chunking='contiguous' with head parallelism")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return InvalidArgumentError(f"{name} must be a 4-D tensor [batch, tokens, heads, head_dim], got "
                                        f"{type(t).__name__}{list(t.shape) if isinstance(t, torch.Tensor) else ''}")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        return InvalidArgumentError(f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]} kv heads")
    if q.shape[2] < ulysses:
        return InvalidArgumentError(f"ulysses={ulysses} needs at least as many heads, q has {q.shape[2]}")
    if q.shape[1] < 1:
        return InvalidArgumentError("each rank must hold at least one token, got q with 0")
    return None


class GroupAttention(torch.nn.Module):
    """group_attention as a module: GroupAttention(group=None, causal=True, softmax_scale=None,
    chunking="contiguous", ulysses=1, window=None, softcap=None); forward(q, k, v, cu_seqlens=None, sinks=None)."""

    def __init__(self, group=None, *, causal: bool = True, softmax_scale: Optional[float] = None,
                 chunking: str = "contiguous", ulysses: int = 1, window=None, softcap: Optional[float] = None):
        super().__init__()
        self.group, self.causal, self.scale, self.chunking, self.ulysses = group, causal, softmax_scale, chunking, ulysses
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v, cu_seqlens=None, sinks=None):
        return group_attention(q, k, v, self.group, causal=self.causal, softmax_scale=self.scale,
                               chunking=self.chunking, ulysses=self.ulysses, cu_seqlens=cu_seqlens,
                               window=self.window, softcap=self.softcap, sinks=sinks)


class sequence_parallel:
    """A context manager that routes torch.nn.functional.scaled_dot_product_attention through group_attention while
    it is open, as torch's context_parallel() does: a model that calls SDPA (a Hugging Face model with
    attn_implementation="sdpa", say) runs on this rank's shard of the sequence without patching::

        with hexiseq.group.sequence_parallel(chunking="zigzag") as sp:
            ids = sp.shard(input_ids)                                  # [batch, s_r]
            pos = sp.positions(input_ids.shape[1])[None]               # absolute positions, for RoPE
            logits = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits

    (An all-ones attention_mask keeps transformers from reading the shard's jump in position ids as packed
    sequences and building a mask.) SDPA calls with an attention mask or dropout are refused: the causal mask is
    applied by absolute position. Shards are even (`shard`); give group_attention unequal ones directly."""

    def __init__(self, group=None, *, chunking: str = "zigzag", ulysses: int = 1):
        if chunking not in _CHUNKINGS:
            raise InvalidArgumentError(f"chunking must be one of {list(_CHUNKINGS)}, got {chunking!r}")
        if chunking == "zigzag" and ulysses != 1:
            raise InvalidArgumentError(f"chunking='zigzag' takes ulysses=1, got ulysses={ulysses!r}; use "
                                       "chunking='contiguous' with head parallelism")
        self.group, self.chunking, self.ulysses = group, chunking, ulysses
        self._saved = None

    def _rank_world(self):
        group = resolve_group(self.group)
        return dist.get_rank(group), dist.get_world_size(group)

    def positions(self, seq_len: int) -> torch.Tensor:
        """The absolute positions of this rank's shard of a sequence of seq_len tokens. Every rank holds at least
        one token: group_attention parks no rank (it refuses an empty shard), so a sequence shorter than the group
        is refused here, on every rank alike (each computes the same from the same seq_len)."""
        rank, world = self._rank_world()
        if seq_len < world:
            raise InvalidArgumentError(f"sequence_parallel gives each of the {world} ranks at least one token: "
                                       f"seq_len must be at least {world}, got {seq_len}")
        if self.chunking == "contiguous":
            bounds = [seq_len * r // world for r in range(world + 1)]
            return torch.arange(bounds[rank], bounds[rank + 1])
        if seq_len % (2 * world):
            raise InvalidArgumentError(f"zigzag shards a sequence into 2 x {world} equal chunks: seq_len must be a "
                                       f"multiple of {2 * world}, got {seq_len}")
        c = seq_len // (2 * world)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor along `dim`."""
        pos = self.positions(x.shape[dim]).to(x.device)
        return x.index_select(dim, pos)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        from ..errors import UnsupportedError

        if attn_mask is not None:
            raise UnsupportedError("hexiseq.group.sequence_parallel: an SDPA call with an attention mask; the causal "
                                   "mask is applied by absolute position (pass an all-ones attention_mask to the "
                                   "model, or none)")
        if dropout_p:
            raise UnsupportedError(f"hexiseq.group.sequence_parallel: attention dropout ({dropout_p}) is not "
                                   "supported")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # [batch, tokens, heads, head_dim]
        out = group_attention(q, k, v, self.group, causal=bool(is_causal), softmax_scale=scale,
                              chunking=self.chunking, ulysses=self.ulysses)
        return out.transpose(1, 2)

    def __enter__(self):
        import torch.nn.functional as F

        if self._saved is not None:
            raise InvalidArgumentError("this sequence_parallel context is already open")
        self._saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._saved
        self._saved = None
        return False
