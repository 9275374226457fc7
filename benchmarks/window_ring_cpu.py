"""A sliding-window layer on the ring against the same layer on the full causal ring, on CPU, same inputs, same run.

Usage: python benchmarks/window_ring_cpu.py [--world 4] [--seqs 16384,32768] [--window 4096] [--reps 3]
                                            [--out benchmarks/results/window_ring_cpu.md]

`--world` Gloo processes, one thread each, a plan of one device per ring group in contiguous chunks (what a windowed
model wants: with zigzag chunks every group holds positions at both ends of the sequence and meets every other
group's keys); 4 query heads, 1 kv head, head dim 32, fp32, batch 1, forward and backward of one attention layer
through HexiSeqAttention on the hexiseq CPU kernels. Per sequence length: the full causal layer, and the layer with a
window of --window keys (window=(W - 1, 0)): the slowest rank's time (median of --reps after one warm-up, both
alternating) and the bytes each rank sent by P2P in one forward+backward (the ring's K/V blocks and dK/dV
accumulators; counted by the runtime, measured). With a window the ring stops after the steps that meet keys inside
some query's window and the accumulators go home directly; block pairs outside every window are not computed.
Accuracy: the windowed layer's output against float64 attention of the whole sequence with the same window.
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
from _machine import machine  # noqa: E402

H, HKV, D = 4, 1, 32


def make_plan(world, seq, window=None):
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": world, "intra_gbps": 300.0}]})
    model = hexiseq.Model(layers=1, hidden=H * D, heads=H, kv_heads=HKV, head_dim=D, ffn=4 * H * D, vocab=1000,
                          sliding_window=window)
    base = seq // world
    groups = [{"devices": [r], "seq": base + (seq - base * world if r == world - 1 else 0),
               "tokens": [base + (seq - base * world if r == world - 1 else 0)], "heads": [H]} for r in range(world)]
    return hexiseq.evaluate(cluster, model=model, seq_len=seq, layout={"groups": groups, "chunking": "contiguous"})


def worker(rank, world, init, seqs, window, reps, out_q):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=1800))
        from hexiseq.nn import HexiSeqContext, hexiseq_attn_func
        from hexiseq.runtime.variants import variant

        rows = []
        for seq in seqs:
            plan = make_plan(world, seq)
            context = HexiSeqContext(plan)
            g = torch.Generator().manual_seed(seq)
            q, k, v, do = (torch.randn(1, seq, n, D, generator=g) for n in (H, HKV, HKV, H))
            mine = [plan.shard(t, 1, rank) for t in (q, k, v, do)]

            def run(w):
                ql, kl, vl = (t.clone().requires_grad_() for t in mine[:3])
                context.comm.p2p_bytes = 0
                dist.barrier()
                t0 = time.perf_counter()
                o = hexiseq_attn_func(ql, kl, vl, context, window=w)
                o.backward(mine[3])
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                return t.item(), context.comm.p2p_bytes, o.detach()

            wnd = (window - 1, 0)
            run(None), run(wnd)  # warm-up
            times = {"full": [], "window": []}
            sent = {}
            for _ in range(reps):
                for name, w in (("full", None), ("window", wnd)):
                    t, b, o = run(w)
                    times[name].append(t)
                    sent[name] = b
                    if name == "window":
                        out = o
            err = None
            if seq == seqs[0]:
                from hexiseq.ops import attention_forward
                ref, _ = attention_forward(q.double(), k.double(), v.double(), window=wnd)
                err = ((out.double() - plan.shard(ref, 1, rank)).abs().max() / ref.abs().max()).item()
                e = torch.tensor([err])
                dist.all_reduce(e, op=dist.ReduceOp.MAX)
                err = e.item()
            steps = context.topology.ring_steps(True, variant(wnd))
            b = torch.tensor([float(sent["full"]), float(sent["window"])])
            dist.all_reduce(b, op=dist.ReduceOp.MAX)
            rows.append(dict(seq=seq, full=statistics.median(times["full"]), window=statistics.median(times["window"]),
                             full_bytes=b[0].item(), window_bytes=b[1].item(), steps=steps, err=err))
            context.close()
            if rank == 0:
                print(rows[-1], flush=True)
        if rank == 0:
            out_q.put(rows)
        dist.destroy_process_group()
    except Exception:
        import traceback
        out_q.put(traceback.format_exc())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seqs", default="16384,32768")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdzv"
        procs = [ctx.Process(target=worker, args=(r, a.world, init, seqs, a.window, a.reps, q)) for r in range(a.world)]
        for p in procs:
            p.start()
        rows = q.get()
        for p in procs:
            p.join()
    if isinstance(rows, str):
        sys.exit(rows)
    lines = ["# A sliding-window layer on the ring vs the full causal ring (CPU, measured)", "",
             f"{machine()}; {a.world} Gloo processes, one thread each, one device per ring group in contiguous chunks; "
             f"{H} query heads, {HKV} kv head, head dim {D}, fp32, batch 1; one attention layer forward+backward "
             f"through HexiSeqAttention on the hexiseq CPU kernels; window of {a.window} keys. Times: the slowest "
             f"rank, median of {a.reps} after a warm-up, alternating. Bytes: the most any rank sent by P2P in one "
             "forward+backward (counted by the runtime).", "",
             f"Command: `python benchmarks/window_ring_cpu.py --world {a.world} --seqs {a.seqs} --window {a.window} "
             f"--reps {a.reps}`", "",
             "| tokens | ring steps (window / full) | full ring (s) | windowed (s) | time ratio | full ring sent (MB) "
             "| windowed sent (MB) | bytes ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['steps']} / {a.world} | {r['full']:.3f} | {r['window']:.3f} | "
                     f"{r['window'] / r['full']:.3f} | {r['full_bytes'] / 1e6:.1f} | {r['window_bytes'] / 1e6:.1f} | "
                     f"{r['window_bytes'] / max(r['full_bytes'], 1):.3f} |")
    # the cost model's prediction of the same layer (attention + ring phase, the layout above, the catalog's H100:
    # this CPU is not calibrated, so only the ratio compares)
    lines += ["", "Predicted by the cost model for the same layouts (attention + ring phase of the step, catalog "
              "H100s, not calibrated for this CPU: only the ratio compares with the measured one):", "",
              "| tokens | full ring (s) | windowed (s) | predicted ratio | measured time ratio |", "|---|---|---|---|---|"]
    for r in rows:
        full = make_plan(a.world, r["seq"])
        wnd = make_plan(a.world, r["seq"], a.window)
        pf, pw = full.phases["ring_phase_s"], wnd.phases["ring_phase_s"]
        lines.append(f"| {r['seq']} | {pf:.4g} | {pw:.4g} | {pw / pf:.3f} | {r['window'] / r['full']:.3f} |")
    err = rows[0]["err"]
    lines += ["", f"The windowed output at {rows[0]['seq']} tokens against float64 attention of the whole sequence "
              f"with the same window: relative error {err:.2e} (fp32)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
