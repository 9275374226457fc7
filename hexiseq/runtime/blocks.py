"""The attention of one block pair (a chunk of queries against a block of keys at known absolute positions) and
the merge of its partial result into a running (out, log-sum-exp): the unit of work of a ring step.

Two implementations, one interface (`BlockKernels`, chosen once per device and dtype by `kernels_for`):
- "hexiseq": the C kernels of `hexiseq.ops` (CPU tensors; bf16/fp16 CUDA tensors where the CUDA kernels are built);
- "torch": one of torch's fused attention ops where it computes the pair exactly (full and diagonal pairs of
  bf16/fp16 CUDA tensors), tiled matmuls otherwise. Two fused ops return the LSE the ring merges with and take the
  ring's final (out, LSE) in their backward: flash (aten._scaled_dot_product_flash_attention) and cuDNN
  (aten._scaled_dot_product_cudnn_attention). Which one is fastest depends on the GPU and the cuDNN release (on an
  H200 with cuDNN 9.19 cuDNN took 0.45-0.68x flash's time forward and 0.50-0.67x backward at 4K-32K tokens (two runs),
  benchmarks/results/gpu/block_backends_h200.md), so each device times both once on its own block shapes and
  keeps the faster (`fused_choice`), after checking cuDNN against flash on the same inputs; HEXISEQ_RUNTIME_KERNELS
  =flash or =cudnn forces one.
"""

import os
import warnings

import torch

from . import ops
from .variants import PLAIN
from ..errors import InvalidArgumentError, UnsupportedError

_warned_fallback = False


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
    already expanded to H or in GQA ratio. torch's fused flash op where it applies (see _flash_causal; never
    with documents or a variant); else tiled matmuls (tile: force those, with this tile size). variant: a window
    and soft-capping (hexiseq.runtime.variants)."""
    plain = tile is None and q_doc is None and variant.plain
    is_causal = _flash_causal(q, k, causal, q_pos0, k_pos0) if plain else None
    if is_causal is not None:
        return _fused_forward(q, k, v, is_causal, scale)
    if q.device.type == "cuda":
        why = ("a document mask" if q_doc is not None else "a window or soft-capping" if not variant.plain
               else f"this block pair ({q.dtype}, head dim {q.shape[3]})")
        _warn_once(f"no fused attention for {why}; using tiled matmuls (correct, slow)")
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
    where it applies (see _flash_causal; never with documents), else in fp32/fp64 from tiled matmuls."""
    plain = tile is None and q_doc is None and variant.plain
    is_causal = _flash_causal(q, k, causal, q_pos0, k_pos0) if plain else None
    if is_causal is not None:
        return _fused_backward(q, k, v, o, lse, do, is_causal, scale)
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
    (the C kernels for CPU tensors, the CUDA kernels for bf16/fp16 CUDA tensors), False for the PyTorch path
    (_block_forward_torch: torch's fused flash attention for the full and diagonal block pairs of bf16/fp16 CUDA
    tensors, tiled matmuls otherwise).

    Default: hexiseq.ops on CPU; the PyTorch path for CUDA tensors, because on an H100 torch's flash kernels ran
    0.99-1.18x (forward) and 1.32-1.56x (backward) the speed of hexiseq's CUDA kernels on the same inputs
    (benchmarks/results/cuda_attention.md; a one-rank layer: benchmarks/results/runtime_gpu.md), and the ring
    only produces full and diagonal block pairs.
    HEXISEQ_RUNTIME_KERNELS=hexiseq or =torch forces one (the tests run both); =flash or =cudnn force the PyTorch
    path with that fused op (see fused_choice)."""
    forced = os.environ.get("HEXISEQ_RUNTIME_KERNELS", "")
    if forced and forced not in _RUNTIME_KERNELS:
        raise InvalidArgumentError(f"HEXISEQ_RUNTIME_KERNELS={forced!r}: expected one of {', '.join(_RUNTIME_KERNELS)} "
                                   "or unset")
    if t.device.type == "cpu":
        return forced in ("", "hexiseq")
    if forced == "hexiseq":
        if t.device.type == "cuda" and t.dtype in (torch.bfloat16, torch.float16) and ops._cuda_built():
            return True
        _warn_once(f"HEXISEQ_RUNTIME_KERNELS=hexiseq: hexiseq has no kernel for {t.dtype} on {t.device.type} "
                   f"(CUDA kernels: bf16/fp16{'' if ops._cuda_built() else ', and this build has none'}); using the "
                   "PyTorch block attention")
    return False


def _warn_once(message):
    global _warned_fallback
    if not _warned_fallback:
        warnings.warn("hexiseq: " + message, RuntimeWarning, stacklevel=3)
        _warned_fallback = True


# torch's fused flash attention op, where it computes a block pair exactly: it returns the LSE the ring merges
# with and its backward takes the ring's final (out, LSE), so one block pair is one call each way.
_flash_capable = {}


def _flash_causal(q, k, causal, q_pos0, k_pos0):
    """is_causal for torch's flash op when it computes this block pair exactly, else None. Exact cases: CUDA,
    bf16/fp16, head dim a multiple of 8 up to 256, and either every key visible to every query (not causal, or
    all keys at or before the first query) or the causal square on the diagonal (same positions, same length:
    flash's mask is then key j <= query i, ours)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    Sq, Sk, d = q.shape[1], k.shape[1], q.shape[3]
    if d % 8 or d > 256 or Sq == 0 or Sk == 0 or not torch.backends.cuda.flash_sdp_enabled():
        return None
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if dev not in _flash_capable:
        _flash_capable[dev] = (torch.cuda.get_device_capability(dev) >= (8, 0)
                               and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward"))
    if not _flash_capable[dev]:
        return None
    if not causal or k_pos0 + Sk - 1 <= q_pos0:
        return False
    if q_pos0 == k_pos0 and Sq == Sk:
        return True
    return None


def _fused_forward(q, k, v, is_causal, scale):
    """(out, lse) of a pair _flash_causal accepts, through the fused op chosen for this device and shape. Where
    cuDNN was chosen but refuses a shape the timing did not try (a length, a causal flag), that shape class goes to
    flash from then on (warned once): both ops take the other's (out, LSE), so a pass may mix them."""
    if fused_choice(q, k) == "cudnn":
        try:
            return _cudnn_forward(q, k, v, is_causal, scale)
        except RuntimeError as e:
            _cudnn_refused(q, k, e)
    return _flash_forward(q, k, v, is_causal, scale)


def _fused_backward(q, k, v, o, lse, do, is_causal, scale):
    if fused_choice(q, k) == "cudnn":
        try:
            return _cudnn_backward(q, k, v, o, lse, do, is_causal, scale)
        except RuntimeError as e:
            _cudnn_refused(q, k, e)
    return _flash_backward(q, k, v, o, lse, do, is_causal, scale)


def _cudnn_refused(q, k, error):
    """cuDNN refused a call: re-raised when forced, else flash for this shape class from now on."""
    if os.environ.get("HEXISEQ_RUNTIME_KERNELS", "") == "cudnn":
        raise error
    _fused_chosen[_fused_key(q, k)] = "flash"
    warnings.warn(f"hexiseq: torch's cuDNN attention refused a block pair ({str(error).splitlines()[0][:200]}); "
                  "this shape class uses flash from now on", RuntimeWarning, stacklevel=4)


def _fused_key(q, k):
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return (dev, q.dtype, q.shape[2], k.shape[2], q.shape[3])


_fused_chosen = {}  # (device index, dtype, heads, kv heads, head dim) -> "flash" or "cudnn"


def fused_choice(q, k):
    """Which of torch's fused ops runs full and diagonal block pairs of this shape on q's device: HEXISEQ_RUNTIME_
    KERNELS=flash or =cudnn if set, else the faster of the two, timed once per (device, dtype, heads, kv heads, head
    dim) on a causal 2048-token block forward and backward (`_time_fused`, a few milliseconds), cuDNN only where it
    runs and agrees with flash on the same inputs (else flash, with the reason warned once)."""
    forced = os.environ.get("HEXISEQ_RUNTIME_KERNELS", "")
    if forced in ("flash", "cudnn"):
        return forced
    key = _fused_key(q, k)
    if key not in _fused_chosen:
        _fused_chosen[key] = _time_fused(q.device, *key[1:])
    return _fused_chosen[key]


def _time_fused(device, dtype, heads, kv_heads, head_dim, seq=2048, reps=3):
    """"flash" or "cudnn", whichever ran a causal block of `seq` tokens (forward + backward) faster here, cuDNN
    checked against flash first: out, LSE and gradients within 2% of the largest value (both are exact bf16/fp16
    attention; a disagreement is a fault of one of them, and flash is the one the runtime was validated on)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, seq, heads, head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(1, seq, kv_heads, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(1, seq, heads, head_dim, device=device, generator=g).to(dtype)
    scale = head_dim ** -0.5
    runs = {}
    for name, fwd, bwd in (("flash", _flash_forward, _flash_backward), ("cudnn", _cudnn_forward, _cudnn_backward)):
        try:
            o, lse = fwd(q, k, v, True, scale)
            runs[name] = (fwd, bwd, (o, lse) + tuple(bwd(q, k, v, o, lse, do, True, scale)))
        except Exception as e:  # noqa: BLE001 - an op this torch, cuDNN or GPU lacks is not a candidate
            if name == "flash":
                raise
            _warn_once(f"torch's cuDNN attention is not usable here ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''}); block pairs use flash")
            return "flash"
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs["flash"][2], runs["cudnn"][2]):
        a, b = a.float(), b.float().reshape(a.shape)
        if not bool(((a - b).abs().max() <= 0.02 * max(a.abs().max().item(), 1.0)).item()):
            _warn_once(f"torch's cuDNN attention disagrees with flash on {what} here; block pairs use flash")
            return "flash"
    times = {}
    for name, (fwd, bwd, res) in runs.items():
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            o, lse = fwd(q, k, v, True, scale)
            bwd(q, k, v, o, lse, do, True, scale)
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end)
    return min(times, key=times.get)


_cudnn_aux = {}  # device -> the forward's cumulative-length and random-state outputs, which its backward takes back


def _cudnn_forward(q, k, v, is_causal, scale):
    """(out [B, Sq, H, d], lse [B, H, Sq] fp32) through torch's cuDNN attention op ([B, H, S, d] views; GQA native,
    as measured on an H200 with cuDNN 9.19)."""
    B, Sq, H, _ = q.shape
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           None, True, 0.0, is_causal, False, scale=scale)
    # without dropout and without nested tensors these are placeholders (empty), the same for every call: the
    # backward, which the runtime calls with the ring's merged (out, LSE) rather than this call's, takes them back
    _cudnn_aux[q.device] = (r[2], r[3], r[6], r[7], r[1].dim())
    return r[0].transpose(1, 2), r[1].reshape(B, H, Sq)


def _cudnn_backward(q, k, v, o, lse, do, is_causal, scale):
    """(dq, dk, dv) in q's dtype through torch's cuDNN attention backward with the ring's final (o, lse)."""
    B, Sq, H, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    if q.device not in _cudnn_aux:  # no forward ran here yet (never in the runtime): one makes the placeholders
        _cudnn_forward(q[:, :1], k[:, :1], v[:, :1], False, scale)
    cum_q, cum_k, seed, offset, lse_dims = _cudnn_aux[q.device]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2),
        lse.to(torch.float32).reshape((B, H, Sq, 1)[:lse_dims]).contiguous(), seed, offset, None, cum_q, cum_k, Sq, Sk, 0.0, is_causal,
        scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if dk.shape[2] != Hk:  # a cuDNN that expanded the kv heads: their gradients summed back onto each kv head
        dk = dk.reshape(B, Sk, Hk, H // Hk, -1).sum(3)
        dv = dv.reshape(B, Sk, Hk, H // Hk, -1).sum(3)
    return dq, dk, dv


def _flash_forward(q, k, v, is_causal, scale):
    """(out [B, Sq, H, d], lse [B, H, Sq] fp32) through torch's flash op ([B, H, S, d] views; GQA native)."""
    r = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           0.0, is_causal, False, scale=scale)
    return r[0].transpose(1, 2), r[1]


def _flash_backward(q, k, v, o, lse, do, is_causal, scale):
    """(dq, dk, dv) in q's dtype through torch's flash backward with the ring's final (o, lse). Without dropout
    the op reads no random state: the seed and offset tensors are placeholders."""
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, o, do))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous(), None, None, q.shape[1], k.shape[1], 0.0, is_causal,
        seed, offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)



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
        # the merge is one C/CUDA kernel where one is built for the device, instead of eight torch ops
        self._merge_c = self.name == "hexiseq" or (probe.device.type == "cuda" and ops._cuda_built())
        self._documents_c = None  # whether hexiseq.ops takes q_doc here: learnt at the first documents call
        self._documents_cuda = None  # on the PyTorch path: whether document pairs go to the CUDA kernels instead
        self._variants_cuda = None  # on the PyTorch path: whether windowed or soft-capped pairs do

    def forward(self, q, k, v, causal, q_pos0, k_pos0, scale, q_doc=None, out=None, lse=None, variant=PLAIN):
        """(out, lse) of the pair; out= and lse= (both or neither, q's dtype and the accumulator dtype) are written
        in place and returned: the hexiseq kernels write them directly, the PyTorch path copies into them.
        variant: a window and soft-capping (hexiseq.runtime.variants)."""
        if self._c_for(q_doc, variant):
            return ops.attention_forward(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale,
                                         q_doc=q_doc, out=out, lse=lse, **variant.kwargs())
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
        c = self._c_for(q_doc, variant)
        kw = variant.kwargs()
        if c and self.acc_dtype == self.dtype:  # the kernel adds in place
            ops.attention_backward(q, k, v, o, lse.to(self.acc_dtype), do, causal=causal, q_pos0=q_pos0,
                                   k_pos0=k_pos0, scale=scale, dq=dq, dk=dk, dv=dv, accumulate=True, q_doc=q_doc,
                                   **kw)
            return
        if c:
            dq_p, dk_p, dv_p = ops.attention_backward(q, k, v, o, lse.to(torch.float32), do, causal=causal,
                                                      q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, q_doc=q_doc, **kw)
        else:
            dq_p, dk_p, dv_p = _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale,
                                                     q_doc=q_doc, variant=variant)
        dq += dq_p.to(self.acc_dtype)
        dk += dk_p.to(self.acc_dtype)
        dv += dv_p.to(self.acc_dtype)

    def backward(self, q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, q_doc=None, variant=PLAIN):
        """The pair's (dq, dk, dv) in q's dtype, for a pair that is a query chunk's only one: no accumulator."""
        if self._c_for(q_doc, variant):
            return ops.attention_backward(q, k, v, o, lse.to(self.acc_dtype), do, causal=causal, q_pos0=q_pos0,
                                          k_pos0=k_pos0, scale=scale, q_doc=q_doc, **variant.kwargs())
        return tuple(g.to(q.dtype) for g in _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale,
                                                                  q_doc=q_doc, variant=variant))

    def _c_for(self, q_doc, variant=PLAIN):
        """Whether hexiseq.ops runs this pair: the chosen implementation, except that a document mask goes to the
        PyTorch path on a device whose hexiseq kernels refuse q_doc (CUDA kernels built without it), and that on
        the PyTorch path (not forced) a pair with a document mask, a window or soft-capping goes to the hexiseq
        CUDA kernels where they take it: torch's fused ops cannot mask documents or cap logits, and its tiled
        matmuls are the slow fallback. Every hexiseq kernel library that loads takes windows and soft-capping
        (its entry table's version says so)."""
        if q_doc is None:
            if variant.plain or self.name == "hexiseq":
                return self.name == "hexiseq"
            return self._cuda_variants(variant)
        if self.name != "hexiseq":
            if self._documents_cuda is None:
                self._documents_cuda = (
                    q_doc.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                    and not os.environ.get("HEXISEQ_RUNTIME_KERNELS", "") and ops._cuda_built()
                    and _takes_documents(q_doc.device, self.dtype))
            return self._documents_cuda
        if self._documents_c is None:
            self._documents_c = _takes_documents(q_doc.device, self.dtype)
            if not self._documents_c:
                _warn_once(f"the hexiseq kernels on {q_doc.device.type} take no document mask; documents run on "
                           "the PyTorch block attention")
        return self._documents_c

    def _cuda_variants(self, variant):
        """On the PyTorch path: whether a pair with a window or soft-capping (no documents) goes to the hexiseq CUDA
        kernels: bf16/fp16 CUDA tensors with a CUDA build, unless the PyTorch path was forced."""
        if self._variants_cuda is None:
            self._variants_cuda = (self.device_type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                                   and not os.environ.get("HEXISEQ_RUNTIME_KERNELS", "") and ops._cuda_built())
        return self._variants_cuda

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
