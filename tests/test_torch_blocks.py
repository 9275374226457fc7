"""The runtime's PyTorch block path (what CUDA tensors use without the CUDA kernels) computed in tiles: tiled
and whole-block results agree to rounding, and both agree with the C kernels (float64, 1e-12), on causal
offsets, GQA, fully masked rows and tiles that do not divide the block."""

import math

import pytest

torch = pytest.importorskip("torch")
from hexiseq.runtime import blocks  # noqa: E402
import hexiseq  # noqa: E402
from hexiseq import ops  # noqa: E402

CASES = [  # Sq, Sk, q_pos0, k_pos0, causal, heads, kv_heads
    (97, 130, 40, 0, True, 4, 2),     # keys before and under the queries
    (130, 97, 0, 30, True, 2, 1),     # the first 30 query rows see nothing
    (50, 50, 0, 0, True, 3, 3),       # the diagonal
    (70, 45, 0, 0, False, 2, 2),      # full attention
    (33, 40, 0, 100, True, 2, 2),     # nothing visible at all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tile", [16, 7])
def test_tiled_equals_whole_and_c_kernels(case, tile):
    Sq, Sk, qp, kp, causal, H, Hk = case
    g = torch.Generator().manual_seed(Sq * 1000 + Sk)
    q = torch.randn(2, Sq, H, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, Sk, Hk, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, Sk, Hk, 16, dtype=torch.float64, generator=g)
    do = torch.randn(2, Sq, H, 16, dtype=torch.float64, generator=g)
    whole = blocks._block_forward_torch(q, k, v, causal, qp, kp, 0.3, tile=10**9)
    tiled = blocks._block_forward_torch(q, k, v, causal, qp, kp, 0.3, tile=tile)
    c_out, c_lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=kp, scale=0.3)
    dead = torch.isinf(c_lse)
    for out, lse in (whole, tiled):
        assert (out - c_out).abs().max().item() <= 1e-12
        assert torch.equal(torch.isinf(lse), dead) and bool((lse[dead] == -math.inf).all())
        if (~dead).any():
            assert (lse[~dead] - c_lse[~dead]).abs().max().item() <= 1e-12
        assert bool((out.transpose(1, 2)[dead] == 0).all())
    grads_whole = blocks._block_backward_torch(q, k, v, c_out, c_lse, do, causal, qp, kp, 0.3, tile=10**9)
    grads_tiled = blocks._block_backward_torch(q, k, v, c_out, c_lse, do, causal, qp, kp, 0.3, tile=tile)
    grads_c = ops.attention_backward(q, k, v, c_out, c_lse, do, causal=causal, q_pos0=qp, k_pos0=kp, scale=0.3)
    for gw, gt, gc in zip(grads_whole, grads_tiled, grads_c):
        assert (gw - gc).abs().max().item() <= 1e-12
        assert (gt - gc).abs().max().item() <= 1e-12


def test_tiled_float32_within_rounding():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 300, 2, 32, generator=g) for _ in range(3))
    whole = blocks._block_forward_torch(q, k, v, True, 0, 0, 0.2, tile=10**9)
    tiled = blocks._block_forward_torch(q, k, v, True, 0, 0, 0.2, tile=64)
    assert (whole[0] - tiled[0]).abs().max().item() <= 1e-5
    assert (whole[1] - tiled[1]).abs().max().item() <= 1e-5


def test_runtime_kernels_setting(monkeypatch):
    """HEXISEQ_RUNTIME_KERNELS picks the block implementation; an unknown value is refused by name and value."""
    from hexiseq.errors import InvalidArgumentError

    t = torch.zeros(1, 2, 1, 8, dtype=torch.float64)
    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS", raising=False)
    assert blocks.use_c_kernels(t)  # CPU: the C kernels
    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", "torch")
    assert not blocks.use_c_kernels(t)
    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", "hexiseq")
    assert blocks.use_c_kernels(t)
    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", "cuda")
    with pytest.raises(InvalidArgumentError, match="HEXISEQ_RUNTIME_KERNELS='cuda'"):
        blocks.use_c_kernels(t)


DOC_CASES = [  # Sq, Sk, q_pos0, k_pos0, document lengths over positions [0, total), per batch row or one for both
    (40, 60, 50, 0, [[1, 30, 45, 14], [60, 30]]),  # keys before the queries' documents: whole tiles skipped
    (45, 45, 10, 10, [[3, 2, 1, 7, 4, 20, 8, 5, 10]]),  # the diagonal, short documents, one of one token
    (30, 40, 70, 20, [[55, 45]]),                   # a document boundary one key after a tile's end
]


@pytest.mark.parametrize("case", DOC_CASES)
@pytest.mark.parametrize("tile", [16, 10**9])
def test_documents_tiled_equal_c_kernels(case, tile):
    """The PyTorch path with a document mask ([Sq] for both batch rows or [B, Sq]) equals the C kernels with the
    same q_doc, forward and backward (float64, 1e-12), tiles skipped where no query of a piece sees its keys."""
    Sq, Sk, qp, kp, lengths = case
    g = torch.Generator().manual_seed(Sq + Sk)
    q = torch.randn(2, Sq, 4, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, Sk, 2, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, Sk, 2, 16, dtype=torch.float64, generator=g)
    do = torch.randn(2, Sq, 4, 16, dtype=torch.float64, generator=g)
    pos = torch.arange(qp, qp + Sq)
    q_doc = torch.stack([ops.document_starts(r, pos) for r in lengths]).squeeze(0)
    out, lse = blocks._block_forward_torch(q, k, v, True, qp, kp, 0.3, tile=tile, q_doc=q_doc)
    c_out, c_lse = ops.attention_forward(q, k, v, q_pos0=qp, k_pos0=kp, scale=0.3, q_doc=q_doc)
    plain, _ = ops.attention_forward(q, k, v, q_pos0=qp, k_pos0=kp, scale=0.3)
    assert (plain - c_out).abs().max().item() > 1e-3  # the documents cut something off
    dead = torch.isinf(c_lse)
    assert (out - c_out).abs().max().item() <= 1e-12
    assert torch.equal(torch.isinf(lse), dead)
    assert (lse[~dead] - c_lse[~dead]).abs().max().item() <= 1e-12
    grads = blocks._block_backward_torch(q, k, v, c_out, c_lse, do, True, qp, kp, 0.3, tile=tile, q_doc=q_doc)
    grads_c = ops.attention_backward(q, k, v, c_out, c_lse, do, q_pos0=qp, k_pos0=kp, scale=0.3, q_doc=q_doc)
    for gt, gc in zip(grads, grads_c):
        assert (gt - gc).abs().max().item() <= 1e-12


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
NAN_DEVICES = [pytest.param("cpu", "torch", id="cpu-tiled"),
               pytest.param("cuda", "flash", id="cuda-flash", marks=_NO_CUDA),
               pytest.param("cuda", "cudnn", id="cuda-cudnn", marks=_NO_CUDA)]


def _poisoned_rows(lse):
    """Rows whose LSE is NaN or +inf (flash marks a row whose softmax sum is NaN with LSE = +inf)."""
    return (~torch.isfinite(lse) & (lse != -math.inf)).cpu()


@pytest.mark.parametrize("device,fused", NAN_DEVICES)
@pytest.mark.parametrize("poison", ["q", "k"])
def test_nan_propagates_through_blocks_and_merge(device, fused, poison, monkeypatch):
    """A NaN in q or k through the PyTorch block path (tiled matmuls on the CPU, torch's flash or cuDNN op for bf16
    on a GPU) and the merge of two key halves (torch ops and the C/CUDA merge): the rows that see it come out NaN in
    O and with an LSE that is not a number or +inf, exactly those of the float64 C kernels, instead of vanishing
    into 0 and -inf; the others stay numbers. Backward: every gradient row the float64 kernels make all NaN is all
    NaN (on the tiled path exactly those; torch's fused backwards may spread a NaN row's D to the other keys of a
    tile they compute, through 0 x NaN)."""
    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", fused)
    dt = torch.float64 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(9)
    Sq = Sk = 96
    q, k, v, do = (torch.randn(1, S, 4, 64, dtype=torch.float64, generator=g) for S in (Sq, Sk, Sk, Sq))
    (q if poison == "q" else k)[0, 50, 1, 5] = math.nan  # k head 1 feeds query heads 1 (and 3: no GQA here)
    ref_out, ref_lse = ops.attention_forward(q, k, v, causal=True)           # float64 C kernels
    ref_rows = torch.isnan(ref_lse)                                          # [B, H, Sq]
    assert ref_rows.any() and not ref_rows.all()
    q, k, v, do = (x.to(device, dt) for x in (q, k, v, do))
    scale = 64 ** -0.5
    out, lse = blocks._block_forward_torch(q, k, v, True, 0, 0, scale)
    assert torch.equal(_poisoned_rows(lse), ref_rows)
    assert torch.equal(torch.isnan(out).transpose(1, 2).any(-1).cpu(), ref_rows)
    # two key halves merged: the second half holds the poisoned key row 50 (seen by query rows 50..)
    # the C/CUDA merge needs hexiseq's kernels for CUDA tensors: a build without them merges with torch ops only
    for use_c in (False, True) if device == "cpu" or hexiseq.build_info()["cuda"] else (False,):
        o1, l1 = blocks._block_forward_torch(q, k[:, :48], v[:, :48], True, 0, 0, scale)
        o2, l2 = blocks._block_forward_torch(q, k[:, 48:], v[:, 48:], True, 0, 48, scale)
        acc, acc_lse = o1.float() if dt != torch.float64 else o1.clone(), l1.clone()
        blocks.merge(acc, acc_lse, o2, l2, use_c)
        assert torch.equal(_poisoned_rows(acc_lse), ref_rows), f"merge (use_c={use_c})"
        assert torch.equal(torch.isnan(acc).transpose(1, 2).any(-1).cpu(), ref_rows), f"merge (use_c={use_c})"
        fin = ~ref_rows
        assert (acc_lse - lse.to(acc_lse.dtype)).abs()[fin.to(device)].max().item() <= (1e-12 if dt == torch.float64 else 2e-2)
    dq, dk, dv = blocks._block_backward_torch(q, k, v, out, lse, do, True, 0, 0, scale)
    want = ops.attention_backward(*(x.cpu().double() for x in (q, k, v, out)), lse.cpu().double(),
                                  do.cpu().double(), causal=True, scale=scale)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        rows_ref = torch.isnan(ref).all(-1)
        rows_got = torch.isnan(got.cpu()).all(-1)
        assert rows_ref.any() and bool(rows_got[rows_ref].all()), name
        if device == "cpu":
            assert torch.equal(rows_got, rows_ref), name
