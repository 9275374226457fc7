"""What the benchmarks share: the machine line every result file starts with, and the time of a collective
step as the slowest rank sees it."""

import os
import platform
import subprocess


def machine():
    """CPU model (from lscpu when available) and core count."""
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def slowest_rank_s(fn):
    """Seconds of fn() on the slowest rank of the default process group, from a common barrier (collective)."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)
