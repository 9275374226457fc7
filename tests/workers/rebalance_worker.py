"""The rank side of tests/test_rebalance.py (imported by spawned children, so it lives in a module)."""

import datetime
import traceback

import torch
import torch.distributed as dist

import dist_worker
from reference import attention


SEQ_LEN = 3000  # the plan's tokens: the Rebalancer moves shares but keeps the length


def inputs(S=SEQ_LEN):
    """q, k, v and the output's gradient of the layer check, the same on every rank and in the test process."""
    H, Hkv, d = 8, 2, 4
    g = torch.Generator().manual_seed(9)
    q, do = (torch.randn(1, S, H, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, S, Hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, do


def reference(S=SEQ_LEN):
    """The one-process float64 reference of the layer check on inputs(S): (out, dq, dk, dv) as NumPy arrays. Every
    plan of every test here has S tokens and the same inputs, so the test computes it once (a causal score matrix of
    3000 x 3000 per head, forward and backward: about 10 s of one core) and hands it to the ranks."""
    q, k, v, do = inputs(S)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = attention(qr, kr, vr, causal=True)
    ref.backward(do)
    return tuple(t.detach().numpy() for t in (ref, qr.grad, kr.grad, vr.grad))


def straggler_rebalance(rank, world, init, structure, replan, expected, results):
    """A ring plan over three equal devices; rank 2 reports twice the attention time of the others (as a throttled
    device would) for two checks: the Rebalancer moves tokens off it, makes no process group, and the layer on the
    new plan is exact against one process (float64; `expected`: reference()'s out, dq, dk, dv of the whole
    sequence). Reports what each step saw."""
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
            plan = hexiseq.plan(cluster, model="llama-tiny", seq_len=SEQ_LEN, strategy="ring")
        else:  # one head-parallel group of the three ranks: its attention work follows the heads, not the tokens
            plan = hexiseq.evaluate(cluster, model="llama-tiny", seq_len=SEQ_LEN, layout={"groups": [
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
        q, k, v, do = inputs(new.seq_len)
        ql, kl, vl = (new.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
        out = attn(ql, kl, vl)
        out.backward(new.shard(do, 1, rank))
        ref, dq, dk, dv = (torch.from_numpy(x) for x in expected)
        assert ref.shape == q.shape, (ref.shape, q.shape)
        # (a rank the new plan parks holds no tokens: nothing to compare there)
        report["errors"] = [float((a - new.shard(b, 1, rank)).abs().max() / b.abs().max()) if a.numel() else 0.0
                            for a, b in ((out.detach(), ref), (ql.grad, dq), (kl.grad, dk), (vl.grad, dv))]
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def rebalancer_refusals(rank, world, init, results):
    """Rebalancers made or checked with settings or measurements that are bad on one rank or differ between ranks:
    per scenario what this rank raised (every rank the same error, at once); then a good one still runs."""
    try:
        import hexiseq
        from hexiseq.nn import HexiSeqAttention
        from hexiseq.rebalance import Rebalancer

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300.0}]})
        attn = HexiSeqAttention(hexiseq.plan(cluster, model="llama-tiny", seq_len=SEQ_LEN, strategy="ring"))
        report = {}
        scenario = dist_worker.scenarios(report)
        scenario("threshold_differs", lambda: Rebalancer(attn, threshold=0.1 if rank == 0 else 0.5))
        scenario("patience_differs", lambda: Rebalancer(attn, patience=1 if rank == 2 else 3))
        scenario("threshold_negative", lambda: Rebalancer(attn, threshold=-1 if rank == 1 else 0.2))
        scenario("threshold_text", lambda: Rebalancer(attn, threshold="0.2" if rank == 2 else 0.2))
        rb = Rebalancer(attn)
        scenario("measured_nan", lambda: rb.check(measured_s=float("nan") if rank == 1 else 1.0))
        scenario("measured_text", lambda: rb.check(measured_s="fast" if rank == 0 else 1.0))
        scenario("good_after", lambda: rb.check(measured_s=1.0))
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
