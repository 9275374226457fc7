"""CUDA attention kernels (kernels/forward.cu, kernels/backward.cu) against float64 references, the CPU kernels
and torch SDPA: the CUDA-only cases (head dims, long sequences, GQA, accumulation, streams, errors, the runtime on a GPU). The cases
every backend shares (causal offsets, fully masked rows, split-KV merge, merge) are in
tests/test_attention_ops.py; the tolerance rule and the helpers are in tests/helpers/attention_backends.py.

Skipped without torch CUDA, a GPU or a CUDA build of hexiseq.
"""

import pytest

torch = pytest.importorskip("torch")
import hexiseq  # noqa: E402
from hexiseq import ops  # noqa: E402
from hexiseq.errors import InvalidArgumentError, UnsupportedError  # noqa: E402
from reference import attention  # noqa: E402
from attention_backends import (DEV, LOW, assert_close_2x, check_backward, check_forward,  # noqa: E402
                                cuda_skip_reason, make, sdpa)

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [64, 128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (97, 1025), (1025, 97), (1025, 1025)])
def test_forward(dtype, D, causal, sq, sk):
    q, k, v = make(2, sq, sk, 4, 2, D, dtype)
    check_forward(q, k, v, causal, 0, 0)


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


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [64, 128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (97, 1025), (1025, 97)])
def test_backward(dtype, D, causal, sq, sk):
    q, k, v = make(2, sq, sk, 4, 2, D, dtype, seed=4)
    check_backward(q, k, v, causal, 0, 0)


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


@pytest.mark.parametrize("fused", ["flash", "cudnn", "torch"])
@pytest.mark.parametrize("case", ["full_noncausal", "full_causal", "diagonal", "partial"])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_runtime_torch_blocks(case, D, fused, monkeypatch):
    """The runtime's PyTorch block path on CUDA: one of torch's fused ops (flash, cuDNN, or the one timed fastest
    here: "torch") for full and diagonal block pairs (the ones a ring produces), tiled matmuls for a partly visible
    one; forward and backward (with the pair's own out and LSE) against float64, GQA 6:2, odd lengths."""
    from hexiseq.runtime import blocks

    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", fused)

    sq, sk = (333, 333) if case == "diagonal" else (333, 517)
    causal, qp, kp = {"full_noncausal": (False, 0, 0), "full_causal": (True, 600, 83), "diagonal": (True, 77, 77),
                      "partial": (True, 200, 0)}[case]
    q, k, v = make(2, sq, sk, 6, 2, D, torch.bfloat16, seed=11)
    scale = D ** -0.5
    fused = blocks.fused.exact_causal(q, k, causal, qp, kp)
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
@pytest.mark.parametrize("kernels", ["hexiseq", "torch", "flash", "cudnn"])
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


def test_batch_context_on_one_gpu(tmp_path):
    """A BatchPlan's step through hexiseq.nn.BatchContext on a one-rank NCCL group (its process groups, the Gloo
    twin of the call checks, the pass's documents on the default block backend), forward and backward in bf16
    against float64 attention with the same document mask."""
    import torch.distributed as dist

    from hexiseq.nn import BatchContext

    H, Hkv, D = 8, 2, 64
    model = hexiseq.Model(layers=2, hidden=H * D, heads=H, kv_heads=Hkv, head_dim=D, ffn=64, vocab=100)
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0}]})
    planner = hexiseq.BatchPlanner(cluster, model=model)
    lengths = [700, [130, 67], 33]
    g = torch.Generator(device=DEV).manual_seed(5)
    seqs = [torch.randn(sum(L) if isinstance(L, list) else L, H + 2 * Hkv, D, device=DEV, generator=g)
            for L in lengths]
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    checked = 0
    try:
        context = BatchContext(planner)
        step = context.step(planner.plan(lengths))
        for p in step.passes:
            full = p.pack(seqs)[None]                                    # [1, S, H + 2 Hkv, D]
            q, k, v = full.split([H, Hkv, Hkv], 2)
            go = torch.randn(q.shape, device=DEV, generator=g)
            ql, kl, vl = (p.shard(t.to(torch.bfloat16)).detach().requires_grad_() for t in (q, k, v))
            out = p.attention(ql, kl, vl)
            out.backward(p.shard(go.to(torch.bfloat16)))
            starts = torch.zeros(full.shape[1], dtype=torch.int64, device=DEV)
            at = 0
            for n in p.document_lengths:
                starts[at:at + n] = at
                at += n
            refs = {}
            for dtype in (torch.float64, torch.bfloat16):
                qq, kk, vv = (t.to(torch.bfloat16).to(dtype).requires_grad_() for t in (q, k, v))
                o, _ = attention(qq, kk, vv, causal=True, dtype=dtype, q_doc=starts)
                o.backward(go.to(torch.bfloat16).to(dtype))
                refs[dtype] = (o, qq.grad, kk.grad, vv.grad)
            for name, ours, ref, base in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad),
                                             refs[torch.float64], refs[torch.bfloat16]):
                assert_close_2x(ours, p.shard(base), p.shard(ref), f"batch pass {p.sequences} {name}")
            checked += 1
        context.close()
    finally:
        dist.destroy_process_group()
    assert checked >= 1


DOC_PAIRS = {  # documents of each batch row, q_pos0, Sq, k_pos0, Sk (as in tests/test_fused.py, at GPU lengths)
    "diagonal": ([[500, 170, 33, 600], [77, 1000, 226]], 411, 611, 411, 611),
    "keys_before": ([[300, 700, 300], [950, 350]], 700, 333, 200, 450),
    "keys_before_none": ([[400, 400, 500]], 800, 200, 300, 100),
}


@pytest.mark.parametrize("backend", ["varlen", "hexiseq"])
@pytest.mark.parametrize("case", list(DOC_PAIRS))
@pytest.mark.parametrize("D", [64, 128])
def test_document_pairs_on_each_backend(case, backend, D, monkeypatch):
    """A document pair through the runtime's block kernels with the documents' backend forced (torch's variable-
    length flash op, or the hexiseq kernels' mask): forward, and backward with the pair's own out and LSE, against
    float64 under the same mask; bf16, GQA 6:2, two batch rows with different documents, odd lengths."""
    from hexiseq.runtime import blocks
    from hexiseq.runtime.variants import PLAIN

    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS", raising=False)
    monkeypatch.setenv("HEXISEQ_DOCUMENT_KERNELS", backend)
    docs, qp, Sq, kp, Sk = DOC_PAIRS[case]
    B = len(docs)
    q, k, v = make(B, Sq, Sk, 6, 2, D, torch.bfloat16, seed=31)
    positions = list(range(qp, qp + Sq))
    q_doc = torch.stack([torch.as_tensor(ops.document_starts(r, positions)) for r in docs]).to(DEV)
    kern = blocks.BlockKernels(DEV, torch.bfloat16)
    assert kern._route(q, k, True, qp, kp, q_doc, PLAIN)[0] == backend
    scale = D ** -0.5
    kw = dict(causal=True, q_pos0=qp, k_pos0=kp, scale=scale, q_doc=q_doc)
    out, lse = kern.forward(q, k, v, True, qp, kp, scale, q_doc)
    ref_out, ref_lse = attention(q, k, v, dtype=torch.float64, **kw)
    base_out, base_lse = attention(q, k, v, dtype=torch.bfloat16, **kw)
    assert_close_2x(out, base_out, ref_out, "out")
    seen = torch.isfinite(ref_lse)
    assert torch.all(lse[~seen] == -float("inf")) and torch.all(out.transpose(1, 2)[~seen] == 0)
    if seen.any():
        assert_close_2x(lse[seen], base_lse[seen], ref_lse[seen], "lse")
    g = torch.Generator(device=DEV).manual_seed(32)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(q.dtype)
    grads = kern.backward(q, k, v, out, lse, dout, True, qp, kp, scale, q_doc)
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        attention(qq, kk, vv, dtype=dtype, **kw)[0].backward(dout.to(dtype))
        refs[dtype] = (qq.grad, kk.grad, vv.grad)
    for name, ours, ref, base in zip(("dq", "dk", "dv"), grads, refs[torch.float64], refs[torch.bfloat16]):
        assert ours.shape == ref.shape, f"{name}: shape {list(ours.shape)} != {list(ref.shape)}"
        assert_close_2x(ours, base, ref, name, floor=1e-6)


@pytest.mark.parametrize("kind", ["pairs", "documents"])
def test_block_backends_are_measured_and_recorded(kind, monkeypatch):
    """Each kind's candidates run here, agree with their reference and are timed; the fastest is the choice, and
    every pair torch's fused ops cannot compute (a partly visible one) goes to the hexiseq kernels, never to the
    tiled matmuls."""
    from hexiseq.runtime import blocks, fused
    from hexiseq.runtime.variants import PLAIN

    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS", raising=False)
    monkeypatch.delenv("HEXISEQ_DOCUMENT_KERNELS", raising=False)
    best, times = fused.measure(DEV, torch.bfloat16, 16, 4, 128, kind)
    want = {"pairs": {"flash", "hexiseq"}, "documents": {"hexiseq", "varlen"}}[kind]
    assert want <= set(times) and best == min(times, key=times.get), times
    print(f"{kind}: {best} of {', '.join(f'{n} {t:.3f} ms' for n, t in times.items())}")
    q, k, _ = make(1, 333, 517, 6, 2, 64, torch.bfloat16)
    kern = blocks.BlockKernels(DEV, torch.bfloat16)
    assert kern._route(q, k, True, 200, 0, None, PLAIN) == ("hexiseq", None)
