"""The rank side of tests/test_compile.py (imported by spawned children, so it lives in a module)."""

import datetime
import time
import traceback

import torch
import torch.distributed as dist


def compiled_matches_eager(rank, world, init, plan_json, backend, results):
    """A small attention block with HexiSeqAttention, compiled with fullgraph=True, against the same block in eager,
    forward and backward, without and with packed documents (float64). Reports the largest relative errors of the
    loss and the gradients, and the seconds the first compiled step took."""
    try:
        torch.set_num_threads(1)
        import hexiseq
        from hexiseq.nn import HexiSeqAttention, hexiseq_attn_func

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        plan = hexiseq.Plan.from_json(plan_json)
        m, d = plan.model, 8
        attn = HexiSeqAttention(plan)
        s = int(plan.devices.tokens[plan._slot(rank)])

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                g = torch.Generator().manual_seed(3)
                self.w = torch.nn.Parameter(torch.randn(16, (m.heads + 2 * m.kv_heads) * d, generator=g,
                                                        dtype=torch.float64) / 4)
                self.o = torch.nn.Parameter(torch.randn(m.heads * d, 16, generator=g, dtype=torch.float64) / 4)
                self.sinks = torch.nn.Parameter(torch.randn(m.heads, generator=g, dtype=torch.float64))

            def forward(self, x, documents=None, variant=False):
                q, k, v = (x @ self.w).split([m.heads * d, m.kv_heads * d, m.kv_heads * d], -1)
                q, k, v = q.view(1, s, m.heads, d), k.view(1, s, m.kv_heads, d), v.view(1, s, m.kv_heads, d)
                if variant:  # a sliding window, soft-capping and sink logits (a parameter of the block)
                    a = hexiseq_attn_func(q, k, v, attn.context, documents, window=(5, 0), softcap=2.0,
                                          sinks=self.sinks)
                else:
                    a = attn(q, k, v, documents=documents)
                return torch.tanh(a.reshape(1, s, m.heads * d) @ self.o).square().sum()

        block = Block()
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        x = plan.shard(torch.randn(1, plan.seq_len, 16, generator=torch.Generator().manual_seed(5),
                                   dtype=torch.float64), 1, rank)
        report = {}
        S = plan.seq_len
        for name, docs, variant in (("plain", None, False), ("documents", [S // 3, S - S // 3], False),
                                    ("other-documents", [7, 1, S - 8], False),  # lengths that change between steps
                                    ("window-softcap-sinks", [S // 3, S - S // 3], True)):
            outs = {}
            for mode, fn in (("eager", block), ("compiled", compiled)):
                block.zero_grad()
                t0 = time.monotonic()
                loss = fn(x, docs, variant)
                loss.backward()
                sink_grad = block.sinks.grad.clone() if variant else None
                outs[mode] = (loss.detach(), block.w.grad.clone(), block.o.grad.clone(), sink_grad,
                              time.monotonic() - t0)
            e, c = outs["eager"], outs["compiled"]
            n = 4 if variant else 3
            report[name] = {"errors": [float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
                                       for a, b in zip(c[:n], e[:n])], "compile_s": c[4]}
        # forwards whose backward never runs (an evaluation with gradients on) keep nothing once dropped
        import gc
        for _ in range(3):
            compiled(x, None, False)
        gc.collect()
        report["kept_after_forwards"] = len(attn.context._op_saved)
        attn.context.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
