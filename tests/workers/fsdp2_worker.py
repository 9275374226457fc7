"""The rank side of tests/test_fsdp2.py (imported by spawned children, so it lives in a module)."""

import datetime
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import attention

VOCAB, D = 29, 8


class Block(torch.nn.Module):
    def __init__(self, heads, kv_heads, attend):
        super().__init__()
        self.heads, self.kv_heads, self.attend = heads, kv_heads, attend
        hidden = heads * D
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * D, dtype=torch.float64)
        self.o = torch.nn.Linear(heads * D, hidden, dtype=torch.float64)

    def forward(self, x):
        s = x.shape[1]
        q, k, v = self.qkv(x).split([self.heads * D, self.kv_heads * D, self.kv_heads * D], -1)
        a = self.attend(q.view(1, s, self.heads, D), k.view(1, s, self.kv_heads, D), v.view(1, s, self.kv_heads, D))
        return x + self.o(a.reshape(1, s, -1))


class Net(torch.nn.Module):
    def __init__(self, heads, kv_heads, attend):
        super().__init__()
        torch.manual_seed(11)
        self.emb = torch.nn.Embedding(VOCAB, heads * D, dtype=torch.float64)
        self.layers = torch.nn.ModuleList(Block(heads, kv_heads, attend) for _ in range(2))
        self.head = torch.nn.Linear(heads * D, VOCAB, dtype=torch.float64)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def fsdp2_matches_one_process(rank, world, init, plan_json, results):
    """Blocks calling HexiSeqAttention under FSDP2 (fully_shard per block and the root, sum_fsdp2_gradients): the
    full gradients (all-gathered from the shards) against one process on the whole sequence, float64. Also what the
    gradients are without sum_fsdp2_gradients (1/world of them: FSDP2's mean)."""
    try:
        torch.set_num_threads(1)
        import hexiseq
        from hexiseq.nn import HexiSeqAttention
        from hexiseq.states import sum_fsdp2_gradients
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        m = plan.model
        S = plan.seq_len
        ids = torch.randint(VOCAB, (1, S), generator=torch.Generator().manual_seed(3))
        labels = torch.full_like(ids, -100)
        labels[0, :-1] = ids[0, 1:]
        pos = torch.as_tensor(plan.positions(rank))

        ref = Net(m.heads, m.kv_heads, lambda q, k, v: attention(q, k, v, causal=True)[0])
        F.cross_entropy(ref(ids)[0], labels[0], reduction="mean").backward()
        want = {n: p.grad for n, p in ref.named_parameters()}

        attn = HexiSeqAttention(plan)
        mesh = init_device_mesh("cpu", (world,))
        report = {}
        for summed in (True, False):
            net = Net(m.heads, m.kv_heads, attn)
            for blk in net.layers:
                fully_shard(blk, mesh=mesh)
            fully_shard(net, mesh=mesh)
            if summed:
                report["units"] = sum_fsdp2_gradients(net)
            logits = net(ids[:, pos])
            # this rank's tokens' summed loss over the whole sequence's labelled tokens
            loss = F.cross_entropy(logits[0], labels[0, pos], reduction="sum") / (S - 1)
            loss.backward()
            got = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
            report["summed" if summed else "mean"] = max(
                float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
            report["ratio" if not summed else "_"] = float(
                (got["head.weight"] * world - want["head.weight"]).abs().max() / want["head.weight"].abs().max())
        attn.context.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
