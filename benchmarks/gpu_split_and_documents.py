"""GPU checks beside the test files (run by benchmarks/run_gpu_checks.sh): the forward's split of key blocks longer
than 2^16 keys into pieces, held against a float64 reference by the tests' rule (error at most twice torch SDPA's own
bf16 error plus 1e-3 of the largest value; LSE within 1e-2); and, with --docs, forward and backward under the
document mask at head dims 64/128/256, to run under compute-sanitizer.
Usage: python benchmarks/gpu_split_and_documents.py [--docs]"""
import math, sys
import torch
import torch.nn.functional as F
from hexiseq import ops

dev = torch.device("cuda")
torch.manual_seed(7)


def ref64(q, k, v, causal, qp, kp):
    B, Sq, H, D = q.shape
    g = H // k.shape[2]
    qq = q.double().transpose(1, 2)
    kk = k.double().transpose(1, 2).repeat_interleave(g, 1)
    vv = v.double().transpose(1, 2).repeat_interleave(g, 1)
    s = (qq @ kk.transpose(-1, -2)) / math.sqrt(D)
    if causal:
        m = (kp + torch.arange(k.shape[1], device=dev))[None, :] <= (qp + torch.arange(Sq, device=dev))[:, None]
        s = s.masked_fill(~m, -math.inf)
    return (torch.softmax(s, -1) @ vv).transpose(1, 2), torch.logsumexp(s, -1)


def split_checks():
    bad = 0
    for D, causal, Sk in ((128, False, 65536 + 4000), (64, True, 2 * 65536 + 77), (128, True, 65536 + 1)):
        Sq = 96
        q = torch.randn(1, Sq, 4, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, Sk, 2, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, Sk, 2, D, device=dev, dtype=torch.bfloat16)
        qp = Sk - Sq if causal else 0  # the last queries: every key visible to the last row
        o, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=0)
        ro, rl = ref64(q, k, v, causal, qp, 0)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
        mask = None
        if causal:
            mask = (torch.arange(Sk, device=dev)[None, :] <= (qp + torch.arange(Sq, device=dev))[:, None])
        so = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
        scale = ro.abs().max().item()
        err, terr = (o.double() - ro).abs().max().item(), (so.double() - ro).abs().max().item()
        lerr = (lse.double() - rl).abs().max().item()
        ok = err <= 2 * terr + 1e-3 * scale and lerr < 1e-2
        bad += not ok
        print(f"SPLIT D={D} causal={causal} Sk={Sk}: out err {err:.3e} (torch bf16 {terr:.3e}), lse err {lerr:.3e}",
              "ok" if ok else "FAILED")
    return bad


def doc_cases():
    for dtype, D in ((torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)):
        lengths = [1, 70, 3, 120, 1, 40]
        S = sum(lengths)
        q = torch.randn(2, S, 4, D, device=dev, dtype=dtype)
        k = torch.randn(2, S, 2, D, device=dev, dtype=dtype)
        v = torch.randn(2, S, 2, D, device=dev, dtype=dtype)
        q_doc = torch.as_tensor(ops.document_starts(lengths), device=dev)
        o, lse = ops.attention_forward(q, k, v, causal=True, q_doc=q_doc)
        ops.attention_backward(q, k, v, o, lse, torch.randn_like(q), causal=True, q_doc=q_doc)
    torch.cuda.synchronize()
    print("document sanitizer cases ran")


if __name__ == "__main__":
    if "--docs" in sys.argv:
        doc_cases()
    else:
        n = split_checks()
        print(f"SPLIT FAILED {n} of 3")
        sys.exit(1 if n else 0)
