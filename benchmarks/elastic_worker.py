"""The worker of benchmarks/elastic_restart_cpu.py: one rank of a small training job under torchrun's elastic agent.

On every (re)start it learns which devices of the saved cluster are still there (hexiseq.elastic.survivors: each
rank's machine name and local rank, matched to the nodes' hosts; each agent here names its machine by HEXISEQ_HOST,
standing in for a machine of its own), plans on the cluster of those devices in rank order, shards the model states
at that plan's shares, loads the last checkpoint if there is one, and trains on. A step's batch is the same
whatever the world size (split over the ranks, losses summed), so the loss of a step does not depend on how many
ranks took it.
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hexiseq  # noqa: E402
from hexiseq.checkpoint import load_states, save_states  # noqa: E402

VOCAB, DIM, BATCH, SEQ = 64, 32, 4, 16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM, dtype=torch.float64) for _ in range(2)])
        self.head = torch.nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, idx):
        h = self.emb(idx)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def batch(step, i):
    g = torch.Generator().manual_seed(1000 * step + i)
    idx = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
    return idx[:-1], idx[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--events", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = hexiseq.Cluster.from_file(a.cluster)
    survivors, present = hexiseq.elastic.survivors(cluster)  # device r of `survivors` is rank r's
    mine = present[rank]
    lost = sorted(set(range(cluster.num_devices)) - set(present))
    plan = hexiseq.plan(survivors, model="llama-tiny", seq_len=4096)
    shares = [float(x) for x in plan.state_shares]  # this world's ranks, in rank order
    net = hexiseq.shard_states(Net(), shares, reduce="sum")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    start = 0
    latest = os.path.join(a.ckpt, "latest")
    if os.path.exists(latest):
        start = int(open(latest).read())
        load_states(net, os.path.join(a.ckpt, f"step-{start}"), opt)
    progress = os.environ.get("HEXISEQ_DEMO_PROGRESS")
    if progress:  # the driver kills this process by its pid (torchrun starts workers in sessions of their own)
        with open(f"{progress}.{mine}.pid", "w") as f:
            f.write(str(os.getpid()))
    log = open(a.events, "a")
    if rank == 0:
        log.write(json.dumps({"event": "start", "world": world, "devices": present, "lost": lost,
                              "shares": shares, "from_step": start}) + "\n")
        log.flush()
    for s in range(start, a.steps):
        opt.zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for i in range(rank, BATCH, world):  # this rank's samples of the step's fixed batch
            x, y = batch(s, i)
            loss = loss + F.cross_entropy(net(x[None])[0], y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            log.write(json.dumps({"event": "step", "step": s, "world": world, "loss": float(total)}) + "\n")
            log.flush()
        if (s + 1) % a.every == 0:
            save_states(net, os.path.join(a.ckpt, f"step-{s + 1}"), opt)
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(s + 1))
                os.replace(latest + ".tmp", latest)
            dist.barrier()
        time.sleep(float(os.environ.get("HEXISEQ_DEMO_SLEEP", "0")))  # a step as long as a real one, to be cut in
        if progress:
            with open(f"{progress}.{mine}", "w") as f:
                f.write(str(s))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
