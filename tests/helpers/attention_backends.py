"""The backends hexiseq.ops runs attention on, as the tests drive them, and the numerical rule each is held to.

cpu  NumPy arrays into the C kernels (csrc/attention/attention_cpu.c); always present. float64 results are held to
     1e-12 of the float64 reference (tests/helpers/reference.py): the kernels compute in float64, and the rounding
     error of sums of up to ~1000 terms is ~1e-14.
cuda torch CUDA tensors into the CUDA kernels (kernels/forward.cu, kernels/backward.cu; bf16 / fp16); present only with
     a GPU visible to torch and a CUDA build of hexiseq. Tolerance rule (FlashAttention's): on the same bf16/fp16
     inputs, the error of our output against a float64 reference is at most twice the error of torch's own low-precision
     computation against the same reference, plus a floor of 1e-3 x the reference's largest magnitude (both sides can be
     exact, e.g. one key, and a floor far under one bf16 ulp of the data still catches any real bug). Forward baseline:
     torch SDPA in the input dtype on the GPU (rows that see no key are left out of it: SDPA gives NaN there). Backward
     baseline: the same math written with torch ops in the input dtype (as FlashAttention's
     attention_ref(upcast=False)), because SDPA's backward gives NaN gradients through fully masked rows.

A test body shared by both backends takes a `backend` (CPU or CUDA below) and a case from a per-backend table
(`over_backends`): shapes, dtypes and tolerances stay each backend's own.
"""

import math
import types

import numpy as np
import pytest
import torch

import hexiseq
from hexiseq import ops
from reference import attention, attention_backward, visible


def cuda_skip_reason():
    """Why the CUDA kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (torch.cuda.is_available() is False)"
    if not hexiseq.build_info()["cuda"]:
        return "hexiseq was built without CUDA kernels (no nvcc or HEXISEQ_CUDA=0)"
    return None


def case(name, **fields):
    """One row of a per-backend case table: a name for the test id and the fields the body reads."""
    return types.SimpleNamespace(name=name, **fields)


def over_backends(cpu, cuda):
    """parametrize("backend,case") over the cpu cases, then the cuda cases, the latter skipped (with the reason)
    where the CUDA kernels cannot run."""
    reason = cuda_skip_reason()
    params = [pytest.param(CPU, c, id=f"cpu-{c.name}") for c in cpu]
    params += [pytest.param(CUDA, c, id=f"cuda-{c.name}", marks=pytest.mark.skipif(reason is not None,
                                                                                   reason=reason or ""))
               for c in cuda]
    return pytest.mark.parametrize("backend,case", params)


# ------------------------------------------------------------------------------------------------ cpu

def rel_err(x, ref, floor=0.0):
    """max |x - ref| / max(max |ref|, floor); floor = 1 for gradients, which vanish exactly in some cases (one
    visible key) while the unit-variance inputs put their natural scale at ~1."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert x.shape == ref.shape
    if ref.size == 0:
        return 0.0
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(x)), "non-finite entries differ"
    denom = max(np.abs(ref[fin]).max(initial=0.0), floor, 1e-300)
    return np.abs(x[fin] - ref[fin]).max(initial=0.0) / denom


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


class _Cpu:
    name = "cpu"
    device = "cpu"

    def gen(self, seed):
        return np.random.default_rng(seed)

    def randn(self, gen, shape, dtype=np.float64):
        return rand(gen, shape, dtype)

    def make(self, shape, dtype, seed):
        """(q, k, v) of shape (B, Sq, Sk, H, Hkv, D) and the generator, to draw more from the same stream."""
        B, Sq, Sk, H, Hkv, D = shape
        g = self.gen(seed)
        return (rand(g, (B, Sq, H, D), dtype), rand(g, (B, Sk, Hkv, D), dtype), rand(g, (B, Sk, Hkv, D), dtype)), g

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def tensor(self, x):
        """x as a torch tensor, for assertions written once for both backends."""
        return torch.from_numpy(np.ascontiguousarray(x))

    def check_forward(self, q, k, v, causal, q_pos0, k_pos0, what="", q_doc=None, **variant):
        """Forward within 1e-12 of the float64 reference; the same rows fully masked (lse = -inf). variant: window,
        softcap, sinks (as ops.attention_forward)."""
        out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, q_doc=q_doc, **variant)
        ref_o, ref_l = attention(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, q_doc=q_doc, **variant)
        assert rel_err(out, ref_o) <= 1e-12, what
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_l)), what
        fin = np.isfinite(ref_l)
        if fin.any():
            assert np.abs(lse[fin] - ref_l[fin]).max() <= 1e-12 * max(1.0, np.abs(ref_l[fin]).max()), what
        return out, lse

    def check_backward(self, q, k, v, causal, q_pos0, k_pos0, gen, what="", q_doc=None, **variant):
        """Backward (dout drawn from gen) finite and within 1e-12 of the float64 reference from the same out, lse;
        with sinks, their gradient within 1e-12 of autograd through the reference forward."""
        kw = dict(causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, q_doc=q_doc)
        out, lse = ops.attention_forward(q, k, v, **kw, **variant)
        dout = rand(gen, q.shape)
        got = ops.attention_backward(q, k, v, out, lse, dout, **kw, **variant)
        masks = {n: variant[n] for n in ("window", "softcap") if n in variant}
        for g, r in zip(got[:3], attention_backward(q, k, v, out, lse, dout, **kw, **masks)):
            assert np.all(np.isfinite(g)), what
            assert rel_err(g, r, 1.0) <= 1e-12, what
        if variant.get("sinks") is not None:
            sinks = torch.tensor(np.asarray(variant["sinks"], np.float64), requires_grad=True)
            qkv = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v))
            o, _ = attention(*qkv, **kw, **masks, sinks=sinks)
            o.backward(torch.from_numpy(np.ascontiguousarray(dout)))
            assert rel_err(got[3], sinks.grad.numpy(), 1.0) <= 1e-12, what

    def check_merged(self, acc, acc_lse, q, k, v, kw):
        """Split-KV forward merged into float64: within 1e-12 of the unsplit forward, whose out and lse it returns."""
        full_o, full_l = ops.attention_forward(q, k, v, **kw)
        assert rel_err(acc, full_o) <= 1e-12
        assert rel_err(acc_lse, full_l) <= 1e-12
        return full_o, full_l

    def split_dout(self, gen, q):
        return rand(gen, q.shape)

    def check_split_grad(self, name, got, full):
        assert rel_err(got, full, 1.0) <= 1e-12, name

    def merge_expected(self, oa, la, op, lp):
        """(out, lse) of merge_ by the float64 log-sum-exp formula."""
        la, lp = la.astype(np.float64), lp.astype(np.float64)
        ln = np.logaddexp(la, lp)
        wa = np.exp(la - ln).transpose(0, 2, 1)[..., None]
        wp = np.exp(lp - ln).transpose(0, 2, 1)[..., None]
        o0 = oa.astype(np.float64)
        return np.where(np.isneginf(lp).transpose(0, 2, 1)[..., None], o0, wa * o0 + wp * op.astype(np.float64)), ln

    def check_merge(self, oa, la, want, tol):
        assert rel_err(oa, want[0]) <= tol
        assert rel_err(la, want[1]) <= tol



# ------------------------------------------------------------------------------------------------ cuda

DEV = torch.device("cuda")
LOW = [torch.bfloat16, torch.float16]


def sdpa(q, k, v, *, causal, q_pos0, k_pos0, scale, q_doc=None, window=None, softcap=None, sinks=None):
    """torch SDPA in q's dtype on the same mask; [B, Sq, H, D]. SDPA has no soft-capping or sinks: for those the
    baseline is the reference's math in q's dtype (FlashAttention's attention_ref(upcast=False))."""
    if softcap or sinks is not None:
        return attention(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, q_doc=q_doc,
                         window=window, softcap=softcap, sinks=sinks, dtype=q.dtype)[0]
    H, Hkv = q.shape[2], k.shape[2]
    qq = q.transpose(1, 2)
    kk = k.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    vv = v.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    mask = visible(q.shape[1], k.shape[1], q_pos0, k_pos0, causal, q.device, q_doc, window)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def assert_close_2x(ours, base, ref, what, rows=None, floor=0.0):
    """max |ours - ref| <= 2 max |base - ref| + 1e-3 max |ref| + floor; rows: bool [.., Sq] selector for base's
    error; floor: an extra absolute allowance where the caller can bound a rounding residue."""
    ref = ref.double()
    err = (ours.double() - ref).abs().max().item()
    diff = (base.double() - ref).abs()
    if rows is not None:
        diff = diff[:, rows]
    err_base = diff.max().item() if diff.numel() else 0.0
    floor = 1e-3 * max(ref.abs().max().item(), 1e-6) + floor
    assert math.isfinite(err), f"{what}: non-finite output"
    assert err <= 2 * err_base + floor, f"{what}: error {err:.3g} > 2 x torch's {err_base:.3g} + {floor:.3g}"


def make(B, Sq, Sk, H, Hkv, D, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device=DEV, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, device=DEV, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, device=DEV, generator=g).to(dtype)
    return q, k, v


def check_forward(q, k, v, causal, q_pos0, k_pos0, scale=None, q_doc=None, **variant):
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kw = dict(causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, q_doc=q_doc, **variant)
    out, lse = ops.attention_forward(q, k, v, **kw)
    ref_out, ref_lse = attention(q, k, v, dtype=torch.float64, **kw)
    seen = visible(q.shape[1], k.shape[1], q_pos0, k_pos0, causal, DEV, q_doc, variant.get("window"))
    if variant.get("sinks") is not None:  # a sink is seen by every row
        seen = torch.ones_like(seen)
    assert seen.dim() == 2, "q_doc: one [seq_q] layout for every batch row, so that the rows that see a key are one set"
    rows = seen.any(-1)
    if rows.any():
        base = sdpa(q, k, v, **kw)
        assert_close_2x(out[:, rows], base[:, rows], ref_out[:, rows], "out")
        # lse: fp32 in both; compare against the low-precision math's fp32 logsumexp
        _, base_lse = attention(q, k, v, dtype=q.dtype, **kw)
        assert_close_2x(lse[:, :, rows], base_lse[:, :, rows], ref_lse[:, :, rows], "lse")
    dead = ~rows
    if dead.any():  # fully masked rows: exactly 0 and -inf
        assert torch.all(out[:, dead] == 0)
        assert torch.all(lse[:, :, dead] == -math.inf)
    return out, lse


def check_backward(q, k, v, causal, q_pos0, k_pos0, accumulate=False, q_doc=None, **variant):
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    sinks = variant.pop("sinks", None)
    kw = dict(causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, q_doc=q_doc, **variant)
    g = torch.Generator(device=DEV).manual_seed(7)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(q.dtype)
    out, lse = ops.attention_forward(q, k, v, **kw, sinks=sinks)
    dsinks = None
    if accumulate:
        start = [torch.randn(x.shape, device=DEV, generator=g).to(x.dtype) for x in (q, k, v)]
        dq, dk, dv = (x.clone() for x in start)
        ops.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, accumulate=True, **kw)
        dq, dk, dv = (a.double() - s.double() for a, s in zip((dq, dk, dv), start))
    elif sinks is not None:
        dq, dk, dv, dsinks = ops.attention_backward(q, k, v, out, lse, dout, **kw, sinks=sinks)
    else:
        dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, **kw)
    grads = {}
    for dtype in (torch.float64, q.dtype):
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        ss = None if sinks is None else sinks.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
        ss = None if ss is None else ss.requires_grad_()
        o, _ = attention(qq, kk, vv, dtype=dtype, **kw, sinks=ss)
        o.backward(dout.to(dtype))
        grads[dtype] = (qq.grad, kk.grad, vv.grad, None if ss is None else ss.grad)
    if dsinks is not None:
        assert_close_2x(dsinks, grads[q.dtype][3], grads[torch.float64][3], "dsinks")
    # dS = P (dP - D) subtracts two fp32 sums of the same products (dO_i . V_j and dO_i . O_i) that the kernel and
    # the reference add in different orders. Where they cancel exactly (one key: P = 1 and O = V) the float64
    # reference is exactly 0 and so is torch's, but a correct fp32 kernel leaves a rounding residue (seen on an
    # H100: 7e-7). Bound: 2^-20 of the largest |dO_i| |V_j| (a few fp32 ulps of those sums), carried through
    # scale and |K| into dQ, through scale and |Q| into dK; it is far under 1e-3 of any non-degenerate gradient.
    cancel = 2.0 ** -20 * dout.double().norm(dim=-1).max().item() * v.double().norm(dim=-1).max().item() * scale
    floors = (cancel * k.double().abs().max().item(), cancel * q.double().abs().max().item(), 0.0)
    for name, ours, ref, base, fl in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype], floors):
        assert_close_2x(ours, base, ref, name, floor=fl)


class _Cuda:
    name = "cuda"
    device = DEV

    def gen(self, seed):
        return torch.Generator(device=DEV).manual_seed(seed)

    def randn(self, gen, shape, dtype):
        return torch.randn(*shape, device=DEV, generator=gen).to(dtype)

    def make(self, shape, dtype, seed):
        """(q, k, v) as make() draws them; no generator to draw on (check_backward seeds its own)."""
        return make(*shape, dtype, seed), None

    def zeros(self, shape, dtype):
        return torch.zeros(shape, device=DEV, dtype=dtype)

    def tensor(self, x):
        return x

    def check_forward(self, q, k, v, causal, q_pos0, k_pos0, what="", q_doc=None, **variant):
        return check_forward(q, k, v, causal, q_pos0, k_pos0, q_doc=q_doc, **variant)

    def check_backward(self, q, k, v, causal, q_pos0, k_pos0, gen, what="", q_doc=None, **variant):
        check_backward(q, k, v, causal, q_pos0, k_pos0, q_doc=q_doc, **variant)

    def check_merged(self, acc, acc_lse, q, k, v, kw):
        """Split-KV forward merged into fp32: the 2x rule against float64 for out, lse within 1e-3; returns the
        out (in q's dtype) and lse the backward pieces use."""
        scale = q.shape[-1] ** -0.5
        ref_out, ref_lse = attention(q, k, v, scale=scale, dtype=torch.float64, **kw)
        base = sdpa(q, k, v, scale=scale, **kw)
        assert_close_2x(acc, base, ref_out, "merged out")
        assert torch.allclose(acc_lse.double(), ref_lse, atol=1e-3)
        return acc.to(q.dtype), acc_lse

    def split_dout(self, gen, q):
        return torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).to(q.dtype)

    def check_split_grad(self, name, got, full):
        # dk, dv: each block computes exactly its slice (same tiles, same order); dq: a sum of bf16-rounded pieces
        scale = full.float().abs().max().item()
        if name == "dq":
            assert (got - full.float()).abs().max().item() <= 2e-2 * scale
        else:
            assert torch.allclose(got.float(), full.float(), atol=2e-2 * scale), name

    def merge_expected(self, oa, la, op, lp):
        """(out, lse) of the CPU kernel's merge_ on the same values."""
        cpu = [x.cpu().clone() for x in (oa, la, op, lp)]
        ops.merge_(*cpu)
        return cpu[0], cpu[1]

    def check_merge(self, oa, la, want, tol):
        assert torch.allclose(oa.cpu().double(), want[0].double(), rtol=tol, atol=tol, equal_nan=True)
        assert torch.allclose(la.cpu().double(), want[1].double(), rtol=tol, atol=tol)



CPU = _Cpu()
CUDA = _Cuda()
