"""The attention of one block pair (a chunk of queries against a block of keys at known absolute positions) and
the merge of its partial result into a running (out, log-sum-exp): the unit of work of a ring step.

Two implementations, one interface (`BlockKernels`, chosen once per device and dtype by `kernels_for`):
- "hexiseq": the C kernels of `hexiseq.ops` for every pair (CPU tensors; CUDA tensors where forced);
- "torch", the default for CUDA tensors: each pair goes to the fastest exact backend for its kind on this device
  (hexiseq.runtime.fused: torch's flash or cuDNN op or the hexiseq CUDA kernels for full and diagonal pairs;
  torch's variable-length flash op or the hexiseq kernels' document mask for packed documents; the hexiseq
  kernels for windows, soft-capping and partly visible pairs), tiled matmuls only where no kernel applies (a
  dtype the fused ops lack, a build without CUDA kernels).
"""

import os

import torch

from . import fused, ops
from .variants import PLAIN
from ..errors import InvalidArgumentError, UnsupportedError



# The PyTorch block path materialises scores one [B, H, tile, tile] piece at a time: a block of any length then
# fits in memory (the whole block at once would take B * H * Sq * Sk floats, 8 GiB for 16K x 16K x 8 heads),
# at the price of merging the pieces' (out, lse) like ring steps. Small blocks are one piece.
_TORCH_TILE = 1024


def _tiles(n, tile):
    return [(s, min(tile, n - s)) for s in range(0, n, tile)]


def _key_tiles(qs, qn, Sk, causal, q_pos0, k_pos0, tile, doc_lo, variant=PLAIN):
    """The key pieces [(ks, kn)] that some query of the piece [qs, qs + qn) can see: none after its last query
    (causal), none ending before its earliest document start (doc_lo, absolute; None without documents), none
    outside every query's window."""
    out = []
    for ks, kn in _tiles(Sk, tile):
        if causal and k_pos0 + ks > q_pos0 + qs + qn - 1:
            break  # this key piece and the later ones are after every query of the piece
        if doc_lo is not None and k_pos0 + ks + kn <= doc_lo:
            continue  # every key of the piece lies before every query's document
        if not variant.sees(causal, q_pos0 + qs, qn, k_pos0 + ks, kn):
            continue
        out.append((ks, kn))
    return out


def _doc_lows(q_doc, Sq, tile):
    """Per query piece of _tiles(Sq, tile), the earliest document start of its rows (one host transfer), or
    Nones without documents."""
    pieces = _tiles(Sq, tile)
    if q_doc is None:
        return [None] * len(pieces)
    rows = q_doc.reshape(-1, Sq)
    return torch.stack([rows[:, qs:qs + qn].amin() for qs, qn in pieces]).tolist() if pieces else []


def _block_forward_torch(q, k, v, causal, q_pos0, k_pos0, scale, tile=None, q_doc=None, variant=PLAIN):
    """PyTorch path for one block pair: (out [B, Sq, H, d], lse [B, H, Sq] fp32/fp64). Same contract as
    hexiseq.ops.attention_forward, document mask q_doc ([Sq] or [B, Sq] absolute starts) included: K/V heads
    already expanded to H or in GQA ratio. The chosen fused backend where one applies (see fused.exact_causal;
    never with documents or a variant); else tiled matmuls (tile: force those, with this tile size). variant: a window
    and soft-capping (hexiseq.runtime.variants)."""
    is_causal = fused.exact_causal(q, k, causal, q_pos0, k_pos0) if tile is None and q_doc is None and variant.plain \
        else None
    if is_causal is not None:
        return fused.pair_forward(q, k, v, is_causal, scale)
    if q.device.type == "cuda":
        why = ("a document mask" if q_doc is not None else "a window or soft-capping" if not variant.plain
               else f"this block pair ({q.dtype}, head dim {q.shape[3]})")
        fused.warn_once(f"no fused attention for {why}; using tiled matmuls (correct, slow)")
    tile = tile or _TORCH_TILE
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    outs, lses = [], []
    for (qs, qn), lo in zip(_tiles(Sq, tile), _doc_lows(q_doc, Sq, tile)):
        o_acc = torch.zeros(B, qn, H, d, dtype=acc, device=q.device)
        l_acc = torch.full((B, H, qn), float("-inf"), dtype=acc, device=q.device)
        doc = None if q_doc is None else q_doc[..., qs:qs + qn]
        for ks, kn in _key_tiles(qs, qn, k.shape[1], causal, q_pos0, k_pos0, tile, lo, variant):
            o_p, l_p = _tile_forward_torch(q[:, qs:qs + qn], k[:, ks:ks + kn], v[:, ks:ks + kn], causal,
                                           q_pos0 + qs, k_pos0 + ks, scale, doc, variant)
            merge(o_acc, l_acc, o_p, l_p, False)
        outs.append(o_acc)
        lses.append(l_acc)
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 2)


def _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, tile=None, q_doc=None, variant=PLAIN):
    """PyTorch backward of one block pair with the final (o, lse): (dq, dk, dv) in q's dtype from torch's flash op
    where it applies (see fused.exact_causal; never with documents), else in fp32/fp64 from tiled matmuls."""
    is_causal = fused.exact_causal(q, k, causal, q_pos0, k_pos0) if tile is None and q_doc is None and variant.plain \
        else None
    if is_causal is not None:
        return fused.pair_backward(q, k, v, o, lse, do, is_causal, scale)
    tile = tile or _TORCH_TILE
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for (qs, qn), lo in zip(_tiles(q.shape[1], tile), _doc_lows(q_doc, q.shape[1], tile)):
        doc = None if q_doc is None else q_doc[..., qs:qs + qn]
        for ks, kn in _key_tiles(qs, qn, k.shape[1], causal, q_pos0, k_pos0, tile, lo, variant):
            dq_p, dk_p, dv_p = _tile_backward_torch(
                q[:, qs:qs + qn], k[:, ks:ks + kn], v[:, ks:ks + kn], o[:, qs:qs + qn], lse[:, :, qs:qs + qn],
                do[:, qs:qs + qn], causal, q_pos0 + qs, k_pos0 + ks, scale, doc, variant)
            dq[:, qs:qs + qn] += dq_p
            dk[:, ks:ks + kn] += dk_p
            dv[:, ks:ks + kn] += dv_p
    return dq, dk, dv


def _hidden(s, causal, q_pos0, k_pos0, q_doc, window=None):
    """The invisible keys of scores s [B, H, Sq, Sk] as a bool mask that broadcasts against s (None: all visible):
    after the query (causal), before the query's document start (q_doc, [Sq] or [B, Sq] absolute positions),
    outside the window ((left, right), -1: no bound)."""
    if not causal and window is None:
        return None
    Sq, Sk = s.shape[2], s.shape[3]
    qp = torch.arange(Sq, device=s.device) + q_pos0
    kp = torch.arange(Sk, device=s.device) + k_pos0
    hidden = kp[None, :] > qp[:, None] if causal else torch.zeros(Sq, Sk, dtype=torch.bool, device=s.device)
    if window is not None:
        left, right = window
        if left >= 0:
            hidden = hidden | (qp[:, None] - kp[None, :] > left)
        if right >= 0:
            hidden = hidden | (kp[None, :] - qp[:, None] > right)
    if q_doc is not None:
        hidden = hidden | (kp < q_doc.to(s.device)[..., None])          # [Sq, Sk] or [B, Sq, Sk]
        if hidden.dim() == 3:
            hidden = hidden[:, None]
    return hidden


def _probabilities(s, lse, hidden):
    """P = exp(s - lse) of scores s with the final lse [.., Sq, 1]: 0 for hidden keys and for rows that see no key
    (lse = -inf), NaN wherever the row's lse is NaN (a NaN or +inf score: it must reach the output and the
    gradients, as in torch, not vanish)."""
    dead = lse == float("-inf")
    p = torch.exp(s - lse.masked_fill(dead, 0.0)).masked_fill(dead, 0.0)
    return p if hidden is None else p.masked_fill(hidden, 0.0)


def _tile_forward_torch(q, k, v, causal, q_pos0, k_pos0, scale, q_doc=None, variant=PLAIN):
    """One piece of _block_forward_torch, scores materialised: (out in fp32/fp64, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    Hk = k.shape[2]
    rep = H // Hk
    qf = q.to(acc).permute(0, 2, 1, 3)                                  # [B, H, Sq, d]
    kf = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)   # [B, H, Sk, d]
    vf = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale                  # [B, H, Sq, Sk]
    if variant.softcap:
        s = variant.softcap * torch.tanh(s / variant.softcap)
    hidden = _hidden(s, causal, q_pos0, k_pos0, q_doc, variant.window)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                    # [B, H, Sq]
    p = _probabilities(s, lse[..., None], hidden)
    o = torch.matmul(p, vf).permute(0, 2, 1, 3)
    return o, lse


def _tile_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, q_doc=None, variant=PLAIN):
    """One piece of _block_backward_torch, scores materialised, with the block's final (o, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    Hk = k.shape[2]
    rep = H // Hk
    qf = q.to(acc).permute(0, 2, 1, 3)
    kf = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    vf = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    dof = do.to(acc).permute(0, 2, 1, 3)
    of = o.to(acc).permute(0, 2, 1, 3)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    dcap = None
    if variant.softcap:
        t = torch.tanh(s / variant.softcap)
        s, dcap = variant.softcap * t, 1 - t * t
    hidden = _hidden(s, causal, q_pos0, k_pos0, q_doc, variant.window)
    p = _probabilities(s, lse.to(acc)[..., None], hidden)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    D = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - D)
    if dcap is not None:
        ds = ds * dcap
    if hidden is not None:  # a NaN row's D must not reach its hidden keys through 0 * NaN
        ds = ds.masked_fill(hidden, 0.0)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    # fold expanded kv heads back
    dk = dk.reshape(B, Hk, rep, -1, d).sum(2)
    dv = dv.reshape(B, Hk, rep, -1, d).sum(2)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


_RUNTIME_KERNELS = ("hexiseq", "torch", "flash", "cudnn")


def use_c_kernels(t):
    """Which implementation runs the block pairs of one ring pass (decided once per pass): True for hexiseq.ops
    on every pair, False for the PyTorch path (BlockKernels, name "torch": each pair on the fastest exact backend
    of its kind on the device, hexiseq.runtime.fused).

    Default: hexiseq.ops on CPU; the PyTorch path for CUDA tensors, whose choice includes the hexiseq CUDA kernels
    where they are fastest and takes them for every pair torch's fused ops cannot compute.
    HEXISEQ_RUNTIME_KERNELS=hexiseq forces the hexiseq kernels on every pair; =torch keeps to torch's ops (fused
    where exact, tiled matmuls otherwise; the tests run both); =flash or =cudnn force that fused op on the pairs
    it computes (HEXISEQ_DOCUMENT_KERNELS picks the documents' backend the same way, see hexiseq.runtime.fused)."""
    forced = os.environ.get("HEXISEQ_RUNTIME_KERNELS", "")
    if forced and forced not in _RUNTIME_KERNELS:
        raise InvalidArgumentError(f"HEXISEQ_RUNTIME_KERNELS={forced!r}: expected one of {', '.join(_RUNTIME_KERNELS)} "
                                   "or unset")
    if t.device.type == "cpu":
        return forced in ("", "hexiseq")
    if forced == "hexiseq":
        if t.device.type == "cuda" and t.dtype in (torch.bfloat16, torch.float16) and ops.cuda_built():
            return True
        fused.warn_once(f"HEXISEQ_RUNTIME_KERNELS=hexiseq: hexiseq has no kernel for {t.dtype} on {t.device.type} "
                   f"(CUDA kernels: bf16/fp16{'' if ops.cuda_built() else ', and this build has none'}); using the "
                   "PyTorch block attention")
    return False




def merge(o_acc, lse_acc, o_part, lse_part, use_c):
    """Fold (o_part, lse_part) into the accumulator in place: hexiseq.ops.merge_ on the kernel path, else torch."""
    if use_c:
        ops.merge_(o_acc, lse_acc, o_part, lse_part)
        return
    new = torch.logaddexp(lse_acc, lse_part)
    empty = new == float("-inf")  # both sides saw no key; a NaN side gives NaN weights, so NaN stays NaN
    wa = torch.exp(lse_acc - new).masked_fill(empty, 0.0)
    wp = torch.exp(lse_part - new).masked_fill(empty, 0.0)
    o_acc.mul_(wa.transpose(1, 2)[..., None]).add_(o_part * wp.transpose(1, 2)[..., None])
    lse_acc.copy_(new)


class BlockKernels:
    """One implementation of the block-pair attention, fixed for a device and dtype: forward(q, k, v, ...) ->
    (out, lse); backward_into(...) adds the pair's dq, dk, dv into fp32/fp64 accumulators; merge(...) folds a
    partial (out, lse) into a running one in place. q [B, Sq, H, d]; k, v [B, Sk, H or H / ratio, d]."""

    def __init__(self, device, dtype):
        probe = torch.empty(0, device=device, dtype=dtype)
        self.name = "hexiseq" if use_c_kernels(probe) else "torch"
        self.dtype = dtype
        self.device_type = probe.device.type
        self.acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        # on the PyTorch path: whether the hexiseq CUDA kernels take the pairs torch's fused ops cannot compute
        # (documents, windows, soft-capping, partly visible pairs) instead of the tiled matmuls
        self._own = self.name == "torch" and fused.hexiseq_allowed(probe.device, dtype)
        # the merge is one C/CUDA kernel where one is built for the device, instead of eight torch ops
        self._merge_c = self.name == "hexiseq" or (probe.device.type == "cuda" and ops.cuda_built())
        self._documents_c = None  # whether hexiseq.ops takes q_doc here: learnt at the first documents call

    def _route(self, q, k, causal, q_pos0, k_pos0, q_doc, variant):
        """(where this pair runs, what that needs): "hexiseq" (hexiseq.ops), "fused" with its is_causal (the backend
        chosen among torch's fused ops and the hexiseq kernels for an exact pair, fused.pair_forward), "varlen" with
        its segments (torch's variable-length flash op over the pair's documents), or "torch" (tiled matmuls)."""
        if self.name == "hexiseq":
            return ("hexiseq" if q_doc is None or self._takes_documents(q_doc) else "torch"), None
        if q_doc is None:
            is_causal = fused.exact_causal(q, k, causal, q_pos0, k_pos0) if variant.plain else None
            if is_causal is not None:
                return "fused", is_causal
            return ("hexiseq" if self._own else "torch"), None
        if variant.plain and fused.flash_usable(q) and fused.choice(q, k, "documents") == "varlen":
            seg = fused.segments(q, k, q_pos0, k_pos0, q_doc)
            if seg is not None:
                return "varlen", seg
        return ("hexiseq" if self._own and self._takes_documents(q_doc) else "torch"), None

    def _takes_documents(self, q_doc):
        """Whether hexiseq.ops takes a document mask here (CUDA kernels built without one do not)."""
        if self._documents_c is None:
            self._documents_c = _takes_documents(q_doc.device, self.dtype)
            if not self._documents_c and self.name == "hexiseq":
                fused.warn_once(f"the hexiseq kernels on {q_doc.device.type} take no document mask; documents run on "
                           "the PyTorch block attention")
        return self._documents_c

    def forward(self, q, k, v, causal, q_pos0, k_pos0, scale, q_doc=None, out=None, lse=None, variant=PLAIN):
        """(out, lse) of the pair; out= and lse= (both or neither, q's dtype and the accumulator dtype) are written
        in place and returned: the hexiseq kernels write them directly, the other backends copy into them.
        variant: a window and soft-capping (hexiseq.runtime.variants)."""
        where, how = self._route(q, k, causal, q_pos0, k_pos0, q_doc, variant)
        if where == "hexiseq":
            return ops.attention_forward(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale,
                                         q_doc=q_doc, out=out, lse=lse, **variant.kwargs())
        if where == "fused":
            o_p, l_p = fused.pair_forward(q, k, v, how, scale)
        elif where == "varlen":
            o_p, l_p = fused.varlen_forward(q, k, v, how, scale)
        else:
            o_p, l_p = _block_forward_torch(q, k, v, causal, q_pos0, k_pos0, scale, q_doc=q_doc, variant=variant)
        if out is None:
            return o_p, l_p
        out.copy_(o_p)
        lse.copy_(l_p)
        return out, lse

    def backward_into(self, q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, dq, dk, dv, q_doc=None,
                      variant=PLAIN):
        """Add the pair's gradients into dq [B, Sq, H, d], dk and dv [B, Sk, ., d] (accumulator dtype). q_doc:
        the document mask of the pair's queries, as in hexiseq.ops (None: none); variant: as in forward."""
        where, how = self._route(q, k, causal, q_pos0, k_pos0, q_doc, variant)
        kw = variant.kwargs()
        if where == "hexiseq" and self.acc_dtype == self.dtype:  # the kernel adds in place
            ops.attention_backward(q, k, v, o, lse.to(self.acc_dtype), do, causal=causal, q_pos0=q_pos0,
                                   k_pos0=k_pos0, scale=scale, dq=dq, dk=dk, dv=dv, accumulate=True, q_doc=q_doc,
                                   **kw)
            return
        if where == "hexiseq":
            dq_p, dk_p, dv_p = ops.attention_backward(q, k, v, o, lse.to(torch.float32), do, causal=causal,
                                                      q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, q_doc=q_doc, **kw)
        elif where == "fused":
            dq_p, dk_p, dv_p = fused.pair_backward(q, k, v, o, lse, do, how, scale)
        elif where == "varlen":
            dq_p, dk_p, dv_p = fused.varlen_backward(q, k, v, o, lse, do, how, scale)
        else:
            dq_p, dk_p, dv_p = _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale,
                                                     q_doc=q_doc, variant=variant)
        dq += dq_p.to(self.acc_dtype)
        dk += dk_p.to(self.acc_dtype)
        dv += dv_p.to(self.acc_dtype)

    def backward(self, q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, q_doc=None, variant=PLAIN):
        """The pair's (dq, dk, dv) in q's dtype, for a pair that is a query chunk's only one: no accumulator."""
        where, how = self._route(q, k, causal, q_pos0, k_pos0, q_doc, variant)
        if where == "hexiseq":
            return ops.attention_backward(q, k, v, o, lse.to(self.acc_dtype), do, causal=causal, q_pos0=q_pos0,
                                          k_pos0=k_pos0, scale=scale, q_doc=q_doc, **variant.kwargs())
        if where == "fused":
            return fused.pair_backward(q, k, v, o, lse, do, how, scale)
        if where == "varlen":
            return fused.varlen_backward(q, k, v, o, lse, do, how, scale)
        return tuple(g.to(q.dtype) for g in _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale,
                                                                  q_doc=q_doc, variant=variant))

    def fold_sinks(self, out, lse, sinks):
        """Sink logits into finished rows, in place (hexiseq.ops.fold_sinks_)."""
        ops.fold_sinks_(out, lse, sinks)

    def sinks_backward(self, out, dout, lse, sinks):
        """The sink logits' gradient of finished rows (hexiseq.ops.sinks_backward)."""
        return ops.sinks_backward(out, dout, lse, sinks)

    def merge(self, o_acc, lse_acc, o_part, lse_part):
        merge(o_acc, lse_acc, o_part.to(self.acc_dtype), lse_part.to(self.acc_dtype), self._merge_c)


def _takes_documents(device, dtype):
    """Whether hexiseq.ops takes a document mask for tensors on `device` of `dtype`: the CPU kernels do; for the
    CUDA kernels one row of one token is tried, since whether they do is a property of the built library."""
    if device.type == "cpu":
        return True
    one = torch.zeros(1, 1, 1, 8, dtype=dtype, device=device)
    try:
        ops.attention_forward(one, one, one, q_doc=torch.zeros(1, dtype=torch.int64, device=device))
    except UnsupportedError:
        return False
    return True


def kernels_for(device, dtype, cache=None):
    """The BlockKernels for tensors on `device` of `dtype` (HEXISEQ_RUNTIME_KERNELS read now); `cache`, a dict,
    keeps one per (device, dtype) so a context decides once."""
    key = (torch.device(device), dtype)
    if cache is not None and key in cache:
        return cache[key]
    k = BlockKernels(device, dtype)
    if cache is not None:
        cache[key] = k
    return k
