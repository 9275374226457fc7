"""The rank side of tests/test_group_attention.py (imported by spawned children, so it lives in a module)."""

import datetime
import traceback

import torch
import torch.distributed as dist

from reference import attention

H, HKV, D = 6, 2, 8


def _positions(rank, world, chunking, tokens):
    """The positions a rank holds under the plan-free call's conventions."""
    if chunking == "contiguous":
        lo = sum(tokens[:rank])
        return torch.arange(lo, lo + tokens[rank])
    S = sum(tokens)
    c = S // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                          (2 * world - rank) * c)])


def group_attention_cases(rank, world, init, results):
    """Forward and backward of hexiseq.group.group_attention in float64 against one process, per case; then a rank
    with a bad argument; then a good call (the ranks stayed in step). Reports per case the largest relative error
    of out, dq, dk, dv, and per refusal what this rank raised."""
    try:
        torch.set_num_threads(1)
        from hexiseq.group import GroupAttention, group_attention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        # the variant case: a sliding window of 21 tokens back, soft-capping and trained sink logits (Mistral,
        # Gemma 2 and gpt-oss layers), with documents and head parallelism
        variant = {"window": (20, 0), "softcap": 5.0}
        cases = [("contiguous-unequal", "contiguous", [40, 25, 32], 1, None, None),
                 ("zigzag", "zigzag", [32, 32, 32], 1, None, None),
                 ("documents", "contiguous", [30, 37, 30], 1, [0, 30, 31, 70, 97], None),
                 ("ulysses-3", "contiguous", [33, 31, 33], 3, None, None),
                 ("zigzag-documents", "zigzag", [32, 32, 32], 1, [0, 50, 96], None),
                 ("variants", "contiguous", [30, 37, 30], 3, [0, 60, 97], variant)]
        report, lse_report = {}, {}
        for name, chunking, tokens, ulysses, cu, var in cases:
            S = sum(tokens)
            g = torch.Generator().manual_seed(S + len(name))
            q, do = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(1, S, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
            sinks = sinks_ref = None
            if var is not None:
                sinks = torch.linspace(-1.0, 1.0, H, dtype=torch.float64).requires_grad_()
                sinks_ref = sinks.detach().clone().requires_grad_()
            pos = _positions(rank, world, chunking, tokens)
            ql, kl, vl = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
            module = GroupAttention(chunking=chunking, ulysses=ulysses, **(var or {}))
            out = module(ql, kl, vl, cu_seqlens=cu, sinks=sinks)
            out.backward(do[:, pos])
            starts = None
            if cu is not None:
                starts = torch.zeros(S, dtype=torch.int64)
                for a, b in zip(cu[:-1], cu[1:]):
                    starts[a:b] = a
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref, ref_lse = attention(qr, kr, vr, causal=True, q_doc=starts, sinks=sinks_ref, **(var or {}))
            ref.backward(do)
            report[name] = [float((a - b[:, pos]).abs().max() / b.abs().max())
                            for a, b in ((out.detach(), ref.detach()), (ql.grad, qr.grad), (kl.grad, kr.grad),
                                         (vl.grad, vr.grad))]
            # the same call returning the log-sum-exp as flash-attn does: [batch, heads, tokens], not differentiable;
            # the output and its gradients as without it
            q2, k2, v2 = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
            out2, lse = group_attention(q2, k2, v2, chunking=chunking, ulysses=ulysses, cu_seqlens=cu,
                                        sinks=None if sinks is None else sinks.detach(), return_lse=True,
                                        **(var or {}))
            out2.backward(do[:, pos])
            lse_report[name] = {"lse": float((lse - ref_lse[:, :, pos]).abs().max() / ref_lse.abs().max()),
                                "shape": list(lse.shape), "grad": lse.requires_grad,
                                "same": max(float((a - b).abs().max()) for a, b in
                                            ((out2, out), (q2.grad, ql.grad), (k2.grad, kl.grad), (v2.grad, vl.grad)))}
            if sinks is not None:  # this rank's part of the sinks' gradient, summed over the ranks
                grad = sinks.grad.clone()
                dist.all_reduce(grad)
                report[name].append(float((grad - sinks_ref.grad).abs().max() / sinks_ref.grad.abs().max()))
        refusals = {}
        q = torch.randn(1, 10, H, D, dtype=torch.float64)
        k = torch.randn(1, 10, HKV, D, dtype=torch.float64)
        for name, kw in (("chunking", {"chunking": "spiral" if rank == 1 else "contiguous"}),
                         ("ulysses", {"ulysses": 2}),
                         ("heads", {"chunking": "contiguous"})):
            kk = k if name != "heads" or rank != 2 else torch.randn(1, 10, 4, D, dtype=torch.float64)
            try:
                group_attention(q, kk, kk, **kw)
                refusals[name] = ("ok", "")
            except Exception as e:  # noqa: BLE001
                refusals[name] = (type(e).__name__, str(e))
        out = group_attention(q, k, k)
        refusals["good_after"] = ("ok", list(out.shape))
        for name, kw in (("scale_one_rank", {"softmax_scale": 0.5 if rank == 1 else None}),
                         ("scale_negative", {"softmax_scale": -1.0 if rank == 2 else None})):
            try:  # after a good call: the context of the default scale exists, the other rank's does not
                group_attention(q, k, k, **kw)
                refusals[name] = ("ok", "")
            except Exception as e:  # noqa: BLE001
                refusals[name] = (type(e).__name__, str(e))
        try:  # a return_lse that is not a bool, on one rank
            group_attention(q, k, k, return_lse="yes" if rank == 2 else False)
            refusals["return_lse_text"] = ("ok", "")
        except Exception as e:  # noqa: BLE001
            refusals["return_lse_text"] = (type(e).__name__, str(e))
        try:  # ranks that disagree about return_lse: the same error on every rank
            group_attention(q, k, k, return_lse=rank == 0)
            refusals["return_lse"] = ("ok", "")
        except Exception as e:  # noqa: BLE001
            refusals["return_lse"] = (type(e).__name__, str(e))
        results.put((rank, "ok", {"cases": report, "refusals": refusals, "lse": lse_report}, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def hf_under_sequence_parallel(rank, world, init, results):
    """A transformers Llama (sdpa) run inside hexiseq.group.sequence_parallel, unpatched: each rank its shard, the
    global loss and the summed gradients against the same model on the whole sequence in one process (float64),
    for zigzag and contiguous shards; and a sequence shorter than the group, which would leave a rank an empty
    shard (no transformers model runs one), refused when sharded (report["short"]: the error's message)."""
    try:
        torch.set_num_threads(1)
        import torch.nn.functional as F

        import hf_worker
        from hexiseq import InvalidArgumentError
        from hexiseq.group import sequence_parallel

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        report = {}
        for chunking, S in (("zigzag", 48), ("contiguous", 47)):
            ref = hf_worker.tiny_model("llama", 4)
            ours = hf_worker.tiny_model("llama", 4)
            ids = torch.randint(97, (1, S), generator=torch.Generator().manual_seed(S))
            labels = torch.full_like(ids, -100)
            labels[0, :-1] = ids[0, 1:]
            F.cross_entropy(ref(input_ids=ids).logits[0], labels[0]).backward()
            with sequence_parallel(chunking=chunking) as sp:
                local = sp.shard(ids)
                pos = sp.positions(S)[None]
                logits = ours(input_ids=local, position_ids=pos, attention_mask=torch.ones_like(local)).logits
                loss = F.cross_entropy(logits[0], sp.shard(labels)[0], ignore_index=-100, reduction="sum") / (S - 1)
                loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            for p in ours.parameters():
                dist.all_reduce(p.grad)
            want = F.cross_entropy(ref(input_ids=ids).logits[0], labels[0]).detach()
            grads = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                        for a, b in zip(ours.parameters(), ref.parameters()))
            report[chunking] = {"loss": abs(float(total - want)) / abs(float(want)), "grads": grads,
                                "restored": F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention}
        try:
            sequence_parallel().shard(ids[:, :world - 1])
            report["short"] = "not refused"
        except InvalidArgumentError as e:
            report["short"] = str(e)
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
