"""What uneven state sharding costs: a training step under hexiseq.shard_states with even shares (by default
handed to FSDP2, and forced onto hexiseq's own engine), with uneven shares, and under torch's FSDP2 (fully_shard
by hand, even shares) as the peer, side by side in the same run.

Usage: python benchmarks/bench_states.py [--world 2] [--layers 8] [--dim 1024] [--tokens 256] [--reps 7]
                                         [--shares 0.7,0.3] [--out benchmarks/results/states.md]

Every rank (Gloo, CPU, one thread per process) runs forward, backward and an Adam step of a stack of `--layers`
blocks (Linear dim x 4dim, GELU, Linear 4dim x dim, LayerNorm) on its own `--tokens` rows. Reported per setting:
the step's wall time (median over --reps after two warm-ups, slowest rank), its ratio to FSDP2's, and the
parameter elements the rank with the largest shard holds. The model predicts that the padded collectives of
uneven shares move N x (largest share) times an even collective's bytes; the compute is the same.
On a 2-core machine use --world 2: more processes than cores measure the scheduler, not the step."""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hexiseq
from _machine import machine


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Net(nn.Module):
    def __init__(self, layers, dim):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(setting, args, world):
    torch.manual_seed(0)
    net = Net(args.layers, args.dim)
    if setting == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in net.blocks:
            fully_shard(b)
        fully_shard(net)
        return net
    shares = args.shares if setting == "hexiseq uneven" else [1.0 / world] * world
    # "shard_states even" is what a user gets at even shares (FSDP2, by default); "hexiseq even" forces
    # hexiseq's own engine there, to compare the engine itself with FSDP2
    return hexiseq.shard_states(net, shares, engine="auto" if setting == "shard_states even" else "hexiseq")


def step_time(net, args, rank):
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(rank))
    times = []
    for i in range(args.reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when the slowest rank's does
        if i >= 2:
            times.append(time.perf_counter() - t0)
    held = sum(p.numel() for p in net.parameters() if hasattr(p, "numel") and not hasattr(p, "placements"))
    held = held or sum(p.to_local().numel() for p in net.parameters())  # FSDP2: DTensor shards
    return statistics.median(times), held


def worker(rank, world, init, args, settings, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    out = {}
    for s in settings:
        net = build(s, args, world)
        out[s] = step_time(net, args, rank)
        del net
    results.put((rank, out))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shares", default="0.7,0.3")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.shares = [float(s) for s in args.shares.split(",")]
    if len(args.shares) != args.world:
        ap.error(f"--shares needs {args.world} values, got {len(args.shares)}")
    settings = ["fsdp2", "shard_states even", "hexiseq even", "hexiseq uneven"]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=worker, args=(r, args.world, init, args, settings, results)) for r in range(args.world)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    params = sum(p.numel() for p in Net(args.layers, args.dim).parameters())
    peer = max(got[r]["fsdp2"][0] for r in got)
    lines = [f"# Uneven state sharding: a training step, measured", "",
             f"{machine()}; {args.world} Gloo ranks on CPU, one thread each; {args.layers} blocks of dim {args.dim} "
             f"({params:,} parameters), {args.tokens} rows per rank; median of {args.reps} steps after two warm-ups, "
             f"slowest rank. Command: `python benchmarks/bench_states.py --world {args.world} --layers {args.layers} "
             f"--dim {args.dim} --tokens {args.tokens} --reps {args.reps} --shares {','.join(map(str, args.shares))}`",
             "", "| setting | shares | step (ms, measured) | vs FSDP2 | largest rank's elements |", "|---|---|---|---|---|"]
    for s in settings:
        t = max(got[r][s][0] for r in got)
        held = max(got[r][s][1] for r in got)
        shares = "even" if s != "hexiseq uneven" else ",".join(map(str, args.shares))
        lines.append(f"| {s} | {shares} | {1e3 * t:.1f} | {t / peer:.2f}x | {held:,} |")
    own = max(got[r]["hexiseq even"][0] for r in got)
    uneven = max(got[r]["hexiseq uneven"][0] for r in got)
    lines += ["", "`shard_states even` is what `hexiseq.shard_states(model, even shares)` runs by default: FSDP2 "
              "itself, so its distance from 1.00x is the run-to-run noise of this machine. `hexiseq even` forces "
              "hexiseq's own engine at even shares (`engine=\"hexiseq\"`).", "",
              f"Uneven against the own engine at even shares: {uneven / own:.2f}x, measured. Predicted for the "
              f"padded collectives of these shares: {args.world * max(args.shares):.2f}x an even collective's bytes "
              "(the compute is the same; the rank with the larger share also runs the larger optimizer step)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
