"""The gradient sync across groups, measured: states held once per group (shard_states(..., replicas=...)) and
summed by sync_replicas, against one all-reduce of the whole gradient over the world, on 4 CPU ranks whose links
are limited with tc; beside each, the batch planner's prediction (BatchPlanner.sync_s).

Usage: python benchmarks/replica_sync_cpu.py [--link-gbit 1] [--iters 5] [--out benchmarks/results/replica_sync_cpu.md]

Four Gloo ranks on one host, one thread each; the loopback device is limited to --link-gbit with a token bucket
(tc tbf, as root; removed at the end). The gradient is a model's (hexiseq.Model below, float32) laid out as the
states engine lays it out (one unit per layer); each rank's shard gets a gradient and then, from a common barrier:
- world: one all-reduce of the whole flat gradient over the 4 ranks (what a batch plan's step ran before the
  states could be held per group: every rank holds every gradient);
- per group: sync_replicas over the replicas (groups [0] + [1, 2, 3], the unequal case, and [0, 1] + [2, 3]),
  each rank all-reducing what it holds with the ranks of the other group holding the same elements.
The time of a row is the slowest rank's, the median of --iters after one warm-up.

The prediction: BatchPlanner.sync_s for the same groups, on a cluster of 4 devices whose every link has the rate
one exchange of the row gets on the limited loopback: one device queue carries both directions of every exchange
running at the same time, so lo's rate / (2 x the exchanges at once) each way (rank 0 of [0] + [1, 2, 3] sums with
its partners one at a time; the two pairs of [0, 1] + [2, 3] exchange at once); the latency is the catalog's
default. The world all-reduce is not predicted: its 4 ranks' flows all share lo at once, as no cluster of separate
links would, so it is the measured reference only.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import hexiseq  # noqa: E402
from hexiseq.states import shard_states, sync_replicas  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine, slowest_rank_s  # noqa: E402

WORLD = 4
MODEL = hexiseq.Model(layers=4, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=2816, vocab=8192,
                      name="sync-bench")
# (name, groups, exchanges at once): rank 0 of [0] + [1, 2, 3] sums with rank 1, then 2, then 3, one pair at a
# time; in [0, 1] + [2, 3] the pairs (0, 2) and (1, 3) exchange at the same time, on the same loopback queue
ROWS = [("world all-reduce", None, None), ("per group [0] + [1, 2, 3]", [[0], [1, 2, 3]], 1),
        ("per group [0, 1] + [2, 3]", [[0, 1], [2, 3]], 2)]


def flat_elements():
    """float32 elements of the gradient: the model's parameter bytes as the planner prices them."""
    return int(MODEL.params * MODEL.dtype_bytes // 4)


def net():
    """A module of MODEL's parameter count in float32: one unit per layer (a ModuleList) and a root unit."""
    total, layers = flat_elements(), MODEL.layers
    per_layer = total // (layers + 1)
    root = total - per_layer * layers
    module = torch.nn.Module()
    module.layers = torch.nn.ModuleList(torch.nn.Linear(per_layer, 1, bias=False) for _ in range(layers))
    module.rest = torch.nn.Parameter(torch.zeros(root))
    return module


def timed(fn, iters):
    """The slowest rank's seconds of fn from a common barrier: median of iters after one warm-up."""
    return statistics.median([slowest_rank_s(fn) for _ in range(iters + 1)][1:])


def worker(rank, init, args, result_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    results = {}
    for name, replicas, _ in ROWS:
        if replicas is None:
            flat = torch.randn(flat_elements())
            results[name] = timed(lambda: dist.all_reduce(flat), args.iters)
            continue
        torch.manual_seed(1)  # the same weights on every rank
        module = shard_states(net(), "even", replicas=replicas)
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        results[name] = timed(lambda: sync_replicas(module), args.iters)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def link_gbit(lo_gbit, at_once):
    """What one direction of one pair's exchange gets of lo's rate: lo carries both directions of every exchange
    running at the same time."""
    return lo_gbit / (2 * at_once)


def predicted(lo_gbit):
    """BatchPlanner.sync_s of each row's groups on 4 devices whose every link runs at what an exchange of that row
    gets (link_gbit)."""
    out = {}
    for name, replicas, at_once in ROWS:
        if replicas is None:
            continue
        gbps = link_gbit(lo_gbit, at_once) / 8  # GB/s per direction
        cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": gbps}
                                                       for _ in range(WORLD)], "inter_node_gbps": gbps})
        planner = hexiseq.BatchPlanner(cluster, model=MODEL, groups=[tuple(g) for g in replicas])
        out[name] = planner.sync_s(replicas)
    return out


def report(measured, args):
    guess = predicted(args.link_gbit)
    world = measured["world all-reduce"]
    mb = flat_elements() * 4 / 1e6
    lines = ["# Gradient sync across groups, measured (`benchmarks/replica_sync_cpu.py`)", "",
             f"Machine: {machine()}. {WORLD} Gloo ranks on one host, one thread each; loopback limited to "
             f"{args.link_gbit:g} Gbit/s (tc tbf). Gradient: {mb:.1f} MB (the parameters of a {MODEL.params / 1e6:.1f}M "
             f"model, {MODEL.dtype_bytes} bytes each, as the planner prices them), float32. Median of {args.iters} "
             f"after one warm-up, the slowest rank from a common barrier. Predicted: BatchPlanner.sync_s on {WORLD} "
             "devices whose every link runs at what one exchange of the row gets of the loopback: one queue "
             "carries both directions of every exchange running at once, so lo's rate / (2 x exchanges at once) "
             "each way. The world all-reduce's 4 flows all share lo at once, as no cluster of separate links "
             "would: it is the measured reference, not predicted.", "",
             "| sync | measured s | vs world all-reduce | exchanges at once | link each way, Gbit/s | predicted s "
             "| predicted / measured |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, _, at_once in ROWS:
        m = measured[name]
        p = guess.get(name)
        if p is None:
            lines.append(f"| {name} | {m:.3f} | 1.00x | 4 flows | | | |")
            continue
        lines.append(f"| {name} | {m:.3f} | {world / m:.2f}x | {at_once} | {link_gbit(args.link_gbit, at_once):g} | "
                     f"{p:.3f} | {p / m:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--link-gbit", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="Markdown report (default: print only)")
    args = ap.parse_args()
    cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{args.link_gbit}gbit", "burst", "256kb",
           "latency", "100ms"]
    if subprocess.run(cmd).returncode:
        sys.exit("could not limit lo with tc (needs root and the tbf qdisc)")
    try:
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=("file://" + os.path.join(tmp, "store"), args, path), nprocs=WORLD)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"])
    with open(path) as f:
        measured = json.load(f)
    text = report(measured, args)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
