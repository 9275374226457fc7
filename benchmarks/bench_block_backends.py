"""The block backends on one GPU, side by side on the same inputs in one run: the exact attention implementations the
runtime can run one block pair on, forward and backward, with the log-sum-exp the ring merges with.

  hexiseq  hexiseq.ops (the CUDA kernels of kernels/)
  flash    torch's flash op (aten._scaled_dot_product_flash_attention and its backward; what the runtime uses now)
  cudnn    torch's cuDNN attention op (aten._scaled_dot_product_cudnn_attention, which also returns the LSE), its
           backward through the aten op where this torch takes it, else timed through autograd of
           F.scaled_dot_product_attention under the cuDNN backend (said in the table)

and for packed documents (a causal mask cut at each document's start):

  hexiseq-docs  hexiseq.ops with q_doc (the document mask)
  flash-varlen  torch's variable-length flash op (aten._flash_attention_forward over cumulative document lengths)

Every candidate's output is compared with hexiseq's (max |difference|, in units of the largest |out|) so that a
timing never stands for a wrong answer; a candidate this torch or device lacks is reported with the reason, not
timed. Layout as the runtime holds it: [batch, seq, heads, head_dim] tensors, handed over as [B, H, S, D] views.

    python benchmarks/bench_block_backends.py [--seqs 4096,8192,32768] [--dims 64,128] [--out DIR]
"""

import argparse
import functools
import json
import math
import os
import platform
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hexiseq import ops  # noqa: E402
from hexiseq.runtime import fused  # noqa: E402
from bench_cuda_attention import time_ms  # noqa: E402  (CUDA-event median after warm-up, as the kernel benchmark)


def flash(q, k, v, do, causal, scale):
    out, lse = fused._flash_forward(q, k, v, causal, scale)
    return (lambda: fused._flash_forward(q, k, v, causal, scale),
            lambda: fused._flash_backward(q, k, v, out, lse, do, causal, scale), out, "aten op")


def hexiseq_kernels(q, k, v, do, causal, scale):
    out, lse = ops.attention_forward(q, k, v, causal=causal, scale=scale)
    return (lambda: ops.attention_forward(q, k, v, causal=causal, scale=scale),
            lambda: ops.attention_backward(q, k, v, out, lse, do, causal=causal, scale=scale), out, "hexiseq.ops")


def cudnn(q, k, v, do, causal, scale):
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    gqa = "GQA native"
    try:  # fewer kv heads than query heads, as they are
        op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
    except Exception as e:  # noqa: BLE001 - the op takes equal head counts: K, V expanded, outside the timing
        gqa = f"GQA expanded ({type(e).__name__})"
        rep = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)

    def fwd():
        return op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)

    r = fwd()
    out = r[0].transpose(1, 2)
    bwd_op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    how, bwd = f"aten op, {gqa}", None
    for bias in (None, torch.empty(0, device=q.device, dtype=q.dtype)):
        args = (dot, qt, kt, vt, r[0], r[1], r[6], r[7], bias, r[2], r[3], r[4], r[5], 0.0, causal)
        try:
            bwd_op(*args, scale=scale)
        except Exception:  # noqa: BLE001 - the signature varies across torch versions: try the next form
            continue
        bwd = functools.partial(bwd_op, *args, scale=scale)
        break
    if bwd is None:  # autograd through the public call under the cuDNN backend (forward included in this time)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        how = f"autograd (bwd time includes a forward), {gqa}"
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

        def bwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
            o.backward(dot)
    return fwd, bwd, out, how


def documents_case(S, seed):
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < S:  # lognormal lengths as in pretraining mixes: many short, a few long
        lengths.append(int(min(S - sum(lengths), max(1, rng.lognormal(math.log(S / 16), 1.2)))))
    return lengths


def hexiseq_docs(q, k, v, do, lengths, scale):
    q_doc = torch.from_numpy(ops.document_starts(lengths)).to(q.device)
    out, lse = ops.attention_forward(q, k, v, causal=True, scale=scale, q_doc=q_doc)
    return (lambda: ops.attention_forward(q, k, v, causal=True, scale=scale, q_doc=q_doc),
            lambda: ops.attention_backward(q, k, v, out, lse, do, causal=True, scale=scale, q_doc=q_doc), out,
            "hexiseq.ops q_doc")


def flash_varlen(q, k, v, do, lengths, scale):
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device=q.device)
    mx = max(lengths)
    qv, kv, vv, dov = (x[0] for x in (q, k, v, do))  # [total, heads, D]
    op = torch.ops.aten._flash_attention_forward

    def fwd():
        return op(qv, kv, vv, cu, cu, mx, mx, 0.0, True, False, scale=scale)

    r = fwd()
    bwd_op = torch.ops.aten._flash_attention_backward

    def bwd():
        return bwd_op(dov, qv, kv, vv, r[0], r[1], cu, cu, mx, mx, 0.0, True, r[2], r[3], scale=scale)
    return fwd, bwd, r[0][None], "aten op"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="4096,8192,32768")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--heads", default="16,4", help="query heads,kv heads")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_block_backends: needs a CUDA device visible to torch")
    H, Hk = (int(x) for x in a.heads.split(","))
    dev = torch.device("cuda")
    dt = torch.bfloat16
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), python=platform.python_version())
    print(env, flush=True)
    rows = []
    for S in (int(x) for x in a.seqs.split(",")):
        for D in (int(x) for x in a.dims.split(",")):
            scale = D ** -0.5
            g = torch.Generator(device=dev).manual_seed(S + D)
            q = torch.randn(1, S, H, D, device=dev, generator=g).to(dt)
            k, v = (torch.randn(1, S, Hk, D, device=dev, generator=g).to(dt) for _ in range(2))
            do = torch.randn(1, S, H, D, device=dev, generator=g).to(dt)
            lengths = documents_case(S, S + D)
            cases = [("causal", True, (("hexiseq", hexiseq_kernels), ("flash", flash), ("cudnn", cudnn))),
                     ("full", False, (("hexiseq", hexiseq_kernels), ("flash", flash), ("cudnn", cudnn))),
                     (f"documents ({len(lengths)}, longest {max(lengths)})", None,
                      (("hexiseq-docs", hexiseq_docs), ("flash-varlen", flash_varlen)))]
            for mask, causal, cands in cases:
                base_out, base = None, None
                for name, make in cands:
                    row = dict(seq=S, head_dim=D, heads=f"{H}/{Hk}", mask=mask, backend=name)
                    try:
                        fwd, bwd, out, how = (make(q, k, v, do, causal, scale) if causal is not None
                                              else make(q, k, v, do, lengths, scale))
                        torch.cuda.synchronize()
                        if base_out is None:
                            base_out = out.float()
                            err = 0.0
                        else:
                            err = ((out.float() - base_out).abs().max() / base_out.abs().max()).item()
                        row.update(how=how, fwd_ms=time_ms(fwd, a.reps), bwd_ms=time_ms(bwd, a.reps), diff=err)
                        row["total_ms"] = row["fwd_ms"] + row["bwd_ms"]
                        if base is None:
                            base = row
                        row["fwd_vs_first"] = row["fwd_ms"] / base["fwd_ms"]
                        row["bwd_vs_first"] = row["bwd_ms"] / base["bwd_ms"]
                    except Exception as e:  # noqa: BLE001 - a candidate this torch or GPU lacks is reported
                        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    print(row, flush=True)
                    rows.append(row)
                    torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    tag = torch.cuda.get_device_name().split()[-1].lower()
    with open(os.path.join(a.out, f"block_backends_{tag}.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    lines = [f"# Block backends on an {env['device']}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}; bf16, batch 1, heads {H}/{Hk}; "
             f"median of {a.reps} runs after 3 warm-up runs (CUDA events). Ratios are to the first backend of each "
             "row group (hexiseq), measured in the same run; diff: max |out - hexiseq's out| / max |out|.", "",
             "| seq | D | mask | backend | fwd ms | bwd ms | fwd+bwd ms | fwd / first | bwd / first | diff | how |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['head_dim']} | {r['mask']} | {r['backend']} | - | - | - | - | - | - | "
                         f"{r['error']} |")
        else:
            lines.append(f"| {r['seq']} | {r['head_dim']} | {r['mask']} | {r['backend']} | {r['fwd_ms']:.3f} | "
                         f"{r['bwd_ms']:.3f} | {r['total_ms']:.3f} | {r['fwd_vs_first']:.2f} | "
                         f"{r['bwd_vs_first']:.2f} | {r['diff']:.1e} | {r['how']} |")
    with open(os.path.join(a.out, f"block_backends_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
