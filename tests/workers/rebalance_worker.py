"""The rank side of tests/test_rebalance.py (imported by spawned children, so it lives in a module)."""

import datetime
import traceback

import torch
import torch.distributed as dist

from reference import attention


def straggler_rebalance(rank, world, init, structure, replan, results):
    """A ring plan over three equal devices; rank 2 reports twice the attention time of the others (as a throttled
    device would) for two checks: the Rebalancer moves tokens off it, makes no process group, and the layer on the
    new plan is exact against one process (float64). Reports what each step saw."""
    try:
        torch.set_num_threads(1)
        import hexiseq
        from hexiseq.nn import HexiSeqAttention
        from hexiseq.rebalance import Rebalancer
        from torch.distributed import distributed_c10d as c10d

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300.0}]})
        if structure == "ring":
            plan = hexiseq.plan(cluster, model="llama-tiny", seq_len=3000, strategy="ring")
        else:  # one head-parallel group of the three ranks: its attention work follows the heads, not the tokens
            plan = hexiseq.evaluate(cluster, model="llama-tiny", seq_len=3000, layout={"groups": [
                {"devices": [0, 1, 2], "seq": 3000, "tokens": [1000, 1000, 1000], "heads": [3, 3, 2]}]})
        attn = HexiSeqAttention(plan)
        rb = Rebalancer(attn, threshold=0.2, patience=2, replan=replan)
        heads = lambda p: [int(p.devices.head_count[p._slot(r)]) for r in range(world)]  # noqa: E731
        report = {"before": [int(plan.devices.tokens[plan._slot(r)]) for r in range(world)],
                  "heads_before": heads(plan)}
        groups_before = len(c10d._world.pg_map)
        slow = 2.0 if rank == 2 else 1.0
        report["first"] = rb.check(measured_s=slow)
        event = rb.check(measured_s=slow)
        report["groups_made"] = len(c10d._world.pg_map) - groups_before
        report["event"] = None if event is None else (event.before, event.after, event.reason)
        report["same_plan"] = rb.plan.fingerprint
        report["heads_after"] = heads(rb.plan)
        report["structure"] = [len(g["devices"]) for g in rb.plan.layout.to_dict()["groups"]]
        report["owner_updated"] = attn.context is rb.context
        report["quiet"] = rb.check(measured_s=1.0)  # the new plan is made for these speeds: nothing more to do
        # the layer on the new plan, against one process
        new = rb.plan
        S, H, Hkv, d = new.seq_len, 8, 2, 4
        g = torch.Generator().manual_seed(9)
        q, do = (torch.randn(1, S, H, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, S, Hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
        ql, kl, vl = (new.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
        out = attn(ql, kl, vl)
        out.backward(new.shard(do, 1, rank))
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = attention(qr, kr, vr, causal=True)
        ref.backward(do)
        # (a rank the new plan parks holds no tokens: nothing to compare there)
        report["errors"] = [float((a - new.shard(b, 1, rank)).abs().max() / b.abs().max()) if a.numel() else 0.0
                            for a, b in ((out.detach(), ref.detach()), (ql.grad, qr.grad), (kl.grad, kr.grad),
                                         (vl.grad, vr.grad))]
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
