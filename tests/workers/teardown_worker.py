"""A training script's teardown, run under torchrun on 4 CPU ranks by tests/test_teardown.py.

Written as a top-level script (its objects live until the interpreter finalises, as a script's module globals do):
it imports hexiseq.nn before initialising, runs an asymmetric plan's attention with an optimizer step (the first
optimizer makes torch import torch.distributed.nn.functional, after init_process_group), makes a BatchContext's
groups for one step, closes both, then ends with a last collective on the world, destroy_process_group() and the
end of the script, and says how many Gloo threads are left.

--squeeze makes the race at exit deterministic: the rank's threads share one CPU and every thread but the main one
runs at SCHED_IDLE from the last collective on, so the Gloo worker that completes it is preempted by the main thread
it wakes and runs again only when the main thread blocks. A world group that destroy_process_group() cannot free
keeps that worker, holding the collective's work, into interpreter shutdown, where it needs the GIL to drop the
tensor's Python object, is ended by Python mid-unwind and aborts the process ("terminate called without an active
exception"). Freed by destroy_process_group(), the group's threads are joined there, while the interpreter lives.
"""

import argparse
import os
import threading

import torch
import torch.distributed as dist

import hexiseq
from hexiseq.nn import BatchContext, HexiSeqAttention

args = argparse.ArgumentParser()
args.add_argument("--squeeze", action="store_true")
args = args.parse_args()
if args.squeeze:
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})  # inherited by every thread made later


def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            pass
    return sum("gloo" in n for n in names)


def idle_other_threads():
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # ended meanwhile, or not allowed here: the run is then only less likely to race
                pass


torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450},
                                               {"gpu": "A100-80G", "count": 2, "intra_gbps": 300}],
                                     "inter_node_gbps": 25})
model = hexiseq.Model(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=11, name="teardown")
plan = hexiseq.evaluate(cluster, model=model, seq_len=40, layout={"groups": [
    {"devices": [0, 1], "seq": 20, "tokens": [12, 8], "heads": [3, 1]},
    {"devices": [2], "seq": 12, "tokens": [12], "heads": [4]},
    {"devices": [3], "seq": 8, "tokens": [8], "heads": [4]}]})
attn = HexiSeqAttention(plan)
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
opt = torch.optim.AdamW([w])
n = plan.device_row(rank)["tokens"]
q, kv = torch.randn(1, n, 4, 8, dtype=torch.float64), torch.randn(1, n, 2, 8, dtype=torch.float64)
attn(q @ w, kv @ w, kv @ w).sum().backward()
dist.all_reduce(w.grad)
opt.step()
batch = BatchContext(hexiseq.BatchPlanner(cluster, model=model))
step = batch.step(batch.planner.plan([24, 16, 9, 7, 5, 3], exact=False))
attn.context.close()
batch.close()
if args.squeeze:
    idle_other_threads()
flag = torch.tensor([rank])
dist.all_reduce(flag)
dist.destroy_process_group()
print(f"rank {rank}: {gloo_threads()} Gloo thread(s) left after destroy_process_group", flush=True)
