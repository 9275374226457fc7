"""Attention kernels on torch tensors or NumPy arrays: forward with log-sum-exp, backward, and the (out, lse) merge.

Tensors cross into the C kernels through DLPack without copies; outputs are written in place. Layouts:
q, out, dout, dq are [batch, seq_q, heads, head_dim]; k, v, dk, dv are [batch, seq_k, kv_heads, head_dim]
(heads a multiple of kv_heads: GQA, MQA when kv_heads == 1); lse is [batch, heads, seq_q]. Any strides work
(transposed or sliced views). Data types: float64, float32, float16 and bfloat16 (torch only: NumPy has no
bfloat16); lse is float64 for float64 data and float32 otherwise.
torch is optional: NumPy arrays alone work without it installed.

Devices: CPU tensors (and NumPy arrays) run the CPU kernels. torch CUDA tensors run the CUDA kernels of
kernels/forward.cu and kernels/backward.cu (float16 and bfloat16; float32/float64 raise UnsupportedError) on torch's
current stream of their device, asynchronously like any torch op; all tensors of a call must be on that one device.
A build without CUDA kernels (the default where no GPU was visible at build time; HEXISEQ_CUDA=1 builds them)
raises UnsupportedError for CUDA tensors, saying why they were not built and how to build them.
"""

import math
import numbers
import operator
import sys

import numpy as np

from .. import _core
from .._validate import short
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError

__all__ = ["attention_forward", "attention_backward", "merge_", "document_starts", "fold_sinks_", "sinks_backward"]

# Absolute positions are limited to 2^62 so that every position difference stays inside int64 (the C rule is
# q_pos0 <= 2^62 - seq_q, checked there with the sequence length).
_MAX_POS = 1 << 62
_TENSOR_KINDS = "a torch.Tensor, a numpy.ndarray or another object implementing __dlpack__"
_DL_CPU_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost: memory the CPU kernels can read and write
_DL_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
                    11: "rocm_host", 12: "ext_dev", 13: "cuda_managed", 14: "oneapi", 15: "webgpu", 16: "hexagon",
                    17: "maia"}


def _torch_module():
    """torch if it is already imported (a torch tensor can only exist then), else None: never imports it."""
    return sys.modules.get("torch")


def _is_torch(x):
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def cuda_built():
    """Whether this build has the CUDA kernels."""
    return bool(_core.build_info()["cuda"])


def _device_of(tensors):
    """The torch CUDA device of a call, or None for a CPU call. Raises for a mix of devices or for CUDA tensors
    on a build without CUDA kernels. Only torch tensors are looked at: other objects are checked in _as_operand."""
    cuda = [(n, x.device) for x, n in tensors if _is_torch(x) and x.device.type == "cuda"]
    if not cuda:
        return None
    name, device = cuda[0]
    for x, n in tensors:
        if not (_is_torch(x) and x.device == device):
            where = f"device '{x.device}'" if _is_torch(x) else f"a {type(x).__name__} (host memory)"
            raise InvalidArgumentError(f"{name} is on device '{device}' but {n} is on {where}: all tensors of a call "
                                       "must be on one device")
    if not cuda_built():
        why = _core.build_info().get("cuda_skipped") or "unknown reason"
        raise UnsupportedError(f"{name} is on device '{device}': this hexiseq was built without its CUDA kernels "
                               f"({why}); to build them, reinstall from the source tree on a machine with nvcc: "
                               "HEXISEQ_CUDA=1 pip install . (HEXISEQ_CUDA_ARCHS=90 for Hopper only); or move the "
                               "tensors to the CPU")
    return device


def _stream_of(device):
    """torch's current CUDA stream on `device`, as the integer cudaStream_t the launchers take."""
    return int(_torch_module().cuda.current_stream(device).cuda_stream)


def _require_tensor(x, name):
    """x must be tensor-like (implement __dlpack__); raises ArgumentTypeError naming the argument otherwise."""
    if not hasattr(x, "__dlpack__"):
        raise ArgumentTypeError(f"{name} must be {_TENSOR_KINDS} and shape, got {type(x).__name__}")


def _as_operand(x, name, device=None, *, output=False):
    """x ready for the DLPack call: a torch tensor is detached (sharing memory). device: the call's CUDA device
    (see _device_of), or None for a CPU call, where non-CPU tensors are refused. output: x is written in place.

    torch's lazy negation and conjugation bits: DLPack exports the stored values without them (a tensor with the
    negative bit set would be read with the wrong sign), so an input is resolved into a plain tensor first and an
    output, whose resolved copy would not be the caller's tensor, is refused."""
    if _is_torch(x):
        if device is None and x.device.type != "cpu":
            raise UnsupportedError(f"{name} is on device '{x.device}': the attention kernels take CPU tensors and "
                                   "torch CUDA tensors; move the tensors to the CPU or a CUDA device")
        x = x.detach() if x.requires_grad else x
        for bit, is_set, resolve in (("negative", x.is_neg, "resolve_neg"), ("conjugate", x.is_conj, "resolve_conj")):
            if not is_set():
                continue
            if output:
                raise InvalidArgumentError(f"{name} has torch's {bit} bit set (a lazily {bit[:-1]}ed view, e.g. "
                                           f"z.conj().imag): its stored values are not the ones it shows, and the "
                                           f"result is written in place; pass a tensor without it")
            x = getattr(x, resolve)()
        return x
    if isinstance(x, np.ndarray):
        return x
    _require_tensor(x, name)
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        got = dev()
        try:
            dev_type, dev_id = (operator.index(n) for n in got)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{name}.__dlpack_device__() must return (device_type, device_id), two ints, "
                                       f"got {short(got)}") from None
        if dev_type not in _DL_CPU_DEVICES:
            label = _DL_DEVICE_NAMES.get(dev_type, f"type {dev_type}")
            raise UnsupportedError(f"{name} is on DLPack device {label}:{dev_id} and is not a torch.Tensor: the "
                                   "CUDA kernels take torch CUDA tensors only (they run on torch's current stream); "
                                   "a path for other accelerator DLPack producers is not built")
    return x


def _shape4(x, name, layout):
    _require_tensor(x, name)
    shape = getattr(x, "shape", None)
    try:
        shape = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise ArgumentTypeError(f"{name}.shape must be a sequence of ints, got {short(shape)}") from None
    if len(shape) != 4:
        raise InvalidArgumentError(f"{name} must be 4-D {layout}, got shape {list(shape)}")
    return shape


def _lse_dtype_is_f64(x):
    if _is_torch(x):
        return x.dtype == _torch_module().float64
    return np.dtype(x.dtype) == np.float64


def _new(like, shape, *, lse=False, zero=False):
    """A new output for `like`'s library (torch.Tensor on its device, else NumPy): `like`'s dtype, or for an lse
    float64 when `like` is float64 and float32 otherwise."""
    if _is_torch(like):
        torch = _torch_module()
        dtype = (torch.float64 if like.dtype == torch.float64 else torch.float32) if lse else like.dtype
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=like.device)
    if not isinstance(like, np.ndarray):
        _as_operand(like, "q")  # a foreign producer: its kind and device first
        try:
            np.dtype(like.dtype)
        except (AttributeError, TypeError):
            raise ArgumentTypeError(f"q is a {type(like).__name__} without a NumPy dtype, so outputs cannot be "
                                    "allocated like it: pass them (out, lse; dq, dk, dv)") from None
    if lse:
        dtype = np.float64 if _lse_dtype_is_f64(like) else np.float32
    else:
        dtype = like.dtype
    return (np.zeros if zero else np.empty)(shape, dtype=dtype)


def _fill(x, value):
    """x[...] = value in place, for a torch tensor (even one that requires grad) or a NumPy array."""
    if _is_torch(x):
        x.detach().fill_(value)
    else:
        x[...] = value


def _default_scale(scale, head_dim):
    """The softmax scale: 1 / sqrt(head_dim) for None, else a real number that must be finite and > 0. A scale
    <= 0 is refused: the CUDA forward takes each row's maximum on unscaled scores, which is the maximum of the
    scaled ones only for a positive scale (and a zero scale makes every score equal, never what is meant)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(f"scale must be a real number (or None), got {type(scale).__name__} {short(scale)}")
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"scale must be a finite number > 0, got {short(scale)}")
    return value


def _position(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {short(value)}")
    value = int(value)
    if not 0 <= value <= _MAX_POS:
        raise InvalidArgumentError(f"{name} must be >= 0 and at most 2^62 (positions past it would overflow "
                                   f"int64 differences), got {value}")
    return value


def _flag(value, name):
    """A bool argument: bool, numpy.bool_ or the ints 0 and 1 (anything else could be a silent misreading)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        if value in (0, 1):
            return bool(value)
        raise InvalidArgumentError(f"{name} must be a bool (or 0 / 1), got {int(value)}")
    raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {short(value)}")


def _doc_operand(q_doc, causal):
    """q_doc checked for kind and for the causal mask it needs; shape, dtype and values are the C side's (its
    messages name q_doc too)."""
    if q_doc is None:
        return None
    _require_tensor(q_doc, "q_doc")
    if not causal:
        raise InvalidArgumentError("q_doc (a document mask) needs causal=True: a query sees the keys from its "
                                   "document's start up to its own position")
    return q_doc


def window_bounds(window, causal):
    """(left, right) for the binding, (-1, -1) for None: each bound -1 (none) or an int in [0, 2^62]."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentTypeError(f"window must be None or a pair (left, right) of ints (-1: no bound on that side), "
                                f"got {short(window)}")
    bounds = []
    for value, side in zip(window, ("left", "right")):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(f"window[{side}] must be an int, got {type(value).__name__} {short(value)}")
        if not -1 <= int(value) <= _MAX_POS:
            raise InvalidArgumentError(f"window {side} bound must be -1 (none) or in [0, 2^62], got {int(value)}")
        bounds.append(int(value))
    if causal and bounds[1] > 0:
        raise InvalidArgumentError(f"window = {tuple(bounds)} with causal=True: the causal mask already hides every "
                                   f"later key; the right bound must be -1 or 0")
    return bounds[0], bounds[1]


def softcap_value(softcap):
    """The soft-capping for the binding: a finite real >= 0, 0.0 for None (none)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(f"softcap must be a real number, got {type(softcap).__name__} {short(softcap)}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"softcap must be finite and >= 0 (0 or None: no soft-capping), got {value}")
    return value


def _sink_logits(sinks, lse, H):
    """sinks as a [1, heads, 1] float tensor (or array) of lse's library, device and dtype."""
    _require_tensor(sinks, "sinks")
    if tuple(sinks.shape) != (H,):
        raise InvalidArgumentError(f"sinks must have shape [heads] = [{H}], got {list(sinks.shape)}")
    if _is_torch(lse):
        return sinks.detach().to(device=lse.device, dtype=lse.dtype).reshape(1, H, 1)
    return np.asarray(sinks, dtype=lse.dtype).reshape(1, H, 1)


def fold_sinks_(out, lse, sinks):
    """Add learned per-head sink logits (gpt-oss) to finished attention rows, in place: each row's softmax gains a
    term exp(sinks[h]) in its denominator that attends to nothing,

        lse_new = logaddexp(lse, sinks[h]);  out *= exp(lse - lse_new)

    The sink is one more "block" of the softmax with O = 0 and LSE = sinks[h], so it is folded like any ring step:
    once, after every key block is merged, and the backward of the kernels taken with (out, lse_new) is then exact
    for q, k and v (see sinks_backward for the sinks' own gradient). A row that saw no key gets out = 0 and
    lse = sinks[h]. out: [batch, seq, heads, head_dim]; lse: [batch, heads, seq]; sinks: [heads]. Returns None.
    """
    H = lse.shape[1]
    sink = _sink_logits(sinks, lse, H)
    if _is_torch(lse):
        torch = _torch_module()
        new = torch.logaddexp(lse, sink.expand_as(lse))
        weight = torch.exp(lse - new)
        out.mul_(weight.transpose(1, 2).unsqueeze(-1).to(out.dtype))
        lse.copy_(new)
    else:
        new = np.logaddexp(lse, sink)
        out *= np.exp(lse - new).transpose(0, 2, 1)[..., None].astype(out.dtype)
        lse[...] = new


def sinks_backward(out, dout, lse, sinks):
    """The gradient of the sink logits: d sinks[h] = -sum over batch and rows of exp(sinks[h] - lse) * D, with
    D = rowsum(dout * out), out and lse the folded ones (fold_sinks_). Returns a [heads] tensor (or array) in lse's
    dtype."""
    H = lse.shape[1]
    sink = _sink_logits(sinks, lse, H)
    if _is_torch(lse):
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)  # [batch, heads, seq]
        return -(_torch_module().exp(sink - lse) * delta).sum(dim=(0, 2))
    delta = (dout.astype(lse.dtype) * out.astype(lse.dtype)).sum(-1).transpose(0, 2, 1)
    return -(np.exp(sink - lse) * delta).sum(axis=(0, 2))


def document_starts(lengths, positions=None):
    """The q_doc of a packed sequence: for each absolute position, the position at which its document starts.

    Args:
        lengths: the documents' lengths in sequence order (ints >= 0; a sequence, NumPy array or torch tensor),
            summing to the sequence length S >= 1.
        positions: the absolute positions to answer for (ints in [0, S), any shape), e.g. the positions of one
            ring or zigzag chunk; default 0 .. S - 1.

    Returns:
        int64 starts shaped like positions: a NumPy array, or a torch tensor on positions' device when positions
        is a torch tensor. For a batch of sequences, stack one row per sequence ([batch, seq_q]).
    """
    as_torch = _is_torch(positions)
    device = positions.device if as_torch else None
    if _is_torch(lengths):
        lengths = lengths.detach().cpu().numpy()
    if _is_torch(positions):
        positions = positions.detach().cpu().numpy()
    lens = np.asarray(lengths)
    if lens.ndim != 1 or not (np.issubdtype(lens.dtype, np.integer) or lens.size == 0):
        raise ArgumentTypeError(f"lengths must be a 1-D sequence of ints, got {short(lengths)}")
    if (lens < 0).any():
        raise InvalidArgumentError(f"lengths must be >= 0, got {short(lengths)}")
    ends = np.cumsum(lens.astype(np.int64))
    total = int(ends[-1]) if ends.size else 0
    if total < 1:
        raise InvalidArgumentError(f"lengths must sum to a sequence length >= 1, got {short(lengths)}")
    pos = np.arange(total, dtype=np.int64) if positions is None else np.asarray(positions)
    if not np.issubdtype(pos.dtype, np.integer):
        raise ArgumentTypeError(f"positions must be ints, got dtype {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() >= total):
        raise InvalidArgumentError(f"positions must be in [0, {total}) (the sum of lengths), got values from "
                                   f"{int(pos.min())} to {int(pos.max())}")
    starts = np.concatenate(([0], ends[:-1]))
    # the document of position x is the first whose end lies past x (empty documents end where they start)
    q_doc = starts[np.searchsorted(ends, pos, side="right")].astype(np.int64)
    if as_torch:
        return _torch_module().from_numpy(q_doc).to(device)
    return q_doc


def attention_forward(q, k, v, *, causal=True, q_pos0=0, k_pos0=0, scale=None, out=None, lse=None, q_doc=None,
                      window=None, softcap=None, sinks=None):
    """Attention of one query block against one key/value block; returns (out, lse).

    out = softmax(scale * q k^T + mask) v per (batch, query head); query head h reads kv head
    h // (heads // kv_heads). Query row i sits at absolute position q_pos0 + i and key row j at k_pos0 + j;
    with causal=True key j is visible to query i iff k_pos0 + j <= q_pos0 + i. With a document mask q_doc (packed
    sequences), key j is visible to query i of batch b iff q_doc[b, i] <= k_pos0 + j <= q_pos0 + i. A query row that
    sees no key, or whose visible scores are all -inf, gets out = 0 and lse = -inf. A NaN or an infinity in q or k
    propagates as in torch: a row with a NaN (or +inf) among its visible scores gets out and lse NaN, and the
    backward carries NaN to its dq and to the dk, dv of the keys it sees; masked keys stay out of it.

    Args:
        q: [batch, seq_q, heads, head_dim], float64/float32/float16/bfloat16, torch.Tensor or numpy.ndarray.
        k: [batch, seq_k, kv_heads, head_dim], same dtype as q; heads % kv_heads == 0.
        v: [batch, seq_k, kv_heads, head_dim], same dtype as q.
        causal: apply the causal mask at the absolute positions above.
        q_pos0, k_pos0: absolute position of the first query / key row, >= 0.
        scale: softmax scale; default 1 / sqrt(head_dim).
        out: [batch, seq_q, heads, head_dim], q's dtype, written in place; allocated with q's library if None.
        lse: [batch, heads, seq_q], float64 for float64 q else float32: natural log of each row's sum of
            exp(scale * scores); written in place; allocated if None.
        q_doc: int64 [batch, seq_q], or [seq_q] for every batch row: the absolute position at which each query
            row's document starts, 0 <= q_doc[b, i] <= q_pos0 + i (see document_starts). Needs causal=True. On the
            CPU the values are checked; with CUDA tensors they are not (reading them would synchronise the stream):
            there a start past its own position leaves the row seeing nothing and one below 0 acts as 0. None: no
            document mask.
        window: a sliding window (left, right), as FlashAttention's window_size: key j is visible to query i only
            if (q_pos0 + i) - (k_pos0 + j) <= left and (k_pos0 + j) - (q_pos0 + i) <= right, -1 meaning no bound
            on that side; on top of causal and q_doc (with causal=True, right must be -1 or 0). A Hugging Face
            sliding_window of W tokens is window=(W - 1, 0). None: no window.
        softcap: logit soft-capping (Gemma 2): each score x = scale q.k becomes softcap * tanh(x / softcap) before
            the softmax; lse is that of the capped scores. None or 0: none.
        sinks: learned per-head sink logits (gpt-oss), [heads]: each row's softmax gains exp(sinks[h]) in its
            denominator (see fold_sinks_); lse then includes it. None: none.

    Returns:
        (out, lse) as above (the given objects when passed).

        causal is a bool (or 0 / 1); q_pos0, k_pos0 are ints in [0, 2^62]; scale is a finite real > 0 (the CUDA
        forward takes each row's max on unscaled scores, which needs a positive scale). torch tensors with the
        negative or conjugate bit set (lazy views such as z.conj().imag) are resolved when they are inputs and
        refused when they are outputs (DLPack would expose their stored, not their shown, values).

    Raises:
        hexiseq.InvalidArgumentError (a ValueError) for any bad argument: mismatched shapes or dtypes, read-only
        outputs, outputs overlapping inputs, tensors on different devices, out-of-range values; its subclass
        hexiseq.ArgumentTypeError (also a TypeError) for a value of the wrong kind (a non-tensor, a float position,
        a string scale or flag). hexiseq.errors.UnsupportedError for an unsupported dtype (float32/float64 on CUDA),
        head_dim > 256, a device other than CPU or CUDA, or CUDA tensors on a build without CUDA. Messages name the
        argument and the value. An exception raised by a producer's own __dlpack__ keeps its type, with
        "<argument>.__dlpack__() failed: " in front.
    """
    B, Sq, H, D = _shape4(q, "q", "[batch, seq_q, heads, head_dim]")
    Sk = _shape4(k, "k", "[batch, seq_k, kv_heads, head_dim]")[1]
    _require_tensor(v, "v")
    causal = _flag(causal, "causal")
    scale = _default_scale(scale, D)
    q_pos0 = _position(q_pos0, "q_pos0")
    k_pos0 = _position(k_pos0, "k_pos0")
    q_doc = _doc_operand(q_doc, causal)
    window_left, window_right = window_bounds(window, causal)
    softcap = softcap_value(softcap)
    for x, n in ((out, "out"), (lse, "lse")):
        if x is not None:
            _require_tensor(x, n)
    if out is None:
        out = _new(q, (B, Sq, H, D))
    if lse is None:
        lse = _new(q, (B, H, Sq), lse=True)
    named = ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))
    named += ((q_doc, "q_doc"),) if q_doc is not None else ()
    device = _device_of(named)
    args = [_as_operand(x, n, device, output=n in ("out", "lse")) for x, n in named]
    variant = (args[5] if q_doc is not None else None, window_left, window_right, softcap)  # the optional tail
    if device is None:
        _core.attention_forward(*args[:5], causal, q_pos0, k_pos0, scale, *variant)
    else:
        with _torch_module().cuda.device(device):
            _core.attention_forward_cuda(*args[:5], causal, q_pos0, k_pos0, scale, _stream_of(device), *variant)
    if Sk == 0 and B * Sq * H > 0:  # no key at all: every row is fully masked (the kernel was not called)
        _fill(out, 0.0)
        _fill(lse, -math.inf)
    if sinks is not None:
        fold_sinks_(out, lse, sinks)
    return out, lse


def attention_backward(q, k, v, out, lse, dout, *, causal=True, q_pos0=0, k_pos0=0, scale=None, dq=None, dk=None,
                       dv=None, accumulate=False, q_doc=None, window=None, softcap=None, sinks=None):
    """Gradients of attention_forward; returns (dq, dk, dv), and with sinks (dq, dk, dv, dsinks).

    out and lse are taken as given, never recomputed: with the globally merged out and lse of a ring (see
    merge_), the dq of the key blocks sum to the dq of the whole sequence, and each block's dk, dv are that
    block's slice of the whole gradient (accumulate=True sums pieces in place).

    Args:
        q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim]; one dtype.
        out: [batch, seq_q, heads, head_dim], the forward output (q's dtype).
        lse: [batch, heads, seq_q], the forward log-sum-exp (float64 for float64 q else float32).
        dout: [batch, seq_q, heads, head_dim], gradient of out (q's dtype).
        causal, q_pos0, k_pos0, scale, q_doc, window, softcap: as in attention_forward (must match the forward
            call).
        sinks: the forward's sink logits, [heads]: out and lse are then the forward's, sinks included (the
            kernels' backward is exact with them as they are), and the sinks' gradient is returned fourth.
        dq: [batch, seq_q, heads, head_dim]; dk, dv: [batch, seq_k, kv_heads, head_dim]; q's dtype. Written in
            place (or added into when accumulate=True); allocated with q's library if None (zeros when
            accumulating).
        accumulate: add into dq, dk, dv instead of overwriting them (a bool, or 0 / 1).

    Returns:
        (dq, dk, dv) as above (the given objects when passed).

    Raises:
        As attention_forward; every output must be writable and disjoint from every other tensor.
    """
    B, Sq, H, D = _shape4(q, "q", "[batch, seq_q, heads, head_dim]")
    kshape = _shape4(k, "k", "[batch, seq_k, kv_heads, head_dim]")
    for x, n in ((v, "v"), (out, "out"), (lse, "lse"), (dout, "dout")):
        _require_tensor(x, n)
    causal = _flag(causal, "causal")
    scale = _default_scale(scale, D)
    q_pos0 = _position(q_pos0, "q_pos0")
    k_pos0 = _position(k_pos0, "k_pos0")
    accumulate = _flag(accumulate, "accumulate")
    q_doc = _doc_operand(q_doc, causal)
    window_left, window_right = window_bounds(window, causal)
    softcap = softcap_value(softcap)
    for x, n in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
        if x is not None:
            _require_tensor(x, n)
    if dq is None:
        dq = _new(q, (B, Sq, H, D), zero=accumulate)
    if dk is None:
        dk = _new(q, kshape, zero=accumulate)
    if dv is None:
        dv = _new(q, kshape, zero=accumulate)
    named = ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dout, "dout"), (dq, "dq"), (dk, "dk"),
             (dv, "dv")) + (((q_doc, "q_doc"),) if q_doc is not None else ())
    device = _device_of(named)
    args = [_as_operand(x, n, device, output=n in ("dq", "dk", "dv")) for x, n in named]
    variant = (args[9] if q_doc is not None else None, window_left, window_right, softcap)  # the optional tail
    if device is None:
        _core.attention_backward(*args[:9], causal, q_pos0, k_pos0, scale, accumulate, *variant)
    else:
        with _torch_module().cuda.device(device):
            _core.attention_backward_cuda(*args[:9], causal, q_pos0, k_pos0, scale, accumulate, _stream_of(device),
                                          *variant)
    if not accumulate:  # the kernel was not called when a sequence is empty: the other side gets no gradient
        if kshape[1] == 0 and B * Sq * H > 0:
            _fill(dq, 0.0)
        if Sq == 0 and B * kshape[1] * kshape[2] > 0:
            _fill(dk, 0.0)
            _fill(dv, 0.0)
    if sinks is not None:
        return dq, dk, dv, sinks_backward(out, dout, lse, sinks)
    return dq, dk, dv


def merge_(out_acc, lse_acc, out_part, lse_part):
    """Fold a partial attention result into an accumulator, in place (the ring-attention merge):

        lse_new = logaddexp(lse_acc, lse_part)
        out_acc = exp(lse_acc - lse_new) * out_acc + exp(lse_part - lse_new) * out_part

    computed in float64. Rows with lse_part = -inf leave the accumulator row unchanged; rows with
    lse_acc = -inf take the partial. The two sides may differ in dtype (e.g. a float32 accumulator of
    bfloat16 partials).

    Args:
        out_acc: [batch, seq, heads, head_dim], updated in place.
        lse_acc: [batch, heads, seq], float64 when out_acc is float64 else float32; updated in place.
        out_part: [batch, seq, heads, head_dim].
        lse_part: [batch, heads, seq], float64 when out_part is float64 else float32.

    Returns:
        None.
    """
    _shape4(out_acc, "out_acc", "[batch, seq, heads, head_dim]")
    named = ((out_acc, "out_acc"), (lse_acc, "lse_acc"), (out_part, "out_part"), (lse_part, "lse_part"))
    for x, n in named[1:]:
        _require_tensor(x, n)
    device = _device_of(named)
    args = [_as_operand(x, n, device, output=n in ("out_acc", "lse_acc")) for x, n in named]
    if device is None:
        _core.attention_merge(*args)
    else:
        with _torch_module().cuda.device(device):
            _core.attention_merge_cuda(*args, _stream_of(device))
