"""HexiSeq's ring against torch's own ring context parallelism on CPU, same inputs, same run.

Usage: python benchmarks/vs_torch_ring_cpu.py [--seqs 4096,8192] [--reps 5] [--out benchmarks/results/vs_torch_ring_cpu.md]

Two Gloo processes, one thread each (OMP_NUM_THREADS=1 and torch.set_num_threads(1) for both sides), 16 query heads,
4 kv heads, head dim 64, fp32, causal, batch 1; forward and backward of the attention of each rank's half.
- torch: torch.distributed.tensor.experimental's ring attention (`_templated_ring_attention` and its backward, the
  functions its context_parallel() patches SDPA with) over torch's CPU flash op
  (`aten._scaled_dot_product_flash_attention_for_cpu`, the op CPU SDPA dispatches to), with its head-tail load
  balancing; K and V expanded to one head per query head (its ops take no GQA), outside the timed region.
- hexiseq: HexiSeqAttention on the 2-device ring plan (zigzag chunks, the same balancing), GQA native, on the
  runtime's CPU block backend (the hexiseq kernels).
Times: the slowest rank's forward+backward, median of --reps after one warm-up, both sides alternating in one run.
Accuracy: at the first length, each side's output and gradients against float64 attention of the whole sequence in
one process (relative to the largest value).
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import hexiseq  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine, slowest_rank_s  # noqa: E402

H, HKV, D = 16, 4, 64


def torch_ring(group):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    cp._cp_options.enable_load_balance = True

    def run(q, k, v, do):
        """q/k/v/do [1, H, s, D] (this rank's head-tail chunks, K/V expanded): (out, dq, dk, dv)."""
        out, lse, *_ = cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k,
                                                    v, is_causal=True, dropout_p=0.0, scale=D ** -0.5)
        dq, dk, dv, *_ = cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, do, "grad_out", q, k, v, out,
            lse, is_causal=True, dropout_p=0.0, scale=D ** -0.5)
        return out, dq, dk, dv
    return run


def head_tail(x, dim, rank, world):
    """torch's load-balanced shard: chunk rank and chunk 2 world - 1 - rank of 2 world chunks along dim."""
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def worker(rank, world, init, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from hexiseq.nn import HexiSeqAttention

    group = dist.group.WORLD
    run_torch = torch_ring(group)
    rows = []
    for n, S in enumerate(int(x) for x in args.seqs.split(",")):
        model = hexiseq.Model(layers=1, hidden=H * D, heads=H, kv_heads=HKV, head_dim=D, ffn=4 * H * D, vocab=1000,
                              dtype_bytes=4)
        cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": world, "intra_gbps": 300}]})
        plan = hexiseq.plan(cluster, model=model, seq_len=S, strategy="ring")
        attn = HexiSeqAttention(plan)
        g = torch.Generator().manual_seed(S)
        q, do = (torch.randn(1, S, H, D, generator=g) for _ in range(2))
        k, v = (torch.randn(1, S, HKV, D, generator=g) for _ in range(2))
        # hexiseq: [1, s, heads, D] shards of the plan; torch: [1, heads, s, D] head-tail shards, K/V expanded
        ql, kl, vl = (plan.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
        dol = plan.shard(do, 1, rank)
        qt, dot = (head_tail(t.transpose(1, 2), 2, rank, world).contiguous() for t in (q, do))
        kt, vt = (head_tail(t.repeat_interleave(H // HKV, 2).transpose(1, 2), 2, rank, world).contiguous()
                  for t in (k, v))

        def ours():
            for t in (ql, kl, vl):
                t.grad = None
            o = attn(ql, kl, vl)
            o.backward(dol)
            return o

        times = {"hexiseq": [], "torch": []}
        for i in range(args.reps + 1):
            for name, fn in (("hexiseq", ours), ("torch", lambda: run_torch(qt, kt, vt, dot))):
                t = slowest_rank_s(fn)
                if i:
                    times[name].append(t)
        row = {"S": S, "hexiseq_s": statistics.median(times["hexiseq"]), "torch_s": statistics.median(times["torch"])}
        if n == 0:  # accuracy against float64 of the whole sequence, gathered on every rank
            from reference import attention

            qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
            ref, _ = attention(qr, kr, vr, causal=True, scale=D ** -0.5)
            ref.backward(do.double())
            o = ours()
            ot, dq, dk, dv = run_torch(qt, kt, vt, dot)
            # torch's dK/dV are per expanded head: summed back onto each kv head
            dk = dk.reshape(1, HKV, H // HKV, -1, D).sum(2)
            dv = dv.reshape(1, HKV, H // HKV, -1, D).sum(2)
            mine = lambda t: head_tail(t.transpose(1, 2), 2, rank, world)  # noqa: E731
            row["hexiseq_err"] = max(rel(o, plan.shard(ref, 1, rank)), rel(ql.grad, plan.shard(qr.grad, 1, rank)),
                                     rel(kl.grad, plan.shard(kr.grad, 1, rank)),
                                     rel(vl.grad, plan.shard(vr.grad, 1, rank)))
            row["torch_err"] = max(rel(ot, mine(ref)), rel(dq, mine(qr.grad)), rel(dk, mine(kr.grad)),
                                   rel(dv, mine(vr.grad)))
            errs = [None] * world
            dist.all_gather_object(errs, (row["hexiseq_err"], row["torch_err"]))
            row["hexiseq_err"], row["torch_err"] = (max(e[i] for e in errs) for i in range(2))
        attn.context.close()
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        import json
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def blocks(lengths, reps=3):
    """One block forward and backward in one process, one thread: the hexiseq CPU kernels against torch's CPU flash
    op (K/V expanded for it), causal and full; best of `reps` (measured)."""
    from hexiseq import ops

    torch.set_num_threads(1)
    lines = ["| tokens | causal | hexiseq fwd (ms) | hexiseq bwd (ms) | torch fwd (ms) | torch bwd (ms) | torch / hexiseq "
             "fwd | bwd |", "|---:|---|---:|---:|---:|---:|---:|---:|"]

    def best(fn):
        fn()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out) * 1e3
    for S in lengths:
        for causal in (True, False):
            q, do = torch.randn(1, S, H, D), torch.randn(1, S, H, D)
            k, v = torch.randn(1, S, HKV, D), torch.randn(1, S, HKV, D)
            o, lse = ops.attention_forward(q, k, v, causal=causal)
            hf = best(lambda: ops.attention_forward(q, k, v, causal=causal))
            hb = best(lambda: ops.attention_backward(q, k, v, o, lse, do, causal=causal))
            qt = q.transpose(1, 2)
            kt, vt = (t.repeat_interleave(H // HKV, 2).transpose(1, 2) for t in (k, v))
            aten = torch.ops.aten
            r = aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=D ** -0.5)
            tf = best(lambda: aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal,
                                                                               scale=D ** -0.5))
            tb = best(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do.transpose(1, 2), qt, kt, vt, r[0], r[1], 0.0, causal, scale=D ** -0.5))
            lines.append(f"| {S} | {causal} | {hf:.1f} | {hb:.1f} | {tf:.1f} | {tb:.1f} | {tf / hf:.2f} | "
                         f"{tb / hb:.2f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", default="1024,2048,4096",
                    help="lengths of the one-process block comparison printed after the ring's (empty: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))
    tmp = tempfile.mkdtemp()
    out_path = os.path.join(tmp, "rows.json")
    t0 = time.time()
    mp.spawn(worker, args=(2, "file://" + os.path.join(tmp, "store"), args, out_path), nprocs=2)
    import json
    with open(out_path) as f:
        rows = json.load(f)
    lines = ["# HexiSeq's ring against torch's ring context parallelism, CPU", "",
             f"Machine: {machine()}. Two Gloo processes, one thread each. Command: `python "
             f"benchmarks/vs_torch_ring_cpu.py --seqs {args.seqs} --reps {args.reps}` ({time.time() - t0:.0f} s).", "",
             f"{H} query heads, {HKV} kv heads, head dim {D}, fp32, causal, batch 1; forward and backward of each "
             "rank's half, slowest rank, median of the repetitions, both sides alternating in one run (measured). "
             "torch: its ring attention (the functions context_parallel() patches SDPA with) over its CPU flash op, "
             "K/V expanded to the query heads; hexiseq: HexiSeqAttention on the 2-device ring plan, GQA native.", "",
             "| tokens | hexiseq (ms) | torch ring CP (ms) | torch / hexiseq |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['hexiseq_s'] * 1e3:.1f} | {r['torch_s'] * 1e3:.1f} | "
                     f"{r['torch_s'] / r['hexiseq_s']:.2f}x |")
    first = rows[0]
    lines += ["", f"Accuracy at {first['S']} tokens, largest error of the output and the three gradients relative to "
                  f"the largest float64 value: hexiseq {first['hexiseq_err']:.2e}, torch {first['torch_err']:.2e}.", ""]
    if args.blocks:
        lines += ["One block in one process, one thread, the same shapes (best of 3, measured):", ""]
        lines += blocks([int(x) for x in args.blocks.split(",")])
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
