"""Plan a small mixed cluster, run the plan's attention on one process per device, and check it against plain
attention over the whole sequence in one process.

    torchrun --nproc_per_node 4 examples/quickstart.py

The cluster is two L40S on one node (PCIe) and two V100 on another (NVLink); the model is llama-tiny (8 query
heads, 2 kv heads, head dim 64) at 6,144 tokens. The planner splits everything unequally: a ring of three groups,
each L40S a group of its own with all 8 heads, the two V100s one head-parallel group of 4 heads each, and every
device its own number of tokens. Here each device is a CPU process (Gloo); on GPUs the same script runs with NCCL and CUDA tensors.
Rank 0 then runs torch's scaled_dot_product_attention over the whole sequence and compares the output and the
gradients of q, k and v; the script exits with status 1 when they differ by more than --tolerance.
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hexiseq
from hexiseq.nn import HexiSeqAttention

CLUSTER = {"nodes": [{"gpu": "L40S", "count": 2, "intra_gbps": 32},
                     {"gpu": "V100", "count": 2, "intra_gbps": 150}],
           "inter_node_gbps": 25}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=6144, help="tokens in the sequence (default 6144)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest relative difference accepted")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. Plan. Every rank plans the same cluster and gets the same plan (the layer checks it by fingerprint).
    cluster = hexiseq.Cluster.from_dict(CLUSTER)
    plan = hexiseq.plan(cluster, model="llama-tiny", seq_len=args.seq_len)
    if world != cluster.num_devices:
        if rank == 0:
            print(f"this example needs {cluster.num_devices} processes (one per device), got {world}",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if rank == 0:
        print(plan.explain().split("\n\n")[0])
        print("device  gpu       group  tokens  heads")
        d = plan.devices  # one row per device, in ring order
        for i in range(len(d.device)):
            print(f"{int(d.device[i]):>6}  {d.gpu[i]:<8}  {int(d.group[i]):>5}  {int(d.tokens[i]):>6}  "
                  f"{int(d.head_count[i]):>5}")

    # 2. The same random q, k, v on every rank (seeded); each rank takes its own tokens, in plan order.
    model = plan.model
    g = torch.Generator().manual_seed(0)
    shape = (1, args.seq_len)
    q = torch.randn(*shape, model.heads, model.head_dim, generator=g)
    k = torch.randn(*shape, model.kv_heads, model.head_dim, generator=g)
    v = torch.randn(*shape, model.kv_heads, model.head_dim, generator=g)
    grad_out = torch.randn_like(q, generator=g)
    mine = [plan.shard(t, dim=1, rank=rank).clone().requires_grad_(True) for t in (q, k, v)]

    # 3. Run the plan: forward and backward of one causal attention layer.
    attn = HexiSeqAttention(plan, causal=True)
    start = time.perf_counter()
    out = attn(*mine)
    out.backward(plan.shard(grad_out, dim=1, rank=rank))
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)

    # 4. Gather every rank's results back into sequence order and check them on rank 0.
    results = [hexiseq.nn.gather_sequence(t, plan, dim=1) for t in (out.detach(), *(m.grad for m in mine))]
    attn.context.close()
    status = 0
    if rank == 0:
        print(f"forward + backward on {world} ranks: {seconds.item():.2f} s")
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
        ref.backward(grad_out)
        worst = 0.0
        for name, got, want in zip(("out", "dq", "dk", "dv"), results, (ref.detach(), *(t.grad for t in full))):
            diff = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, diff)
            print(f"{name}: max relative difference to one-process attention {diff:.1e}")
        status = 0 if worst <= args.tolerance else 1
        print("OK" if status == 0 else f"FAIL (tolerance {args.tolerance:g})")
    flag = torch.tensor([status])
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
