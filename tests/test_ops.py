"""Numerics of hexiseq.ops (forward, backward, merge_) on the CPU kernels against the float64 reference
(tests/helpers/reference.py) and torch SDPA: the CPU-only cases. The cases every backend shares (causal offsets,
fully masked rows, split-KV merge, merge) are in tests/test_attention_ops.py.

Tolerances (relative: max |error| / max |reference|):
  float64  1e-12: the kernels compute in float64; rounding error of sums of up to 1025 terms is ~1e-14.
  float32  1e-5: float32 accumulation over 1025 keys keeps ~1e-6 relative error.
  float16  1e-3 (NumPy): the output is rounded to binary16 (half an ulp = 2^-11 ~ 4.9e-4 relative).
  bfloat16 / float16 (torch): at most 2x the error of torch's own SDPA in that dtype against the float64
           reference on the same (rounded) inputs, as flash-attention tests do.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hexiseq import ops
from reference import attention, attention_backward
from attention_backends import rand, rel_err

RTOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3}


# ------------------------------------------------------------------------------------------------ NumPy

# (batch, seq_q, seq_k, heads, kv_heads, head_dim): sizes 1, 97, 1025; MHA, GQA 8:2, MQA; batch > 1
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (3, 97, 97, 8, 2, 16),
    (2, 97, 1025, 4, 1, 8),
    (1, 1025, 1025, 2, 2, 16),
    (2, 1, 97, 8, 2, 32),
]


NUMPY_CASES = [(shape, dtype) for shape in SHAPES for dtype in ("float64", "float32", "float16")
               if dtype != "float16" or shape[1] * shape[2] <= 97 * 1025]  # one long float16 case is enough


@pytest.mark.parametrize("shape,dtype", NUMPY_CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_backward_numpy(shape, dtype, causal):
    B, Sq, Sk, H, Hkv, D = shape
    rng = np.random.default_rng(hash((shape, dtype, causal)) % 2**32)
    q, k, v = rand(rng, (B, Sq, H, D), dtype), rand(rng, (B, Sk, Hkv, D), dtype), rand(rng, (B, Sk, Hkv, D), dtype)
    # queries at the end of the key range so that causal rows see between 1 and Sk keys
    q_pos0 = Sk - Sq if Sk >= Sq else 0
    out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=q_pos0)
    assert out.dtype == np.dtype(dtype) and out.shape == (B, Sq, H, D)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32) and lse.shape == (B, H, Sq)
    ref_o, ref_l = attention(q, k, v, causal=causal, q_pos0=q_pos0)
    tol = RTOL[dtype]
    assert rel_err(out, ref_o) <= tol
    assert np.abs(lse - ref_l).max() <= tol * max(1.0, np.abs(ref_l).max())
    if dtype == "float16":
        return
    dout = rand(rng, (B, Sq, H, D), dtype)
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, causal=causal, q_pos0=q_pos0)
    refs = attention_backward(q, k, v, out, lse, dout, causal=causal, q_pos0=q_pos0)
    for got, ref in zip((dq, dk, dv), refs):
        assert got.dtype == np.dtype(dtype)
        assert rel_err(got, ref, 1.0) <= 4 * tol, (rel_err(got, ref, 1.0), tol)


def test_non_contiguous_numpy():
    rng = np.random.default_rng(7)
    B, S, H, Hkv, D = 2, 97, 8, 2, 16
    q = rand(rng, (B, H, S, D)).transpose(0, 2, 1, 3)           # heads-major storage
    k = rand(rng, (B, S, Hkv, 2 * D))[..., ::2]                 # strided head_dim
    v = rand(rng, (B, 2 * S, Hkv, D))[:, ::-2]                  # negative sequence stride
    out = np.empty((H, B, D, S)).transpose(1, 3, 0, 2)          # out written through a permuted view
    lse = np.empty((S, H, B)).transpose(2, 1, 0)
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous or out.flags.c_contiguous)
    res = ops.attention_forward(q, k, v, out=out, lse=lse, q_pos0=3, k_pos0=0)
    assert res[0] is out and res[1] is lse
    ref_o, ref_l = attention(q, k, v, causal=True, q_pos0=3)
    assert rel_err(out, ref_o) <= 1e-12 and rel_err(lse, ref_l) <= 1e-12
    dout = rand(rng, (B, S, H, D))
    big = np.zeros((B, S, Hkv, 3 * D))
    dv_t = np.zeros((Hkv, D, B, S)).transpose(2, 3, 0, 1)
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, q_pos0=3, dk=big[..., D:2 * D], dv=dv_t)
    for g, r in zip((dq, dk, dv), attention_backward(q, k, v, out, lse, dout, causal=True, q_pos0=3)):
        assert rel_err(g, r, 1.0) <= 1e-12
    assert np.all(big[..., :D] == 0.0) and np.all(big[..., 2 * D:] == 0.0)  # around dk: untouched


def test_scale_argument():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (1, 17, 2, 8)), rand(rng, (1, 17, 2, 8)), rand(rng, (1, 17, 2, 8))
    out, lse = ops.attention_forward(q, k, v, causal=False, scale=0.3)
    ref_o, ref_l = attention(q, k, v, causal=False, scale=0.3)
    assert rel_err(out, ref_o) <= 1e-12 and rel_err(lse, ref_l) <= 1e-12


def test_numpy_only_without_torch():
    """torch stays optional: with its import blocked, NumPy use works."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, hexiseq\n"
            "q = np.ones((1, 4, 2, 8)); o, l = hexiseq.ops.attention_forward(q, q, q)\n"
            "assert np.allclose(o, 1.0) and l.dtype == np.float64\n"
            "hexiseq.ops.merge_(o, l, o.copy(), l.copy()); print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------------------------------------ torch SDPA

def sdpa(torch, q, k, v, causal, q_pos0, k_pos0, scale):
    """torch SDPA on [B, S, H, D] tensors with the absolute-position causal mask; returns [B, S, H, D]."""
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        qpos = q_pos0 + torch.arange(Sq)
        kpos = k_pos0 + torch.arange(Sk)
        mask = kpos[None, :] <= qpos[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def sdpa_grads(torch, q, k, v, dout, causal, q_pos0, k_pos0, scale):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = sdpa(torch, q, k, v, causal, q_pos0, k_pos0, scale)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


TORCH_CASES = [  # (B, Sq, Sk, H, Hkv, D, q_pos0, k_pos0): every causal row sees at least one key
    (1, 1, 1, 1, 1, 8, 0, 0),
    (2, 97, 97, 8, 2, 16, 0, 0),      # GQA 8:2, same block
    (2, 97, 150, 4, 1, 8, 53, 0),     # MQA, queries at the end of the keys
    (1, 1025, 1025, 2, 1, 16, 0, 0),  # MQA, long
    (2, 61, 97, 4, 2, 32, 400, 0),    # q block after the key block
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [True, False])
def test_float64_vs_torch_sdpa(case, causal):
    torch = pytest.importorskip("torch")
    B, Sq, Sk, H, Hkv, D, qp, kp = case
    g = torch.Generator().manual_seed(Sq * 7 + Sk)
    q = torch.randn(B, Sq, H, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, Sk, Hkv, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, Sk, Hkv, D, dtype=torch.float64, generator=g)
    dout = torch.randn(B, Sq, H, D, dtype=torch.float64, generator=g)
    scale = 1.0 / math.sqrt(D)
    o_ref, dq_ref, dk_ref, dv_ref = sdpa_grads(torch, q, k, v, dout, causal, qp, kp, scale)
    out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=kp)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and lse.dtype == torch.float64
    assert rel_err(out.numpy(), o_ref.numpy()) <= 1e-12
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, causal=causal, q_pos0=qp, k_pos0=kp)
    assert rel_err(dq.numpy(), dq_ref.numpy(), 1.0) <= 1e-12
    assert rel_err(dk.numpy(), dk_ref.numpy(), 1.0) <= 1e-12
    assert rel_err(dv.numpy(), dv_ref.numpy(), 1.0) <= 1e-12
    # lse against the float64 NumPy reference
    _, ref_l = attention(q.numpy(), k.numpy(), v.numpy(), causal=causal, q_pos0=qp, k_pos0=kp)
    assert rel_err(lse.numpy(), ref_l) <= 1e-12


def test_torch_non_contiguous_and_requires_grad():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    B, S, H, Hkv, D = 2, 97, 8, 2, 16
    q = torch.randn(B, H, S, D, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_(True)
    kv = torch.randn(B, S, 2, Hkv, D, dtype=torch.float64, generator=g)
    k, v = kv[:, :, 0], kv[:, :, 1]                    # interleaved storage of k and v
    out = torch.empty(B, H, S, D, dtype=torch.float64).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or out.is_contiguous())
    ops.attention_forward(q, k, v, out=out, q_pos0=5)
    o_ref = sdpa(torch, q.detach(), k, v, True, 5, 0, 1 / math.sqrt(D))
    assert rel_err(out.numpy(), o_ref.numpy()) <= 1e-12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", [TORCH_CASES[1], TORCH_CASES[2], TORCH_CASES[3]], ids=lambda c: "x".join(map(str, c)))
def test_low_precision_vs_torch_sdpa(case, dtype):
    """Error against the float64 result on the same rounded inputs: at most 2x torch SDPA's own in `dtype`."""
    torch = pytest.importorskip("torch")
    B, Sq, Sk, H, Hkv, D, qp, kp = case
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(Sq + Sk + D)
    q, k, v, dout = (torch.randn(*s, generator=g).to(dt) for s in
                     ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)))
    scale = 1.0 / math.sqrt(D)
    ref = sdpa_grads(torch, *(x.double() for x in (q, k, v, dout)), True, qp, kp, scale)
    low = sdpa_grads(torch, q, k, v, dout, True, qp, kp, scale)
    out, lse = ops.attention_forward(q, k, v, q_pos0=qp, k_pos0=kp)
    assert out.dtype == dt and lse.dtype == torch.float32
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, q_pos0=qp, k_pos0=kp)
    for name, mine, theirs, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), low, ref):
        err_mine = (mine.double() - r).abs().max().item()
        err_torch = (theirs.double() - r).abs().max().item()
        floor = 1e-6 * r.abs().max().item() if dtype == "float32" else 0.0  # float32 errors can both be ~0
        assert err_mine <= 2 * err_torch + floor, (name, err_mine, err_torch)


# ------------------------------------------------------------------------------------------------ document mask

def _doc_lengths(rng, total, longest):
    """Random document lengths summing to total, 1..longest each (length-1 documents included)."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(rng.integers(1, longest + 1), total - sum(lengths))))
    return lengths


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("longest", [1, 5, 130])
def test_document_mask_numpy(dtype, longest):
    B, S, H, Hkv, D = 2, 301, 4, 2, 16
    rng = np.random.default_rng(longest)
    q, k, v = rand(rng, (B, S, H, D), dtype), rand(rng, (B, S, Hkv, D), dtype), rand(rng, (B, S, Hkv, D), dtype)
    q_doc = np.stack([ops.document_starts(_doc_lengths(rng, S, longest)) for _ in range(B)])
    out, lse = ops.attention_forward(q, k, v, q_doc=q_doc)
    ref_o, ref_l = attention(q, k, v, causal=True, q_doc=q_doc)
    tol = RTOL[dtype]
    assert rel_err(out, ref_o) <= tol
    assert np.abs(lse - ref_l).max() <= tol * max(1.0, np.abs(ref_l).max())
    dout = rand(rng, (B, S, H, D), dtype)
    grads = ops.attention_backward(q, k, v, out, lse, dout, q_doc=q_doc)
    refs = attention_backward(q, k, v, out, lse, dout, causal=True, q_doc=q_doc)
    for got, ref in zip(grads, refs):
        assert rel_err(got, ref, 1.0) <= 4 * tol, (rel_err(got, ref, 1.0), tol)


def test_document_mask_split_merge():
    """Keys split into blocks (ring steps), each forward merged with merge_ and each backward taking the merged
    out and lse: the unsplit document-masked result."""
    rng = np.random.default_rng(11)
    B, S, H, Hkv, D = 1, 257, 2, 1, 8
    q, k, v, dout = rand(rng, (B, S, H, D)), rand(rng, (B, S, Hkv, D)), rand(rng, (B, S, Hkv, D)), rand(rng, (B, S, H, D))
    q_doc = ops.document_starts(_doc_lengths(rng, S, 60))[None]
    out, lse = ops.attention_forward(q, k, v, q_doc=q_doc)
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, q_doc=q_doc)
    acc_o, acc_l = np.zeros_like(out), np.full_like(lse, -np.inf)
    bounds = [0, 64, 150, S]
    for a, b in zip(bounds, bounds[1:]):
        o_p, l_p = ops.attention_forward(q, k[:, a:b], v[:, a:b], k_pos0=a, q_doc=q_doc)
        ops.merge_(acc_o, acc_l, o_p, l_p)
    assert rel_err(acc_o, out) <= 1e-12
    assert np.abs(acc_l - lse).max() <= 1e-12 * np.abs(lse).max()
    sdq = np.zeros_like(dq)
    for a, b in zip(bounds, bounds[1:]):
        _, dk_p, dv_p = ops.attention_backward(q, k[:, a:b], v[:, a:b], acc_o, acc_l, dout, k_pos0=a, q_doc=q_doc,
                                               dq=sdq, accumulate=True)
        assert rel_err(dk_p, dk[:, a:b], 1.0) <= 1e-12 and rel_err(dv_p, dv[:, a:b], 1.0) <= 1e-12
    assert rel_err(sdq, dq, 1.0) <= 1e-12


def test_document_mask_torch_and_one_document():
    """torch operands (q_doc a CPU int64 tensor); one document over everything is the plain causal result."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 130, 2, 8, generator=g) for _ in range(3))
    one = torch.zeros(130, dtype=torch.int64)
    out, lse = ops.attention_forward(q, k, v, q_doc=one)
    plain_o, plain_l = ops.attention_forward(q, k, v)
    assert torch.equal(out, plain_o) and torch.equal(lse, plain_l)
    dout = torch.randn(2, 130, 2, 8, generator=g)
    for got, ref in zip(ops.attention_backward(q, k, v, out, lse, dout, q_doc=one),
                        ops.attention_backward(q, k, v, out, lse, dout)):
        assert torch.equal(got, ref)
    starts = ops.document_starts(torch.tensor([100, 30]), positions=torch.arange(130))
    assert isinstance(starts, torch.Tensor) and starts.dtype == torch.int64
    out, lse = ops.attention_forward(q, k, v, q_doc=starts.expand(2, 130))
    ref_o, _ = attention(q, k, v, causal=True, q_doc=starts)
    assert rel_err(out.numpy(), ref_o.numpy()) <= 1e-5


def test_document_starts():
    assert ops.document_starts([3, 1, 0, 4]).tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert ops.document_starts(np.array([3, 1, 0, 4]), positions=[7, 2, 3]).tolist() == [4, 0, 3]
    got = ops.document_starts([2, 2], positions=np.array([[0, 1], [2, 3]]))
    assert got.dtype == np.int64 and got.tolist() == [[0, 0], [2, 2]]
    with pytest.raises(ops.InvalidArgumentError, match="positions"):
        ops.document_starts([2, 2], positions=[4])
    with pytest.raises(ops.InvalidArgumentError, match="lengths"):
        ops.document_starts([2, -1, 3])
    with pytest.raises(ops.InvalidArgumentError, match="lengths"):
        ops.document_starts([0, 0])
    with pytest.raises(ops.ArgumentTypeError, match="lengths"):
        ops.document_starts([1.5, 2])


def test_document_mask_errors():
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, (2, 9, 2, 4)), rand(rng, (2, 9, 1, 4)), rand(rng, (2, 9, 1, 4))
    good = np.zeros((2, 9), np.int64)
    cases = [
        (dict(q_doc=good.astype(np.float64)), ops.InvalidArgumentError, "q_doc must have dtype int64"),
        (dict(q_doc=good[:, :5]), ops.InvalidArgumentError, r"q_doc must have shape \[batch, seq_q\]"),
        (dict(q_doc=np.zeros(8, np.int64)), ops.InvalidArgumentError, "q_doc must have shape"),
        (dict(q_doc=np.zeros((2, 9, 1), np.int64)), ops.InvalidArgumentError, "q_doc must be 1-D to 2-D"),
        (dict(q_doc=good + 1), ops.InvalidArgumentError, r"q_doc\[0, 0\] = 1"),
        (dict(q_doc=good - 1), ops.InvalidArgumentError, r"q_doc\[0, 0\] = -1"),
        (dict(q_doc=good, causal=False), ops.InvalidArgumentError, "q_doc .*causal"),
        (dict(q_doc=[0] * 9), ops.ArgumentTypeError, "q_doc must be"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            ops.attention_forward(q, k, v, **kwargs)
    out, lse = ops.attention_forward(q, k, v, q_doc=good)
    with pytest.raises(ops.InvalidArgumentError, match=r"q_doc\[1, 3\] = 4"):
        bad = good.copy()
        bad[1, 3] = 4
        ops.attention_backward(q, k, v, out, lse, q, q_doc=bad)
