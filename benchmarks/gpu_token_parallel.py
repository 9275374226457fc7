"""A layer's token-parallel work on one device, measured, against what the cost model prices for it from calibrate's
own rates.

Usage (a CUDA device):  python benchmarks/gpu_token_parallel.py [--out FILE.md]
        (no GPU):       python benchmarks/gpu_token_parallel.py --dry-run    (tiny sizes on the CPU: the code paths)

The cost model prices a layer's work outside attention as its matmuls (FLOPs at the calibrated matmul curve) plus
its memory-bound work (the bytes docs/cost_model.md counts, at the calibrated memory-bound rate). For a model's
shapes, this script takes both rates as calibrate measures them (hexiseq.hardware.calibration: the matmul curve at
the default CUDA rows 512, 2048 and 8192, held beyond its last point as the cost model holds it; the memory-bound
rate at 8192 rows), and times, at several token counts, forward + backward back to back, measure's Llama layer with
its attention call replaced by the identity on q (calibration._token_parallel_step): what those two terms together
should predict. Every figure is measured; "priced" is the sum of the two terms at the measured rates.

(`benchmarks/results/gpu/token_parallel_h100.md` was made by an earlier version of this script, before calibrate
timed matmuls alone and read the memory-bound rate inside a layer: its "calib" columns are the old timings.)"""

import argparse
import sys

import torch

import hexiseq
from hexiseq.hardware import calibration as cal
from hexiseq.hardware.harness import seconds_queued

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402


class _Quiet:
    def tick(self, n=1):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--models", default="benchmarks/data/llama32-3b.json,gpt-3b")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    curve_rows, top = ([512, 2048, 8192], 8192) if cuda else ([32, 64], 64)
    rows_list = [4096, 8192, 16384, 32768] if cuda else [64, 128]
    iters = 5 if cuda else 2
    lines = [f"# A layer's token-parallel work against calibrate's rates ({machine()})", "",
             f"`python benchmarks/gpu_token_parallel.py`; {str(dtype).replace('torch.', '')}, forward + backward back "
             f"to back, mean of {iters}; ms unless marked. All measured; priced = matmul FLOPs at calibrate's "
             "matmul curve + the counted bytes at its memory-bound rate.", "",
             "| model | tokens | layer | matmul curve, TFLOP/s | memory-bound, GB/s | priced | layer / priced |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for name in a.models.split(","):
        m = hexiseq.Model.from_name_or_path(name)
        if not cuda:
            m = hexiseq.Model(1, 64, 4, 2, 16, 96, 128, gated_mlp=m.gated_mlp, name="tiny-" + m.name)
        curve = cal._gemm_curve(m, curve_rows, device, dtype, iters, 1, lambda: None, _Quiet())
        mb = cal._mem_bound_rate(m, top, device, dtype, iters, 1, lambda: None, _Quiet())
        g = torch.Generator(device=device).manual_seed(7)
        for rows in rows_list:
            t_layer = seconds_queued(cal._token_parallel_step(m, rows, device, dtype, g), device, iters, 2)
            _, flops = cal._matmuls(m, rows, device, dtype, g)
            rate = hexiseq._core.curve_at([tuple(p) for p in curve], rows)  # read as the cost model reads it
            priced = flops / rate / 1e12 + cal._mem_bound_bytes(m, rows, dtype) / mb / 1e9
            row = (f"| {m.name} | {rows} | {t_layer * 1e3:.2f} | {rate:.0f} | {mb:.0f} | {priced * 1e3:.2f} | "
                   f"{t_layer / priced:.3f} |")
            lines.append(row)
            print(row, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
