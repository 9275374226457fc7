"""The choice of block backends and the document pairs through torch's variable-length op (hexiseq.runtime.fused).

The op itself needs a GPU (tests/test_cuda_ops.py runs it there); here a float64 reference with the op's contract
stands in for it, so the cutting of a pair into segments, the packing of rows and the LSE layouts (unpadded, and
padded per segment as older releases return it) are checked on any machine against the C kernels' document mask.
"""

import numpy as np
import pytest
import torch

from hexiseq import ops
from hexiseq.errors import InvalidArgumentError
from hexiseq.runtime import blocks, fused


def _reference_varlen(padded):
    """(forward, backward) with the contract of torch's variable-length flash ops, in float64 on the CPU."""
    seen = {}

    def segments(q, k, v, cu_q, cu_k, causal, scale):
        rep = q.shape[1] // k.shape[1]
        outs, lses = [], []
        for j in range(len(cu_q) - 1):
            qa, qb, ka, kb = int(cu_q[j]), int(cu_q[j + 1]), int(cu_k[j]), int(cu_k[j + 1])
            qs = q[qa:qb].transpose(0, 1)
            ks = k[ka:kb].repeat_interleave(rep, 1).transpose(0, 1)
            vs = v[ka:kb].repeat_interleave(rep, 1).transpose(0, 1)
            s = qs @ ks.transpose(1, 2) * scale
            if causal:  # bottom-right aligned, as the op aligns a causal mask of unequal lengths
                i = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
                s = s.masked_fill(torch.arange(kb - ka)[None, :] > i, float("-inf"))
            lse = torch.logsumexp(s, -1)
            outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
            lses.append(lse)
        return torch.cat(outs), lses

    def layout(lses, H, max_q):
        if not padded:
            return torch.cat(lses, 1)
        out = torch.zeros(len(lses), H, max_q, dtype=lses[0].dtype)
        for j, l in enumerate(lses):
            out[j, :, :l.shape[1]] = l
        return out

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, scale=None):
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and p == 0.0
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        out, lses = segments(q, k, v, cu_q, cu_k, causal, scale)
        seen["forward"] = seen.get("forward", 0) + 1
        return out, layout(lses, q.shape[1], max_q), torch.zeros(2), torch.zeros(()), torch.empty(0)

    def backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, causal, seed, offset, scale=None):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o, lses = segments(qq, kk, vv, cu_q, cu_k, causal, scale)
        want = layout([l.detach() for l in lses], q.shape[1], max_q)
        assert lse.shape == want.shape, f"the LSE handed back is {list(lse.shape)}, the op's layout {list(want.shape)}"
        if padded:
            for j, l in enumerate(lses):
                torch.testing.assert_close(lse[j, :, :l.shape[1]].double(), l.detach(), rtol=1e-6, atol=1e-6)
        else:  # the op takes its LSE in float32
            torch.testing.assert_close(lse.double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, o.detach())
        o.backward(do)
        return qq.grad, kk.grad, vv.grad

    return (forward, backward), seen


def _case(B, Sq, Sk, H, Hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Sk, Hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Sk, Hk, d, generator=g, dtype=torch.float64)
    do = torch.randn(B, Sq, H, d, generator=g, dtype=torch.float64)
    return q, k, v, do


# (documents of each batch row, q_pos0, Sq, k_pos0, Sk): the diagonal of a chunk that starts inside a document,
# keys before queries with the first query's document reaching into them (one row) or not (the other), and a
# pair with a gap between keys and queries that one long document spans
CASES = {
    "diagonal": ([[50, 17, 3, 60], [7, 100, 23]], 41, 61, 41, 61),
    "keys_before": ([[30, 70, 30], [95, 35]], 70, 33, 20, 45),
    "keys_before_gap": ([[10, 120]], 90, 29, 15, 30),
    "keys_before_none": ([[40, 40, 50]], 80, 20, 30, 10),
}


@pytest.mark.parametrize("padded", [False, True], ids=["lse_unpadded", "lse_padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_document_pairs_match_the_document_mask(case, padded, monkeypatch):
    """A document pair cut into segments for the variable-length op gives the document mask's out, LSE and
    gradients (the C kernels in float64), GQA 6:2, two batch rows with different documents."""
    docs, qp, Sq, kp, Sk = CASES[case]
    (fwd, bwd), seen = _reference_varlen(padded)
    monkeypatch.setattr(fused, "_varlen_ops", lambda: (fwd, bwd))
    monkeypatch.setattr(fused, "_lse_padded", {})
    B = len(docs)
    q, k, v, do = _case(B, Sq, Sk, 6, 2, 24, seed=len(case))
    q_doc = torch.from_numpy(np.stack([ops.document_starts(r, np.arange(qp, qp + Sq)) for r in docs]))
    seg = fused.segments(q, k, qp, kp, q_doc)
    assert seg is not None
    scale = 0.3
    out, lse = fused.varlen_forward(q, k, v, seg, scale)
    ref_out, ref_lse = ops.attention_forward(q, k, v, causal=True, q_pos0=qp, k_pos0=kp, scale=scale, q_doc=q_doc)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    grads = fused.varlen_backward(q, k, v, ref_out, ref_lse, do, seg, scale)
    refs = ops.attention_backward(q, k, v, ref_out, ref_lse, do, causal=True, q_pos0=qp, k_pos0=kp, scale=scale,
                                  q_doc=q_doc)
    for name, ours, ref in zip(("dq", "dk", "dv"), grads, refs):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert seen.get("forward", 0) == (0 if case == "keys_before_none" else 1)  # one op call for the whole pair
    assert fused.segments(q, k, qp, kp, q_doc) is seg  # cut once per mask tensor and geometry


def test_segments_of_a_pair():
    """The segments: one per document on the diagonal (the first clipped to the chunk), one rectangle per batch row
    that reaches back when keys precede queries, none for a pair varlen cannot take (keys after queries)."""
    q = torch.zeros(1, 61, 2, 8)
    q_doc = torch.from_numpy(ops.document_starts([50, 17, 3, 60], np.arange(41, 102)))[None]
    seg = fused.segments(q, q, 41, 41, q_doc)
    assert [s[1:3] for s in seg.spans] == [(0, 9), (9, 26), (26, 29), (29, 61)] and seg.causal and seg.whole
    assert seg.cu_q.tolist() == [0, 9, 26, 29, 61] and seg.max_q == 32
    keys = torch.zeros(1, 45, 2, 8)
    q_doc = torch.from_numpy(ops.document_starts([30, 70, 30], np.arange(70, 103)))[None]
    seg = fused.segments(q[:, :33], keys, 70, 20, q_doc)
    assert seg.spans == [(0, 0, 30, 10, 45)] and not seg.causal  # rows of the 2nd document see keys from 30 on
    assert fused.segments(q[:, :33], keys, 0, 40, q_doc[..., :33]) is None  # keys after the queries


def test_choice_is_forced_preferred_and_checked(monkeypatch):
    """HEXISEQ_RUNTIME_KERNELS=flash/cudnn and HEXISEQ_DOCUMENT_KERNELS force the choice, torch's ops only take
    varlen for documents; a calibration's preference is adopted, an unknown name refused by name and value."""
    q = torch.zeros(1, 4, 4, 64)
    k = torch.zeros(1, 4, 2, 64)
    monkeypatch.setenv("HEXISEQ_RUNTIME_KERNELS", "cudnn")
    assert fused.choice(q, k, "pairs") == "cudnn" and fused.choice(q, k, "documents") == "varlen"
    monkeypatch.setenv("HEXISEQ_DOCUMENT_KERNELS", "hexiseq")
    assert fused.choice(q, k, "documents") == "hexiseq"
    monkeypatch.setenv("HEXISEQ_DOCUMENT_KERNELS", "tiles")
    with pytest.raises(InvalidArgumentError, match="HEXISEQ_DOCUMENT_KERNELS='tiles'"):
        fused.choice(q, k, "documents")
    monkeypatch.delenv("HEXISEQ_DOCUMENT_KERNELS")
    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS")
    with pytest.raises(InvalidArgumentError, match="block_backends.pairs must be one of .*got 'fast'"):
        fused.prefer("cpu", torch.bfloat16, 64, pairs="fast")
    assert fused.choices("cpu", torch.float32, 4, 2, 64) == {"pairs": "hexiseq", "documents": "hexiseq"}


def test_preference_is_used_instead_of_measuring(monkeypatch):
    """A preferred backend that can run here is taken without measuring; one that cannot is measured as usual."""
    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS", raising=False)
    monkeypatch.setattr(fused, "_chosen", {})
    monkeypatch.setattr(fused, "_preferred", {})
    monkeypatch.setattr(fused, "_index", lambda device: 0)
    monkeypatch.setattr(fused, "hexiseq_allowed", lambda device, dtype: True)
    measured = []
    monkeypatch.setattr(fused, "measure", lambda *a: measured.append(a) or ("flash", {}))
    q, k = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16), torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    fused.prefer("cpu", torch.bfloat16, 128, pairs="hexiseq", documents="varlen")
    assert fused.choice(q, k, "pairs") == "hexiseq" and fused.choice(q, k, "documents") == "varlen"
    assert not measured
    monkeypatch.setattr(fused, "hexiseq_allowed", lambda device, dtype: False)  # a build without the kernels
    fused.prefer("cpu", torch.bfloat16, 64, pairs="hexiseq")
    q64, k64 = q[..., :64], k[..., :64]
    assert fused.choice(q64, k64, "pairs") == "flash" and len(measured) == 1


def test_block_kernels_on_cpu_keep_the_c_kernels(monkeypatch):
    """On a CPU every pair, documents included, stays on the C kernels: the fused ops are GPU-only."""
    monkeypatch.delenv("HEXISEQ_RUNTIME_KERNELS", raising=False)
    kern = blocks.BlockKernels("cpu", torch.float32)
    q = torch.zeros(1, 8, 2, 16)
    q_doc = torch.zeros(8, dtype=torch.int64)
    assert kern._route(q, q, True, 0, 0, q_doc, blocks.PLAIN) == ("hexiseq", None)
    assert kern._route(q, q, True, 0, 0, None, blocks.PLAIN) == ("hexiseq", None)


def test_runtime_adopts_the_calibrated_choice(monkeypatch):
    """A plan made on a calibrated cluster hands its device's recorded backends to the runtime, for the dtype it
    measured; another dtype, or a cluster without the record, changes nothing."""
    import hexiseq
    from hexiseq.runtime import nn

    monkeypatch.setattr(fused, "_preferred", {})
    monkeypatch.setattr(fused, "_index", lambda device: 0)
    chosen = [{"pairs": "flash", "documents": "hexiseq"}, {"pairs": "cudnn", "documents": "varlen"}]
    spec = {"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450}],
            "calibration": {"dtype": "bfloat16", "head_dim": 128, "block_backends": chosen}}
    plan = hexiseq.plan(hexiseq.Cluster.from_dict(spec), model="llama3-8b", seq_len=4096)
    nn.adopt_calibrated_backends(plan, 1, torch.device("cpu"), torch.float16)
    assert fused._preferred == {}
    nn.adopt_calibrated_backends(plan, 1, torch.device("cpu"), torch.bfloat16)
    assert fused._preferred == {(0, torch.bfloat16, 128, "pairs"): "cudnn", (0, torch.bfloat16, 128, "documents"): "varlen"}
    plain = hexiseq.plan(hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450}]}), model="llama3-8b",
                         seq_len=4096)
    fused._preferred.clear()
    nn.adopt_calibrated_backends(plain, 0, torch.device("cpu"), torch.bfloat16)
    assert fused._preferred == {}


@pytest.mark.parametrize("causal,qp,kp,sq,sk", [(False, 30, 200, 17, 23), (True, 90, 20, 17, 23), (True, 41, 41, 29, 29)],
                         ids=["full_noncausal", "keys_before", "diagonal"])
def test_exact_pairs_on_the_hexiseq_kernels_at_positions_zero(causal, qp, kp, sq, sk, monkeypatch):
    """An exact pair chosen for the hexiseq kernels runs them at positions 0 with exact_causal's answer: the same
    out, LSE and gradients as at the pair's own positions (float64, GQA 6:2). exact_causal needs a GPU, so its
    answer for each pair is written here: all visible (False) or the diagonal square (True)."""
    monkeypatch.setattr(fused, "choice", lambda q, k, kind="pairs": "hexiseq")
    q, k, v, do = _case(2, sq, sk, 6, 2, 24, seed=3)
    is_causal = qp == kp and sq == sk
    out, lse = fused.pair_forward(q, k, v, is_causal, 0.3)
    ref_out, ref_lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=kp, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grads = fused.pair_backward(q, k, v, ref_out, ref_lse, do, is_causal, 0.3)
    refs = ops.attention_backward(q, k, v, ref_out, ref_lse, do, causal=causal, q_pos0=qp, k_pos0=kp, scale=0.3)
    for ours, ref in zip(grads, refs):
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
