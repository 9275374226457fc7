"""The hexiseq CUDA backward with grouped-query attention: a GQA group's query heads split over CTAs (the default,
HEXISEQ_CUDA_BWD_SPLITS unset) against one CTA walking every head of its group (HEXISEQ_CUDA_BWD_SPLITS=1), and
torch's flash backward on the same inputs, in one run. bf16, batch 1, 16 query heads over 4 kv heads.

    python benchmarks/gpu_gqa_backward.py [--seqs 4096,8192,32768] [--dims 64,128] [--out FILE]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from hexiseq import ops  # noqa: E402
from hexiseq.runtime import fused  # noqa: E402
from bench_cuda_attention import time_ms  # noqa: E402  (CUDA-event median after warm-up)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192,32768")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--heads", default="16,4")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    H, Hk = (int(x) for x in a.heads.split(","))
    rows = []
    for D in (int(x) for x in a.dims.split(",")):
        for S in (int(x) for x in a.seqs.split(",")):
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(1, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
                k, v = (torch.randn(1, S, Hk, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
                do = torch.randn(1, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
                o, lse = ops.attention_forward(q, k, v, causal=causal)
                fo, flse = fused._flash_forward(q, k, v, causal, D ** -0.5)
                row = {"S": S, "D": D, "causal": causal}
                grads = {}
                for name, splits in (("split", None), ("one CTA per group", "1")):
                    if splits is None:
                        os.environ.pop("HEXISEQ_CUDA_BWD_SPLITS", None)
                    else:
                        os.environ["HEXISEQ_CUDA_BWD_SPLITS"] = splits
                    grads[name] = ops.attention_backward(q, k, v, o, lse, do, causal=causal)
                    row[name] = time_ms(lambda: ops.attention_backward(q, k, v, o, lse, do, causal=causal), a.iters)
                os.environ.pop("HEXISEQ_CUDA_BWD_SPLITS", None)
                row["flash"] = time_ms(lambda: fused._flash_backward(q, k, v, fo, flse, do, causal, D ** -0.5),
                                       a.iters)
                # the two hexiseq designs compute the same sums in another order: equal to bf16 rounding
                row["diff"] = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                                  for x, y in zip(grads["split"], grads["one CTA per group"]))
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    lines = [f"# hexiseq CUDA backward with GQA {H}/{Hk}: heads split over CTAs vs one CTA per group", "",
             f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; CUDA {torch.version.cuda}; bf16, "
             f"batch 1; CUDA-event medians of {a.iters} backward calls (measured); flash: torch's flash backward on "
             "the same inputs, same run. diff: max |split - unsplit| / max |unsplit| over dq, dk, dv.", "",
             "| S | D | causal | split (ms) | one CTA per group (ms) | flash (ms) | split / unsplit | flash / split "
             "(speed vs flash) | flash / unsplit | diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['D']} | {r['causal']} | {r['split']:.3f} | {r['one CTA per group']:.3f} | "
                     f"{r['flash']:.3f} | {r['split'] / r['one CTA per group']:.2f} | {r['flash'] / r['split']:.2f} | "
                     f"{r['flash'] / r['one CTA per group']:.2f} | {r['diff']:.1e} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
