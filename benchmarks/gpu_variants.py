"""GPU timings of the attention variants (run by benchmarks/run_gpu_checks.sh, step `variants`): the hexiseq CUDA
kernels forward and backward with a sliding window and with logit soft-capping, next to the same kernels on the
plain causal mask and to torch SDPA (its default backend choice) on the plain causal mask, all on the same inputs in the same run
(CUDA-event medians). A window of W keys should cost about W / (S / 2) of the causal call; soft-capping adds a tanh
per score. With --sanitize: a few small odd-shaped variant calls, forward and backward, for compute-sanitizer.
Usage: python benchmarks/gpu_variants.py [--out FILE.md] [--sanitize]"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

from hexiseq import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda_attention import time_ms as bench_time_ms  # noqa: E402

dev = torch.device("cuda")


def time_ms(fn):
    """CUDA-event median of 10 calls after 3 warm-ups (the kernel benchmark's timer)."""
    return bench_time_ms(fn, 10)


def sanitize_cases():
    for dtype, D, causal, sq, sk, qp, kp, window, cap in (
            (torch.bfloat16, 64, True, 97, 130, 40, 0, (17, 0), None),
            (torch.float16, 128, False, 65, 93, 0, 0, (9, 13), 5.0),
            (torch.bfloat16, 128, True, 130, 97, 60, 0, (33, -1), 30.0),
            (torch.bfloat16, 256, True, 70, 71, 0, 0, (5, 0), 2.0)):
        q = torch.randn(2, sq, 4, D, device=dev, dtype=dtype)
        k = torch.randn(2, sk, 2, D, device=dev, dtype=dtype)
        v = torch.randn(2, sk, 2, D, device=dev, dtype=dtype)
        kw = dict(causal=causal, q_pos0=qp, k_pos0=kp, window=window, softcap=cap)
        out, lse = ops.attention_forward(q, k, v, **kw)
        ops.attention_backward(q, k, v, out, lse, torch.randn_like(q), **kw)
    torch.cuda.synchronize()
    print("variant sanitizer cases ran")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sanitize", action="store_true")
    a = ap.parse_args()
    if a.sanitize:
        return sanitize_cases()
    rows = []
    for S, D, window, cap in ((32768, 128, (4095, 0), None), (32768, 64, (4095, 0), None),
                              (8192, 128, None, 50.0), (8192, 128, (4095, 0), 50.0)):
        B, H, Hk = 1, 16, 4
        q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=False)
        k = torch.randn(B, S, Hk, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, S, Hk, D, device=dev, dtype=torch.bfloat16)
        do = torch.randn_like(q)
        kw = dict(causal=True, window=window, softcap=cap)
        o, l = ops.attention_forward(q, k, v, **kw)
        op, lp = ops.attention_forward(q, k, v, causal=True)
        t = {
            "variant fwd": time_ms(lambda: ops.attention_forward(q, k, v, **kw)),
            "variant bwd": time_ms(lambda: ops.attention_backward(q, k, v, o, l, do, **kw)),
            "plain fwd": time_ms(lambda: ops.attention_forward(q, k, v, causal=True)),
            "plain bwd": time_ms(lambda: ops.attention_backward(q, k, v, op, lp, do, causal=True)),
        }
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        t["sdpa fwd"] = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
        rows.append((S, D, window, cap, t))
        print(S, D, window, cap, {n: round(x, 3) for n, x in t.items()}, flush=True)
    lines = [f"# Attention variants on {torch.cuda.get_device_name()}: hexiseq CUDA kernels",
             "", f"torch {torch.__version__}, CUDA {torch.version.cuda}; bf16, batch 1, 16 query heads, 4 kv heads, "
             "causal; CUDA-event medians of 10 calls (measured). `window (W-1, 0)`: each query sees its W latest "
             "keys. Plain: the same kernels on the causal mask alone; SDPA: torch scaled_dot_product_attention with its default backend choice (not forced to flash), causal, "
             "forward only (it has no soft-capping).", "",
             "| S | D | window | softcap | variant fwd (ms) | plain fwd (ms) | variant / plain fwd | variant bwd (ms) "
             "| plain bwd (ms) | variant / plain bwd | SDPA fwd, default backend (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for S, D, window, cap, t in rows:
        lines.append(f"| {S} | {D} | {window} | {cap} | {t['variant fwd']:.3f} | {t['plain fwd']:.3f} | "
                     f"{t['variant fwd'] / t['plain fwd']:.3f} | {t['variant bwd']:.3f} | {t['plain bwd']:.3f} | "
                     f"{t['variant bwd'] / t['plain bwd']:.3f} | {t['sdpa fwd']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
