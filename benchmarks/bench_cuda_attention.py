"""TFLOP/s of hexiseq's CUDA attention (forward, backward) next to torch SDPA's flash backend, same inputs.

Usage: python benchmarks/bench_cuda_attention.py [--out results.md] [--seqs 4096,8192,16384,32768]
       [--bwd-kernels staged,register] [--fwd-keys 64,32]
--bwd-kernels times each named backward kernel (HEXISEQ_CUDA_BACKWARD), --fwd-keys each key tile of the D = 128
forward (HEXISEQ_CUDA_FORWARD_KEYS), in the same run; default: the ones chosen automatically. Prints a table and writes it as Markdown (device name, shapes, figures) to --out. Times are CUDA-event medians
over --iters runs after warm-up. FLOPs: forward 4 * B * H * Sq * Sk * D (two GEMMs), halved under the causal
mask (the usual convention, Sq = Sk); backward 2.5x the forward (five GEMMs). The backward is timed alone: ours is
ops.attention_backward (its dO.O row sums, the key-block kernel and the dQ conversion included), torch's is
autograd.grad through a retained SDPA graph (its flash backward kernel, the same work).
"""

import argparse
import math
import os
import statistics
import sys

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from hexiseq import ops


def flops_fwd(B, H, S, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def time_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_case(B, H, S, D, causal, iters, bwd_kernels, fwd_keys):
    dtype = torch.bfloat16
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    v = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(D)

    out, lse = ops.attention_forward(q, k, v, causal=causal, scale=scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def ours_fwd():
        ops.attention_forward(q, k, v, causal=causal, scale=scale, out=out, lse=lse)

    def ours_bwd():
        ops.attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, dq=dq, dk=dk, dv=dv)

    # SDPA takes [B, H, S, D]: transposed views of the same tensors (the flash backend accepts them).
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (qt, kt, vt))
    dout_t = dout.transpose(1, 2)

    def torch_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o_graph = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)

    def torch_bwd():
        torch.autograd.grad(o_graph, (qg, kg, vg), dout_t, retain_graph=True)

    f = flops_fwd(B, H, S, D, causal)
    row = dict(B=B, H=H, S=S, D=D, causal=causal)
    # (name, function, FLOPs, environment variable and value that pick our kernel variant, or None)
    runs = [(f"ours_fwd_{k}", ours_fwd, f, ("HEXISEQ_CUDA_FORWARD_KEYS", k)) for k in fwd_keys]
    runs += [("torch_fwd", torch_fwd, f, None)]
    runs += [(f"ours_bwd_{k}", ours_bwd, 2.5 * f, ("HEXISEQ_CUDA_BACKWARD", k)) for k in bwd_kernels]
    runs += [("torch_bwd", torch_bwd, 2.5 * f, None)]
    for name, fn, fl, env in runs:
        try:
            if env is not None and env[1] != "auto":
                os.environ[env[0]] = env[1]
            ms = time_ms(fn, iters)
            row[name] = fl / (ms * 1e-3) / 1e12
        except Exception as e:  # a failing side is reported, not fatal: the other figures are still useful
            print(f"  {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            row[name] = float("nan")
        finally:
            if env is not None:
                os.environ.pop(env[0], None)
    # correctness spot check in the same run (forward only: backward is covered by tests/test_cuda_ops.py)
    ours_fwd()
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    row["max_abs_diff_fwd"] = (out.float() - ref.float()).abs().max().item()
    del q, k, v, dout, qg, kg, vg, o_graph
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="Markdown file to write")
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--bwd-kernels", default="auto",
                    help="backward kernels to time, comma-separated: auto, staged, register")
    ap.add_argument("--fwd-keys", default="auto",
                    help="key tiles of the D = 128 forward to time, comma-separated: auto, 64, 32")
    ap.add_argument("--tokens", type=int, default=32768 * 16,
                    help="batch * seq * heads / 16 ~ this: batch * heads chosen to fill the GPU at every seq")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    dev = torch.cuda.get_device_name()
    rows = []
    for D in (int(x) for x in args.dims.split(",")):
        for S in (int(x) for x in args.seqs.split(",")):
            H = 2048 // D  # 32 heads at D=64, 16 at D=128: a model width of 2048
            B = max(1, args.tokens // (S * H))
            for causal in (False, True):
                print(f"B={B} H={H} S={S} D={D} causal={causal} ...", file=sys.stderr, flush=True)
                rows.append(bench_case(B, H, S, D, causal, args.iters, args.bwd_kernels.split(","),
                                       args.fwd_keys.split(",")))
                write(rows, dev, args, final=False)  # partial results survive a timeout
    write(rows, dev, args, final=True)


def write(rows, dev, args, final):
    def columns(r, side, variants, label):  # ours per variant next to torch: TFLOP/s and ratio
        named = (lambda k: f"ours {side}") if variants == ["auto"] else (lambda k: f"ours {side} ({label}{k})")
        head = " | ".join(f"{named(k)} | ratio" for k in variants)
        cells = " | ".join(f"{r[f'ours_{side}_{k}']:.1f} | {r[f'ours_{side}_{k}'] / r[f'torch_{side}']:.2f}"
                           for k in variants) if r else ""
        return head, cells

    fwd_keys, kernels = args.fwd_keys.split(","), args.bwd_kernels.split(",")
    head = ("| B | H | S | D | causal | torch fwd | " + columns(None, "fwd", fwd_keys, "keys ")[0] + " | torch bwd | "
            + columns(None, "bwd", kernels, "")[0] + " | max diff fwd |")
    lines = [head, "|" + "---|" * (8 + 2 * len(fwd_keys) + 2 * len(kernels))]
    for r in rows:
        lines.append(f"| {r['B']} | {r['H']} | {r['S']} | {r['D']} | {r['causal']} | {r['torch_fwd']:.1f} | "
                     f"{columns(r, 'fwd', fwd_keys, '')[1]} | {r['torch_bwd']:.1f} | "
                     f"{columns(r, 'bwd', kernels, '')[1]} | {r['max_abs_diff_fwd']:.2e} |")
    table = "\n".join(lines)
    if final:
        print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# hexiseq CUDA attention vs torch SDPA (flash backend)\n\n"
                    f"Device: {dev}; torch {torch.__version__}; CUDA {torch.version.cuda}; bf16; "
                    f"TFLOP/s (CUDA-event medians of {args.iters} runs); causal FLOPs halved; bwd = 2.5 x fwd "
                    f"FLOPs. Layout [batch, seq, heads, head_dim] for ours, transposed views of the same tensors "
                    f"for SDPA.{'' if final else ' PARTIAL: the run did not finish.'}\n\n{table}\n")
        if final:
            print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
