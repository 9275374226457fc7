"""The calibration's attention timing (the device synchronised around every call) next to back-to-back calls, and the
host's time to issue them, through the block backend the runtime chooses: 24/8 heads of dim 128, bf16, full and
causal-diagonal blocks of 1K-16K tokens, forward with its merge into an fp32 accumulator, and backward. Run on a GPU machine: python benchmarks/gpu_block_timing.py (results in
benchmarks/results/gpu/calibrate_measure_h100_rounds.md)."""

import math
import time

import torch

from hexiseq.hardware.harness import seconds
from hexiseq.runtime import blocks

H, KV, D = 24, 8, 128


def back_to_back(fn, reps=20):
    """Seconds per call of `reps` calls issued without waiting, the device synchronised at both ends."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def host_issue(fn, reps=20):
    """Seconds per call the host takes to issue `reps` calls (not waiting for the device)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return t


def main():
    dev, dt = torch.device("cuda", 0), torch.bfloat16
    kern = blocks.kernels_for(dev, dt)
    scale = 1 / math.sqrt(D)
    print("kernels", type(kern).__name__)
    for n in (1024, 2048, 4096, 8192, 16384):
        q, do = (torch.randn(1, n, H, D, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, n, KV, D, device=dev, dtype=dt) for _ in range(2))
        for q_pos0 in (n, 0):  # every key before every query (full), then the diagonal block
            o, lse = kern.forward(q, k, v, True, q_pos0, 0, scale)
            o_acc, lse_acc = o.float(), lse.float().clone()
            dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
            dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=dev) for _ in range(2))

            def fwd():
                kern.merge(o_acc, lse_acc, *kern.forward(q, k, v, True, q_pos0, 0, scale))

            def bwd():
                kern.backward_into(q, k, v, o, lse, do, True, q_pos0, 0, scale, dq, dk, dv)

            pairs = n * n if q_pos0 else n * (n + 1) / 2
            flops = 4.0 * pairs * D * H * 3.5  # forward + backward (2.5 forwards)
            synced = seconds(fwd, dev, 5, 2) + seconds(bwd, dev, 5, 2)
            b2b = back_to_back(fwd) + back_to_back(bwd)
            issue = host_issue(fwd) + host_issue(bwd)
            print(f"n {n:6d} {'full' if q_pos0 else 'diag'}: synced {flops / synced / 1e12:7.1f} TF/s "
                  f"({synced * 1e3:.3f} ms)  back-to-back {flops / b2b / 1e12:7.1f} TF/s ({b2b * 1e3:.3f} ms)  "
                  f"host issue {issue * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
