"""A layer's token-parallel work on one device, timed whole and in the two parts the cost model prices apart.

Usage (a CUDA device):  python benchmarks/gpu_token_parallel.py [--out FILE.md]
        (no GPU):       python benchmarks/gpu_token_parallel.py --dry-run    (tiny sizes on the CPU: the code paths)

The cost model prices a layer's work outside attention as its matmuls (FLOPs at the calibrated matmul curve) plus
its memory-bound work (the bytes docs/cost_model.md counts, at the calibrated memory-bound rate). This script times,
for a model's shapes at several token counts, forward + backward:

  layer      measure's Llama layer (planner/measurement.py) with the attention call replaced by the identity on q:
             what the two terms together should predict
  matmuls    the layer's four matmuls alone, back to back (what a matmul curve should measure)
  calib mm   calibrate's matmul timing as it is (the matmuls with the MLP's activation between them)
  calib mb   calibrate's memory-bound timing as it is (norms, residual adds, rotary, activation), as GB/s

and prints the layer's time against the sum each way of pricing it would give: (matmuls + memory-bound at the
calibrated rates of the same row count) and (calibrate's rates as they are: the matmul curve's point and the
memory-bound rate). Every figure is measured; the "priced" columns are sums of measured rates."""

import argparse
import statistics
import sys
import time

import torch

import hexiseq
from hexiseq.planner import calibration as cal
from hexiseq.planner.measurement import _llama_layer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402


class _Quiet:
    def tick(self, n=1):
        pass


def timed(fn, device, iters, warmup=2):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmuls_alone(model, rows, device, dtype, iters):
    H, A, K, d, F = model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn
    up = 2 * F if model.gated_mlp else F
    shapes = ((H, (A + 2 * K) * d), (A * d, H), (H, up), (F, H))
    w = [(torch.randn(a, b, device=device, dtype=dtype) * H ** -0.5).requires_grad_() for a, b in shapes]
    x = torch.randn(rows, H, device=device, dtype=dtype).requires_grad_()

    def step():
        qkv = x @ w[0]
        o = qkv[:, :A * d] @ w[1]
        h = o @ w[2]
        y = h[:, :F] @ w[3]
        torch.autograd.grad(y, [x] + w, torch.ones_like(y))

    flops = 2.0 * sum(a * b for a, b in shapes) * rows * 3
    return timed(step, device, iters), flops


def layer_alone(model, rows, device, dtype, iters):
    block = _llama_layer(model, lambda q, k, v: q, device, dtype, 0)
    x = torch.randn(1, rows, model.hidden, device=device, dtype=dtype).requires_grad_()

    def step():
        y = block(x)
        torch.autograd.grad(y, [x] + list(block.parameters()), torch.ones_like(y))

    return timed(step, device, iters)


def mem_bytes(model, rows, dtype):
    H, q, kv, F = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim, model.ffn
    elems = 4.0 * H + 6.0 * H + 2.0 * (q + kv) + (3.0 if model.gated_mlp else 2.0) * F
    return rows * elems * torch.empty(0, dtype=dtype).element_size() * 3.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--models", default="benchmarks/data/llama32-3b.json,gpt-3b")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows_list = [4096, 8192, 16384, 32768] if cuda else [64, 128]
    iters = 5 if cuda else 2
    lines = [f"# A layer's token-parallel work, whole and in parts ({machine()})", "",
             f"`python benchmarks/gpu_token_parallel.py`; {str(dtype).replace('torch.', '')}, forward + backward, "
             f"median of {iters}; ms unless marked. All measured; the priced columns are sums of measured rates.", "",
             "| model | tokens | layer | matmuls alone | TFLOP/s | calib mm TFLOP/s | calib mb GB/s | "
             "priced: same-size rates | priced: calibrate as is | layer / as is |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for name in a.models.split(","):
        m = hexiseq.Model.from_name_or_path(name)
        if not cuda:
            m = hexiseq.Model(1, 64, 4, 2, 16, 96, 128, gated_mlp=m.gated_mlp, name="tiny-" + m.name)
        curve = cal._gemm_curve(m, rows_list, device, dtype, iters, 1, lambda: None, _Quiet())
        top = rows_list[1] if cuda else rows_list[-1]  # calibrate's default top point on CUDA: 8192 rows
        top_rate = dict(curve)[top]
        as_is_mb = cal._mem_bound_rate(m, top, device, dtype, iters, 1, lambda: None, _Quiet())
        for rows, mm_rate in curve:
            t_layer = layer_alone(m, rows, device, dtype, iters)
            t_mm, flops = matmuls_alone(m, rows, device, dtype, iters)
            mb = cal._mem_bound_rate(m, rows, device, dtype, iters, 1, lambda: None, _Quiet())
            nbytes = mem_bytes(m, rows, dtype)
            same = t_mm + nbytes / mb / 1e9
            # calibrate's default curve ends at 8192 rows and the cost model holds its last point beyond
            as_is = flops / (mm_rate if rows <= top else top_rate) / 1e12 + nbytes / as_is_mb / 1e9
            row = (f"| {m.name} | {rows} | {t_layer * 1e3:.2f} | {t_mm * 1e3:.2f} | {flops / t_mm / 1e12:.0f} | "
                   f"{mm_rate:.0f} | {mb:.0f} | {same * 1e3:.2f} | {as_is * 1e3:.2f} | {t_layer / as_is:.3f} |")
            lines.append(row)
            print(row, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
