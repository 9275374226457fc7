"""CUDA attention kernels (kernels/attention.cu) against float64 references, the CPU kernels and torch SDPA.

Skipped without torch CUDA, a GPU or a CUDA build of hexiseq. Tolerance rule (FlashAttention's): on the same
bf16/fp16 inputs, the error of our output against a float64 reference is at most twice the error of torch's
own low-precision computation against the same reference, plus a floor of 1e-3 x the reference's largest
magnitude (both sides can be exact, e.g. one key, and a floor far under one bf16 ulp of the data still
catches any real bug). Forward baseline: torch SDPA in the input dtype on the GPU (rows that see no key are
left out of it: SDPA gives NaN there). Backward baseline: the same math written with torch ops in the input
dtype (as FlashAttention's attention_ref(upcast=False)), because SDPA's backward gives NaN gradients
through fully masked rows.
"""

import math

import pytest

torch = pytest.importorskip("torch")
import hexiseq  # noqa: E402
from hexiseq import ops  # noqa: E402
from hexiseq.errors import InvalidArgumentError, UnsupportedError  # noqa: E402
from reference import attention, visible  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch (torch.cuda.is_available() is False)", allow_module_level=True)
if not hexiseq.build_info()["cuda"]:
    pytest.skip("hexiseq was built without CUDA kernels (no nvcc or HEXISEQ_CUDA=0)", allow_module_level=True)

DEV = torch.device("cuda")
LOW = [torch.bfloat16, torch.float16]


def sdpa(q, k, v, *, causal, q_pos0, k_pos0, scale):
    """torch SDPA in q's dtype on the same mask; [B, Sq, H, D]."""
    H, Hkv = q.shape[2], k.shape[2]
    qq = q.transpose(1, 2)
    kk = k.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    vv = v.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    mask = visible(q.shape[1], k.shape[1], q_pos0, k_pos0, causal, q.device)
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


# (q_pos0, k_pos0) as a function of (Sq, Sk): the causal offset cases.
OFFSETS = {
    "aligned": lambda sq, sk: (0, 0),                 # same block (the diagonal)
    "q_after_k": lambda sq, sk: (sk + 5, 0),           # queries after every key: nothing masked
    "q_before_k": lambda sq, sk: (0, sq + 3),          # queries before every key: every row fully masked
    "overlap_q_later": lambda sq, sk: (50, 20),       # partly visible
    "overlap_k_later": lambda sq, sk: (0, 30),        # first 30 query rows fully masked
}


def check_forward(q, k, v, causal, q_pos0, k_pos0, scale=None):
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale)
    ref_out, ref_lse = attention(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale,
                                 dtype=torch.float64)
    rows = visible(q.shape[1], k.shape[1], q_pos0, k_pos0, causal, DEV).any(-1)
    if rows.any():
        base = sdpa(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale)
        assert_close_2x(out[:, rows], base[:, rows], ref_out[:, rows], "out")
        # lse: fp32 in both; compare against the low-precision math's fp32 logsumexp
        _, base_lse = attention(q, k, v, causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale, dtype=q.dtype)
        assert_close_2x(lse[:, :, rows], base_lse[:, :, rows], ref_lse[:, :, rows], "lse")
    dead = ~rows
    if dead.any():  # fully masked rows: exactly 0 and -inf
        assert torch.all(out[:, dead] == 0)
        assert torch.all(lse[:, :, dead] == -math.inf)
    return out, lse


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [64, 128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (97, 1025), (1025, 97), (1025, 1025)])
def test_forward(dtype, D, causal, sq, sk):
    q, k, v = make(2, sq, sk, 4, 2, D, dtype)
    check_forward(q, k, v, causal, 0, 0)


@pytest.mark.parametrize("case", sorted(OFFSETS))
@pytest.mark.parametrize("D", [64, 128])
def test_forward_causal_offsets(case, D):
    sq, sk = 97, 193
    q, k, v = make(2, sq, sk, 4, 4, D, torch.bfloat16, seed=1)
    q_pos0, k_pos0 = OFFSETS[case](sq, sk)
    check_forward(q, k, v, True, q_pos0, k_pos0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_forward_long(causal, D):
    q, k, v = make(1, 4097, 4097, 2, 1, D, torch.bfloat16, seed=2)
    check_forward(q, k, v, causal, 0, 0)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1)])
def test_gqa_mqa_forward_backward(heads, kv_heads):
    q, k, v = make(2, 97, 131, heads, kv_heads, 64, torch.bfloat16, seed=3)
    check_forward(q, k, v, True, 40, 0)
    check_backward(q, k, v, True, 40, 0)


def check_backward(q, k, v, causal, q_pos0, k_pos0, accumulate=False):
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    kw = dict(causal=causal, q_pos0=q_pos0, k_pos0=k_pos0, scale=scale)
    g = torch.Generator(device=DEV).manual_seed(7)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(q.dtype)
    out, lse = ops.attention_forward(q, k, v, **kw)
    if accumulate:
        start = [torch.randn(x.shape, device=DEV, generator=g).to(x.dtype) for x in (q, k, v)]
        dq, dk, dv = (x.clone() for x in start)
        ops.attention_backward(q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, accumulate=True, **kw)
        dq, dk, dv = (a.double() - s.double() for a, s in zip((dq, dk, dv), start))
    else:
        dq, dk, dv = ops.attention_backward(q, k, v, out, lse, dout, **kw)
    grads = {}
    for dtype in (torch.float64, q.dtype):
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        o, _ = attention(qq, kk, vv, dtype=dtype, **kw)
        o.backward(dout.to(dtype))
        grads[dtype] = (qq.grad, kk.grad, vv.grad)
    # dS = P (dP - D) subtracts two fp32 sums of the same products (dO_i . V_j and dO_i . O_i) that the kernel and
    # the reference add in different orders. Where they cancel exactly (one key: P = 1 and O = V) the float64
    # reference is exactly 0 and so is torch's, but a correct fp32 kernel leaves a rounding residue (seen on an
    # H100: 7e-7). Bound: 2^-20 of the largest |dO_i| |V_j| (a few fp32 ulps of those sums), carried through
    # scale and |K| into dQ, through scale and |Q| into dK; it is far under 1e-3 of any non-degenerate gradient.
    cancel = 2.0 ** -20 * dout.double().norm(dim=-1).max().item() * v.double().norm(dim=-1).max().item() * scale
    floors = (cancel * k.double().abs().max().item(), cancel * q.double().abs().max().item(), 0.0)
    for name, ours, ref, base, fl in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype], floors):
        assert_close_2x(ours, base, ref, name, floor=fl)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [64, 128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (97, 1025), (1025, 97)])
def test_backward(dtype, D, causal, sq, sk):
    q, k, v = make(2, sq, sk, 4, 2, D, dtype, seed=4)
    check_backward(q, k, v, causal, 0, 0)


@pytest.mark.parametrize("case", sorted(OFFSETS))
def test_backward_causal_offsets(case):
    sq, sk = 97, 193
    q, k, v = make(2, sq, sk, 4, 2, 64, torch.bfloat16, seed=5)
    check_backward(q, k, v, True, *OFFSETS[case](sq, sk))


def test_backward_accumulate():
    q, k, v = make(2, 97, 131, 4, 2, 64, torch.float16, seed=6)
    check_backward(q, k, v, True, 30, 0, accumulate=True)


def test_backward_long():
    q, k, v = make(1, 4097, 4097, 2, 1, 128, torch.bfloat16, seed=7)
    check_backward(q, k, v, True, 0, 0)


def test_matches_cpu_kernels():
    """CUDA bf16 and the CPU kernels (float64 on the same bf16 values) agree within the 2x rule."""
    q, k, v = make(2, 97, 160, 4, 2, 64, torch.bfloat16, seed=8)
    kw = dict(causal=True, q_pos0=60, k_pos0=0)
    out, lse = ops.attention_forward(q, k, v, **kw)
    cpu_out, cpu_lse = ops.attention_forward(*(x.cpu().double() for x in (q, k, v)), **kw)
    ref_out, _ = attention(q.cpu(), k.cpu(), v.cpu(), scale=1 / 8, dtype=torch.float64, **kw)
    assert torch.allclose(cpu_out, ref_out, atol=1e-10)  # the CPU reference is itself right
    base = sdpa(q, k, v, scale=1 / 8, **kw)
    assert_close_2x(out.cpu(), base.cpu(), cpu_out, "out vs CPU kernel")
    assert torch.allclose(lse.cpu().double(), cpu_lse, atol=2e-2)


def test_non_contiguous_inputs():
    """Heads-major views (head_dim stride 1, fast loads) and a head_dim stride of 2 (element loads) give the
    same forward as contiguous inputs (bit for bit: same arithmetic), and the same backward within 2x."""
    B, S, H, D = 2, 97, 4, 64
    g = torch.Generator(device=DEV).manual_seed(9)
    base = [torch.randn(B, H, S, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(3)]
    views = [x.transpose(1, 2) for x in base]  # [B, S, H, D], strides of a [B, H, S, D] tensor
    wide = [torch.zeros(B, S, H, 2 * D, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    for w, x in zip(wide, views):
        w[..., ::2] = x
    strided = [w[..., ::2] for w in wide]
    assert not views[0].is_contiguous() and strided[0].stride(-1) == 2
    cont = [x.contiguous() for x in views]
    want, want_lse = ops.attention_forward(*cont, causal=True)
    for xs in (views, strided):
        got, got_lse = ops.attention_forward(*xs, causal=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    out_view = torch.empty(B, H, S, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    ops.attention_forward(*views, causal=True, out=out_view)
    assert torch.equal(out_view, want)
    check_backward(*strided, True, 0, 0)
    check_backward(*views, False, 0, 0)


def test_split_kv_merge_equals_unsplit():
    """Forward over three key blocks merged into an fp32 accumulator equals the unsplit forward (2x rule);
    backward of each block with the merged out/lse sums to the unsplit gradients."""
    B, Sq, Sk, H, Hkv, D = 2, 257, 300, 4, 2, 64
    q, k, v = make(B, Sq, Sk, H, Hkv, D, torch.bfloat16, seed=10)
    kw = dict(causal=True, q_pos0=100, k_pos0=0)
    cuts = [0, 97, 200, Sk]
    acc = torch.zeros(B, Sq, H, D, device=DEV, dtype=torch.float32)
    acc_lse = torch.full((B, H, Sq), -math.inf, device=DEV)
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = ops.attention_forward(q, k[:, a:b], v[:, a:b], causal=True, q_pos0=100, k_pos0=a)
        ops.merge_(acc, acc_lse, o, l)
    ref_out, ref_lse = attention(q, k, v, scale=1 / 8, dtype=torch.float64, **kw)
    base = sdpa(q, k, v, scale=1 / 8, **kw)
    assert_close_2x(acc, base, ref_out, "merged out")
    assert torch.allclose(acc_lse.double(), ref_lse, atol=1e-3)

    out = acc.to(torch.bfloat16)
    dout = torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).to(q.dtype)
    dq_full, dk_full, dv_full = ops.attention_backward(q, k, v, out, acc_lse, dout, **kw)
    dq = torch.zeros(q.shape, device=DEV, dtype=torch.float32)
    dks, dvs = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        dqb, dkb, dvb = ops.attention_backward(q, k[:, a:b], v[:, a:b], out, acc_lse, dout, causal=True, q_pos0=100,
                                               k_pos0=a)
        dq += dqb.float()
        dks.append(dkb)
        dvs.append(dvb)
    # dk, dv: each block computes exactly its slice (same tiles, same order); dq: a sum of bf16-rounded pieces
    scale_q = dq_full.float().abs().max().item()
    assert (dq - dq_full.float()).abs().max().item() <= 2e-2 * scale_q
    assert torch.allclose(torch.cat(dks, 1).float(), dk_full.float(), atol=2e-2 * dk_full.float().abs().max().item())
    assert torch.allclose(torch.cat(dvs, 1).float(), dv_full.float(), atol=2e-2 * dv_full.float().abs().max().item())


def test_fully_masked_rows_forward_backward():
    q, k, v = make(2, 64, 64, 4, 2, 64, torch.bfloat16, seed=11)
    kw = dict(causal=True, q_pos0=0, k_pos0=1000)  # every query before every key
    out, lse = ops.attention_forward(q, k, v, **kw)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    dq, dk, dv = ops.attention_backward(q, k, v, out, lse, torch.ones_like(q), **kw)
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


@pytest.mark.parametrize("acc_dtype,part_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.float64, torch.float32)])
def test_merge_matches_cpu(acc_dtype, part_dtype):
    B, S, H, D = 2, 97, 3, 80
    g = torch.Generator(device=DEV).manual_seed(12)
    lse_of = lambda dt: torch.float64 if dt == torch.float64 else torch.float32  # noqa: E731
    oa = torch.randn(B, S, H, D, device=DEV, generator=g).to(acc_dtype)
    op = torch.randn(B, S, H, D, device=DEV, generator=g).to(part_dtype)
    la = torch.randn(B, H, S, device=DEV, generator=g).to(lse_of(acc_dtype))
    lp = torch.randn(B, H, S, device=DEV, generator=g).to(lse_of(part_dtype))
    la[:, :, :10] = -math.inf
    lp[:, :, 5:15] = -math.inf
    oa[:, :5] = math.nan  # rows with lse_acc = -inf are replaced, never read
    cpu = [x.cpu().clone() for x in (oa, la, op, lp)]
    ops.merge_(oa, la, op, lp)
    ops.merge_(*cpu)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3}[acc_dtype]
    assert torch.allclose(oa.cpu().double(), cpu[0].double(), rtol=tol, atol=tol, equal_nan=True)
    assert torch.allclose(la.cpu().double(), cpu[1].double(), rtol=tol, atol=tol)
    assert torch.all(la[:, :, 5:10] == -math.inf)  # both -inf: unchanged


def test_runs_on_current_stream():
    """Work is enqueued on torch's current stream: q is rewritten on a side stream behind a ~50 ms sleep;
    a kernel launched anywhere else would read the old q."""
    q_old, k, v = make(1, 256, 256, 2, 2, 64, torch.bfloat16, seed=13)
    q_new = torch.randn_like(q_old, dtype=torch.float32).to(torch.bfloat16)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    q = q_old.clone()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        q.copy_(q_new)
        out, lse = ops.attention_forward(q, k, v, causal=True)
        dq, dk, dv = ops.attention_backward(q, k, v, out, lse, torch.ones_like(q), causal=True)
    side.synchronize()
    want, _ = ops.attention_forward(q_new, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    want_dq, _, _ = ops.attention_backward(q_new, k, v, want, lse, torch.ones_like(q), causal=True)
    assert torch.allclose(dq.float(), want_dq.float(), atol=1e-2)


def test_errors():
    q, k, v = make(1, 8, 8, 2, 2, 64, torch.float32)
    with pytest.raises(UnsupportedError, match="float32"):
        ops.attention_forward(q, k, v)
    qb, kb, vb = make(1, 8, 8, 2, 2, 64, torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="one device"):
        ops.attention_forward(qb, kb.cpu(), vb)
    with pytest.raises(UnsupportedError, match="head_dim"):
        ops.attention_forward(*make(1, 8, 8, 2, 2, 264, torch.bfloat16))


@pytest.mark.parametrize("case", ["full_noncausal", "full_causal", "diagonal", "partial"])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_runtime_torch_blocks(case, D):
    """The runtime's PyTorch block path on CUDA: torch's fused flash op for full and diagonal block pairs (the ones
    a ring produces), tiled matmuls for a partly visible one; forward and backward (with the pair's own out and
    LSE) against float64, GQA 6:2, odd lengths."""
    from hexiseq import blocks

    sq, sk = (333, 333) if case == "diagonal" else (333, 517)
    causal, qp, kp = {"full_noncausal": (False, 0, 0), "full_causal": (True, 600, 83), "diagonal": (True, 77, 77),
                      "partial": (True, 200, 0)}[case]
    q, k, v = make(2, sq, sk, 6, 2, D, torch.bfloat16, seed=11)
    scale = D ** -0.5
    fused = blocks._flash_causal(q, k, causal, qp, kp)
    assert (fused is None) == (case == "partial"), f"{case}: flash op applies = {fused is not None}"
    out, lse = blocks._block_forward_torch(q, k, v, causal, qp, kp, scale)
    kw = dict(causal=causal, q_pos0=qp, k_pos0=kp, scale=scale)
    ref_out, ref_lse = attention(q, k, v, dtype=torch.float64, **kw)
    base_out, base_lse = attention(q, k, v, dtype=torch.bfloat16, **kw)
    assert_close_2x(out, base_out, ref_out, "out")
    assert_close_2x(lse, base_lse, ref_lse, "lse")
    g = torch.Generator(device=DEV).manual_seed(12)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(q.dtype)
    grads = blocks._block_backward_torch(q, k, v, out, lse, dout, causal, qp, kp, scale)
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        attention(qq, kk, vv, dtype=dtype, **kw)[0].backward(dout.to(dtype))
        refs[dtype] = (qq.grad, kk.grad, vv.grad)
    for name, ours, ref, base in zip(("dq", "dk", "dv"), grads, refs[torch.float64], refs[torch.bfloat16]):
        assert ours.shape == ref.shape, f"{name}: shape {list(ours.shape)} != {list(ref.shape)}"
        assert_close_2x(ours, base, ref, name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernels", ["hexiseq", "torch"])
def test_runtime_on_one_gpu(causal, kernels, tmp_path, monkeypatch):
    """The distributed runtime with CUDA tensors on a one-rank NCCL group (the machine has one GPU), through the
    CUDA kernels and through the PyTorch block path (the default for CUDA tensors: torch's fused flash op), forward
    and backward, against float64 attention; GQA 8:2, odd length."""
    import torch.distributed as dist

    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", kernels)

    from hexiseq.nn import HexiSeqAttention

    S, H, Hkv, D = 1025, 8, 2, 64
    model = hexiseq.Model(layers=2, hidden=H * D, heads=H, kv_heads=Hkv, head_dim=D, ffn=64, vocab=100)
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0}],
                                         "inter_node_gbps": 25.0})
    plan = hexiseq.evaluate(cluster, model=model, seq_len=S, causal=causal,
                            layout={"groups": [{"devices": [0], "seq": S, "tokens": [S], "heads": [H]}]})
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        attn = HexiSeqAttention(plan, causal=causal)
        q, k, v = make(1, S, S, H, Hkv, D, torch.bfloat16, seed=21)
        go = torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16)
        ql, kl, vl = (plan.shard(t, 1, 0).detach().requires_grad_() for t in (q, k, v))
        out = attn(ql, kl, vl)
        out.backward(plan.shard(go, 1, 0))
        attn.context.close()
    finally:
        dist.destroy_process_group()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention(qr, kr, vr, causal=causal, q_pos0=0, k_pos0=0, scale=D ** -0.5, dtype=torch.float64)
    ref.backward(go.double())
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    base, _ = attention(qb, kb, vb, causal=causal, q_pos0=0, k_pos0=0, scale=D ** -0.5, dtype=torch.bfloat16)
    base.backward(go)
    assert_close_2x(out, plan.shard(base, 1, 0), plan.shard(ref, 1, 0), "runtime out")
    for name, ours, b, r in (("dq", ql, qb, qr), ("dk", kl, kb, kr), ("dv", vl, vb, vr)):
        assert_close_2x(ours.grad, plan.shard(b.grad, 1, 0), plan.shard(r.grad, 1, 0), f"runtime {name}")
