"""torch's fused attention ops for the block pairs they compute exactly, and the choice, per device, of the block
backend that runs each kind of pair on a GPU.

Two kinds of pair, each with its candidates:
- "pairs", full and causal-diagonal block pairs (what a ring produces without documents): the hexiseq CUDA kernels,
  torch's flash op (aten._scaled_dot_product_flash_attention) or torch's cuDNN op (aten._scaled_dot_product_cudnn_
  attention). All three return the LSE the ring merges with and take the ring's final (out, LSE) in their backward.
- "documents", pairs of a packed sequence under the document mask: the hexiseq CUDA kernels with their mask, or
  torch's variable-length flash op (aten._flash_attention_forward over cumulative document lengths: "varlen"),
  which computes the two shapes a ring's document pairs take exactly: the diagonal pair (each document's rows
  causal among themselves) and a pair whose keys all precede its queries (one dense rectangle per batch row: only
  the document that holds the queries' first position reaches back into the keys).

Which is fastest depends on the GPU, the head shape and the torch/cuDNN release (on an H200 cuDNN took 0.45-0.68x
flash's time and the hexiseq kernels 1.3-1.7x: benchmarks/results/gpu/), so the choice is measured: once per
(device, dtype, heads, kv heads, head dim) on a 2048-token causal block (pairs) or a 4096-token block of five
documents (documents), forward + backward, after checking each candidate against flash (or the two document
candidates against each other) on the same inputs; a few milliseconds. `calibrate` makes the same measurement at
the model's head shape and records it in the cluster (calibration.block_backends, one entry per device); a plan
made on that cluster hands it to the runtime (`prefer`), which then skips the timing. A user forces one with
HEXISEQ_RUNTIME_KERNELS (hexiseq, torch: only torch's ops, flash, cudnn) and HEXISEQ_DOCUMENT_KERNELS (hexiseq,
varlen).
"""

import os
import weakref
import warnings

import torch

from . import ops
from ..errors import InvalidArgumentError

PAIR_BACKENDS = ("flash", "cudnn", "hexiseq")  # the first that runs is the others' reference
DOCUMENT_BACKENDS = ("hexiseq", "varlen")
_TORCH_ONLY = ("torch", "flash", "cudnn")  # HEXISEQ_RUNTIME_KERNELS values that keep the hexiseq kernels out

_warned = set()


def warn_once(message):
    """A RuntimeWarning prefixed "hexiseq: ", once per distinct message (the runtime's fallbacks and choices)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn("hexiseq: " + message, RuntimeWarning, stacklevel=3)


def _forced_documents():
    forced = os.environ.get("HEXISEQ_DOCUMENT_KERNELS", "")
    if forced and forced not in DOCUMENT_BACKENDS:
        raise InvalidArgumentError(f"HEXISEQ_DOCUMENT_KERNELS={forced!r}: expected one of "
                                   f"{', '.join(DOCUMENT_BACKENDS)} or unset")
    return forced


def hexiseq_allowed(device, dtype):
    """Whether the hexiseq CUDA kernels may run pairs of `dtype` on `device` on the PyTorch block path: bf16/fp16
    CUDA tensors, a build with CUDA kernels, and no HEXISEQ_RUNTIME_KERNELS that asks for torch's ops only."""
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and ops.cuda_built()
            and os.environ.get("HEXISEQ_RUNTIME_KERNELS", "") not in _TORCH_ONLY)


# ----------------------------------------------------------------------------------------- which pairs apply

_flash_capable = {}


def flash_usable(q):
    """CUDA, bf16/fp16, a head dim torch's flash op takes, on a GPU it runs on (compute capability 8.0 and up)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    d = q.shape[3]
    if d % 8 or d > 256 or not torch.backends.cuda.flash_sdp_enabled():
        return False
    dev = _index(q.device)
    if dev not in _flash_capable:
        _flash_capable[dev] = (torch.cuda.get_device_capability(dev) >= (8, 0)
                               and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward")
                               and hasattr(torch.ops.aten, "_flash_attention_backward"))
    return _flash_capable[dev]


def exact_causal(q, k, causal, q_pos0, k_pos0):
    """is_causal for torch's fused ops when they compute this block pair exactly, else None: either every key
    visible to every query (not causal, or all keys at or before the first query) or the causal square on the
    diagonal (same positions, same length: the ops' mask is then key j <= query i, ours)."""
    Sq, Sk = q.shape[1], k.shape[1]
    if Sq == 0 or Sk == 0 or not flash_usable(q):
        return None
    if not causal or k_pos0 + Sk - 1 <= q_pos0:
        return False
    if q_pos0 == k_pos0 and Sq == Sk:
        return True
    return None


def _index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


# ------------------------------------------------------------------------------------------ the choice

_chosen = {}     # (device index, dtype, heads, kv heads, head dim, kind) -> backend, as measured or preferred
_preferred = {}  # (device index, dtype, head dim, kind) -> backend, from a calibration


def _candidates(kind, device, dtype):
    own = hexiseq_allowed(device, dtype)
    return [b for b in (PAIR_BACKENDS if kind == "pairs" else DOCUMENT_BACKENDS) if b != "hexiseq" or own]


def choice(q, k, kind="pairs"):
    """The backend that runs this pair's kind ("pairs" or "documents") for q's and k's head shape on q's device:
    forced by the environment, else preferred by a calibration, else measured here once (see the module)."""
    forced = os.environ.get("HEXISEQ_RUNTIME_KERNELS", "")
    if kind == "pairs" and forced in ("flash", "cudnn"):
        return forced
    if kind == "documents":
        forced = _forced_documents() or ("varlen" if forced in _TORCH_ONLY else "")
        if forced:
            return forced
    dev = _index(q.device)
    key = (dev, q.dtype, q.shape[2], k.shape[2], q.shape[3], kind)
    if key not in _chosen:
        pref = _preferred.get((dev, q.dtype, q.shape[3], kind))
        if pref is not None and pref in _candidates(kind, q.device, q.dtype):
            _chosen[key] = pref
        else:
            _chosen[key] = measure(q.device, q.dtype, q.shape[2], k.shape[2], q.shape[3], kind)[0]
    return _chosen[key]


def prefer(device, dtype, head_dim, pairs=None, documents=None):
    """Adopt a calibration's choice for pairs of `dtype` and `head_dim` on `device` (any head count): the runtime
    then uses it instead of measuring. A backend this process cannot run (the hexiseq kernels on a build without
    them, say) is ignored and measured as usual; an unknown name is refused."""
    device = torch.device(device)
    for kind, name, known in (("pairs", pairs, PAIR_BACKENDS), ("documents", documents, DOCUMENT_BACKENDS)):
        if name is None:
            continue
        if name not in known:
            raise InvalidArgumentError(f"block_backends.{kind} must be one of {', '.join(known)}, got {name!r}")
        _preferred[(_index(device), dtype, int(head_dim), kind)] = name


def refused(q, k, error):
    """cuDNN, chosen for pairs, refused a shape its measurement did not try (a length, a causal flag): that shape
    class goes to flash from now on (warned once), or the error is re-raised where cuDNN was forced."""
    if os.environ.get("HEXISEQ_RUNTIME_KERNELS", "") == "cudnn":
        raise error
    _chosen[(_index(q.device), q.dtype, q.shape[2], k.shape[2], q.shape[3], "pairs")] = "flash"
    warn_once(f"torch's cuDNN attention refused a block pair ({str(error).splitlines()[0][:200]}); this shape "
               "class uses flash from now on")
    return "flash"


def measure(device, dtype, heads, kv_heads, head_dim, kind="pairs", reps=3):
    """(backend, {backend: ms for `reps` forward + backward}) of the kind's candidates that run here and agree
    with the reference on the same inputs (out, LSE and gradients within 2% of the largest value: all are exact
    bf16/fp16 attention, so a disagreement is a fault of one of them). The reference is flash for pairs (the op
    the runtime was first validated on) and the hexiseq kernels for documents."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    seq = 2048 if kind == "pairs" else 4096
    q = torch.randn(1, seq, heads, head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(1, seq, kv_heads, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(1, seq, heads, head_dim, device=device, generator=g).to(dtype)
    scale = head_dim ** -0.5
    q_doc = None
    if kind == "documents":
        q_doc = torch.from_numpy(ops.document_starts([1536, 512, 1024, 256, 768])).to(device)
    calls = {name: _CALLS[name] for name in _candidates(kind, device, dtype)}
    runs, reference = {}, None
    for name, (fwd, bwd) in calls.items():
        try:
            o, lse = fwd(q, k, v, True, 0, 0, scale, q_doc)
            runs[name] = (o, lse) + tuple(bwd(q, k, v, o, lse, do, True, 0, 0, scale, q_doc))
        except Exception as e:  # noqa: BLE001 - an op this torch, cuDNN or GPU lacks is not a candidate
            warn_once(f"{name} attention is not usable here ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''}); it is left out of the choice")
            continue
        if reference is None:
            reference = name
            continue
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[reference], runs[name]):
            a, b = a.float(), b.float().reshape(a.shape)
            if not bool(((a - b).abs().max() <= 0.02 * max(a.abs().max().item(), 1.0)).item()):
                warn_once(f"{name} attention disagrees with {reference} on {what} here; it is left out of the "
                           "choice")
                del runs[name]
                break
    if not runs:
        raise InvalidArgumentError(f"no block backend runs {kind} of {dtype} at head_dim {head_dim} on {device}")
    times = {}
    for name in runs:
        fwd, bwd = calls[name]
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            o, lse = fwd(q, k, v, True, 0, 0, scale, q_doc)
            bwd(q, k, v, o, lse, do, True, 0, 0, scale, q_doc)
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end)
    return min(times, key=times.get), times


def choices(device, dtype, heads, kv_heads, head_dim):
    """{"pairs": backend, "documents": backend} for this head shape on `device` as the runtime would choose them
    (measured now unless forced or preferred); on a CPU both are the hexiseq kernels. What calibrate records."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"pairs": "hexiseq", "documents": "hexiseq"}
    q = torch.empty(1, 1, heads, head_dim, device=device, dtype=dtype)
    k = torch.empty(1, 1, kv_heads, head_dim, device=device, dtype=dtype)
    return {kind: choice(q, k, kind) for kind in ("pairs", "documents")}


# ------------------------------------------------------------------------------ plain pairs, one op each

def pair_forward(q, k, v, is_causal, scale):
    """(out, lse) of a pair exact_causal accepts (is_causal: its answer), through the backend chosen for its shape;
    where cuDNN refuses a shape its measurement did not try, flash takes that shape class (all backends take each
    other's (out, LSE), so a pass may mix them). The hexiseq kernels see the pair at positions 0: an exact pair is
    all visible (not causal) or the causal square on the diagonal, whatever its absolute positions."""
    name = choice(q, k)
    if name == "cudnn":
        try:
            return _cudnn_forward(q, k, v, is_causal, scale)
        except RuntimeError as e:
            name = refused(q, k, e)
    return _CALLS[name][0](q, k, v, is_causal, 0, 0, scale, None)


def pair_backward(q, k, v, o, lse, do, is_causal, scale):
    """(dq, dk, dv) in q's dtype of a pair exact_causal accepts, with the ring's final (o, lse)."""
    name = choice(q, k)
    if name == "cudnn":
        try:
            return _cudnn_backward(q, k, v, o, lse, do, is_causal, scale)
        except RuntimeError as e:
            name = refused(q, k, e)
    return _CALLS[name][1](q, k, v, o, lse, do, is_causal, 0, 0, scale, None)


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
        lse.to(torch.float32).reshape((B, H, Sq, 1)[:lse_dims]).contiguous(), seed, offset, None, cum_q, cum_k, Sq,
        Sk, 0.0, is_causal, scale=scale)
    return dq.transpose(1, 2), _kv_heads(dk.transpose(1, 2), Hk), _kv_heads(dv.transpose(1, 2), Hk)


def _kv_heads(g, Hk):
    """A kv gradient [.., S, H or Hk, d] summed back onto Hk heads (for an op that expanded the kv heads)."""
    if g.shape[-2] == Hk:
        return g
    return g.reshape(*g.shape[:-2], Hk, g.shape[-2] // Hk, g.shape[-1]).sum(-2)


def _flash_forward(q, k, v, is_causal, scale):
    """(out [B, Sq, H, d], lse [B, H, Sq] fp32) through torch's flash op ([B, H, S, d] views; GQA native)."""
    r = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           0.0, is_causal, False, scale=scale)
    return r[0].transpose(1, 2), r[1]


_rng_placeholders = {}


def _no_rng(device):
    """The random-state operands of torch's flash backwards, which read none without dropout: made once per
    device (two allocations and two fills per call were host time a short call does not hide)."""
    if device not in _rng_placeholders:
        _rng_placeholders[device] = (torch.zeros(2, dtype=torch.int64, device=device),
                                     torch.zeros((), dtype=torch.int64, device=device))
    return _rng_placeholders[device]


def _flash_backward(q, k, v, o, lse, do, is_causal, scale):
    """(dq, dk, dv) in q's dtype through torch's flash backward with the ring's final (o, lse)."""
    seed, offset = _no_rng(q.device)
    qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, o, do))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous(), None, None, q.shape[1], k.shape[1], 0.0, is_causal,
        seed, offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# -------------------------------------------------------------------- document pairs, variable lengths

class _Segments:
    """A document pair as torch's variable-length op takes it: the query rows and key rows of each segment (one
    per document on the diagonal, at most one per batch row when the keys precede the queries), with their
    cumulative lengths on the device."""

    def __init__(self, spans, causal, B, Sq, Sk, device):
        # spans: (batch row, query lo, query hi, key lo, key hi) of each non-empty segment
        self.spans, self.causal, self.B, self.Sq, self.Sk = spans, causal, B, Sq, Sk
        # on the diagonal every row takes part, in place: the packed rows are a view of the tensor's
        self.whole = causal and len(spans) > 0 and sum(s[2] - s[1] for s in spans) == B * Sq
        cq, ck = [0], [0]
        for _, qa, qb, ka, kb in spans:
            cq.append(cq[-1] + qb - qa)
            ck.append(ck[-1] + kb - ka)
        self.total_q, self.total_k = cq[-1], ck[-1]
        self.max_q = max((s[2] - s[1] for s in spans), default=0)
        self.max_k = max((s[4] - s[3] for s in spans), default=0)
        self.cu_q = torch.tensor(cq, dtype=torch.int32).to(device)
        self.cu_k = torch.tensor(ck, dtype=torch.int32).to(device)
        self._pads = None

    def lse_shape(self, H, padded):
        return (len(self.spans), H, self.max_q) if padded else (H, self.total_q)

    def gather(self, x, kind):
        """The rows of x [B, S, H, d] that take part, packed [total, H, d]."""
        if self.whole:
            return x.reshape(self.B * self.Sq, *x.shape[2:])
        lo, hi = (1, 2) if kind == "q" else (3, 4)
        parts = [x[s[0], s[lo]:s[hi]] for s in self.spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def scatter(self, packed, shape, kind):
        """The packed rows [total, H, d] back in a zero tensor of `shape` [B, S, H, d]."""
        if self.whole:
            return packed.reshape(shape)
        out = packed.new_zeros(shape)
        lo, hi = (1, 2) if kind == "q" else (3, 4)
        at = 0
        for s in self.spans:
            n = s[hi] - s[lo]
            out[s[0], s[lo]:s[hi]] = packed[at:at + n]
            at += n
        return out

    def lse_to_ring(self, lse_v, H):
        """The op's LSE ([H, total_q], or [segments, H, max_q] padded in older releases) as [B, H, Sq], -inf for
        rows outside every segment."""
        tokens = self._unpad(lse_v, H)  # [H, total_q]
        if self.whole:
            return tokens.reshape(H, self.B, self.Sq).transpose(0, 1).contiguous()
        out = tokens.new_full((self.B, H, self.Sq), float("-inf"))
        at = 0
        for b, qa, qb, _, _ in self.spans:
            out[b, :, qa:qb] = tokens[:, at:at + qb - qa]
            at += qb - qa
        return out

    def lse_from_ring(self, lse, padded):
        """The ring's LSE [B, H, Sq] in the layout the op's forward returns (`padded`: [segments, H, max_q])."""
        H = lse.shape[1]
        if self.whole:
            tokens = lse.transpose(0, 1).reshape(H, self.B * self.Sq)
        else:
            tokens = torch.cat([lse[b, :, qa:qb] for b, qa, qb, _, _ in self.spans], dim=1)
        tokens = tokens.to(torch.float32).contiguous()
        if not padded:
            return tokens
        seg, off = self._pad_index(lse.device)
        out = tokens.new_zeros(self.lse_shape(H, True))
        out[seg, :, off] = tokens.transpose(0, 1)
        return out

    def _unpad(self, lse_v, H):
        if lse_v.dim() == 2:
            return lse_v
        seg, off = self._pad_index(lse_v.device)
        return lse_v[seg, :, off].transpose(0, 1)

    def _pad_index(self, device):
        if self._pads is None:
            seg = [j for j, s in enumerate(self.spans) for _ in range(s[2] - s[1])]
            off = [i for s in self.spans for i in range(s[2] - s[1])]
            self._pads = (torch.tensor(seg, device=device), torch.tensor(off, device=device))
        return self._pads


_segments = {}  # id(q_doc) -> (weak reference to it, its version, {pair geometry: _Segments or None})


def segments(q, k, q_pos0, k_pos0, q_doc):
    """The _Segments of a document pair varlen computes exactly (diagonal, or keys before queries), else None.
    Read from q_doc on the host once per mask tensor and geometry (the runtime passes one mask tensor per chunk
    for all layers of a step, so the read, which waits for the device, happens once per step, not per call)."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    diagonal = q_pos0 == k_pos0 and Sq == Sk
    if not (diagonal or k_pos0 + Sk <= q_pos0) or Sq == 0 or Sk == 0:
        return None
    entry = _segments.get(id(q_doc))
    if entry is None or entry[0]() is not q_doc or entry[1] != q_doc._version:
        entry = (weakref.ref(q_doc, lambda _, key=id(q_doc): _segments.pop(key, None)), q_doc._version, {})
        _segments[id(q_doc)] = entry
    geometry = (B, Sq, Sk, q_pos0, k_pos0)
    if geometry not in entry[2]:
        entry[2][geometry] = _cut_segments(q_doc.detach().cpu().reshape(-1, Sq).expand(B, Sq).tolist(), diagonal,
                                           B, Sq, Sk, q_pos0, k_pos0, q.device)
    return entry[2][geometry]


def _cut_segments(starts, diagonal, B, Sq, Sk, q_pos0, k_pos0, device):
    spans = []
    for b, row in enumerate(starts):
        if diagonal:  # a new segment wherever the document start changes: each document causal on its own
            lo = 0
            for i in range(1, Sq + 1):
                if i == Sq or row[i] != row[i - 1]:
                    spans.append((b, lo, i, lo, i))
                    lo = i
            continue
        # keys before queries: the rows whose document starts before the keys end share the document that holds
        # the first query (documents are contiguous), and see the keys from that document's start on
        m = sum(1 for s in row if s < k_pos0 + Sk)
        if m == 0:
            continue
        if any(s != row[0] for s in row[:m]):
            return None  # not a mask of contiguous documents: left to the kernels that take any mask
        spans.append((b, 0, m, max(0, row[0] - k_pos0), Sk))
    return _Segments(spans, diagonal, B, Sq, Sk, device)


def _varlen_ops():
    """torch's variable-length flash forward and backward (one place, so a test can stand a reference in)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


_lse_padded = {}  # device -> whether torch's variable-length op returns its LSE padded per segment (older releases)


def varlen_forward(q, k, v, seg, scale):
    """(out [B, Sq, H, d], lse [B, H, Sq] fp32) of a document pair through torch's variable-length flash op."""
    B, Sq, H, d = q.shape
    if not seg.spans:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_zeros(q.shape), q.new_full((B, H, Sq), float("-inf"), dtype=lse_dtype)
    r = _varlen_ops()[0](seg.gather(q, "q"), seg.gather(k, "k"), seg.gather(v, "k"),
                                                seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, False,
                                                scale=scale)
    _lse_padded[q.device] = r[1].dim() == 3
    return seg.scatter(r[0], q.shape, "q"), seg.lse_to_ring(r[1], H)


def varlen_backward(q, k, v, o, lse, do, seg, scale):
    """(dq, dk, dv) in q's dtype of a document pair, with the ring's final (o, lse)."""
    if not seg.spans:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    if q.device not in _lse_padded:  # no forward ran here yet: this torch's LSE layout, learnt on one row
        one = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
        r = _varlen_ops()[0](q[0, :1], k[0, :1], v[0, :1], one, one, 1, 1, 0.0, False, False,
                                                    scale=scale)
        _lse_padded[q.device] = r[1].dim() == 3
    seed, offset = _no_rng(q.device)
    dq, dk, dv = _varlen_ops()[1](
        seg.gather(do, "q"), seg.gather(q, "q"), seg.gather(k, "k"), seg.gather(v, "k"), seg.gather(o, "q"),
        seg.lse_from_ring(lse, _lse_padded[q.device]), seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, seed, offset,
        scale=scale)
    Hk = k.shape[2]
    return (seg.scatter(dq, q.shape, "q"), seg.scatter(_kv_heads(dk, Hk), k.shape, "k"),
            seg.scatter(_kv_heads(dv, Hk), v.shape, "k"))


# The candidates as measure() calls them: (forward, backward) on (q, k, v, causal, q_pos0, k_pos0, scale, q_doc).
def _varlen_f(q, k, v, causal, qp, kp, scale, q_doc):
    return varlen_forward(q, k, v, segments(q, k, qp, kp, q_doc), scale)


def _varlen_b(q, k, v, o, lse, do, causal, qp, kp, scale, q_doc):
    return varlen_backward(q, k, v, o, lse, do, segments(q, k, qp, kp, q_doc), scale)


_CALLS = {
    "hexiseq": (lambda q, k, v, c, qp, kp, s, q_doc: ops.attention_forward(q, k, v, causal=c, q_pos0=qp, k_pos0=kp,
                                                                           scale=s, q_doc=q_doc),
                lambda q, k, v, o, lse, do, c, qp, kp, s, q_doc: ops.attention_backward(
                    q, k, v, o, lse, do, causal=c, q_pos0=qp, k_pos0=kp, scale=s, q_doc=q_doc)),
    "flash": (lambda q, k, v, c, qp, kp, s, q_doc: _flash_forward(q, k, v, c, s),
              lambda q, k, v, o, lse, do, c, qp, kp, s, q_doc: _flash_backward(q, k, v, o, lse, do, c, s)),
    "cudnn": (lambda q, k, v, c, qp, kp, s, q_doc: _cudnn_forward(q, k, v, c, s),
              lambda q, k, v, o, lse, do, c, qp, kp, s, q_doc: _cudnn_backward(q, k, v, o, lse, do, c, s)),
    "varlen": (_varlen_f, _varlen_b),
}
