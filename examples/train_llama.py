"""Train a small Llama-style model (RoPE, GQA, RMSNorm, SwiGLU) with HexiSeq attention on an asymmetric plan,
and check that every step's loss equals the single-process run.

Run with 4 CPU processes:

    torchrun --nproc_per_node 4 examples/train_llama.py --steps 5

With --batch, every step is a long-tail batch of sequences instead (the longest --seq-len tokens, 513 by default),
planned over groups of the devices by hexiseq.BatchPlanner and run by hexiseq.nn.BatchContext: each rank runs its
group's packed passes, and rank 0 checks against every document trained on its own:

    torchrun --nproc_per_node 4 examples/train_llama.py --steps 5 --batch

Rank 0 prints how many tokens each rank holds (every step, with --batch), and says which ranks hold none and why.
With --batch at 257 tokens, say, the planner leaves both A100s idle: this model is so small that one pass on an
A100 costs more before its first token (the cost model's fixed per-pass time) than the H100s take for the whole
batch. At 513 every rank gets sequences in every step.

Each rank holds its token shard of one long sequence (the plan decides how many tokens and which heads);
parameters are replicated and their gradients summed across ranks, like data parallelism over the sequence.
Rank 0 also trains an identical model on the whole sequence in one process with plain attention and compares
the losses step by step; the script exits with status 1 if they differ by more than --tolerance.
"""

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hexiseq
from hexiseq.nn import HexiSeqAttention


# ----------------------------------------------------------------------------------------------- model

class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, positions, base=10000.0):
    """Rotary embedding of x [batch, tokens, heads, head_dim] at absolute `positions` [tokens]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]               # [tokens, d/2]
    cos, sin = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def plain_attention(q, k, v):
    """Causal attention over the whole sequence: q [B, S, A, d], k/v [B, S, A_kv, d]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    S = q.shape[1]
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = torch.nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = torch.nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = torch.nn.Linear(heads * self.hd, dim, bias=False)
        self.w_gate = torch.nn.Linear(dim, ffn, bias=False)
        self.w_up = torch.nn.Linear(dim, ffn, bias=False)
        self.w_down = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x, positions, attention):
        B, T, _ = x.shape
        h = self.norm1(x)
        q = rope(self.wq(h).view(B, T, self.heads, self.hd), positions)
        k = rope(self.wk(h).view(B, T, self.kv_heads, self.hd), positions)
        v = self.wv(h).view(B, T, self.kv_heads, self.hd)
        x = x + self.wo(attention(q, k, v).reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TinyLlama(torch.nn.Module):
    def __init__(self, vocab=101, dim=64, layers=2, heads=8, kv_heads=2, ffn=160):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions, attention):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, positions, attention)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------------- plan

def example_plan(seq_len):
    """An asymmetric plan for 4 devices: an HP group of two devices with unequal token shares and head
    counts (5 and 3 query heads, so kv head 1 is split between them), then two single-device groups with
    unequal sequence shares."""
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450},
                                                   {"gpu": "A100-80G", "count": 2, "intra_gbps": 300}],
                                         "inter_node_gbps": 25})
    model = hexiseq.Model(layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=160, vocab=101,
                          gated_mlp=True, name="tiny-llama")
    a = seq_len * 3 // 5
    b = (seq_len - a) * 4 // 7
    c = seq_len - a - b
    groups = [{"devices": [0, 1], "seq": a, "tokens": [a - a // 3, a // 3], "heads": [5, 3]},
              {"devices": [2], "seq": b, "tokens": [b], "heads": [8]},
              {"devices": [3], "seq": c, "tokens": [c], "heads": [8]}]
    return hexiseq.evaluate(cluster, model=model, seq_len=seq_len, layout={"groups": groups})


# ----------------------------------------------------------------------------------------------- training

def batches(steps, seq_len, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, seq_len), generator=g) for _ in range(steps)]


def train_reference(data, dtype, lr, seed):
    torch.manual_seed(seed)
    model = TinyLlama().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in data:
        S = tokens.shape[1]
        logits = model(tokens, torch.arange(S), plain_attention)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_hexiseq(data, plan, rank, dtype, lr, seed):
    torch.manual_seed(seed)
    model = TinyLlama().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    attn = HexiSeqAttention(plan)
    pos = torch.as_tensor(plan.positions(rank))
    losses = []
    for tokens in data:
        S = tokens.shape[1]
        local = tokens[:, pos]
        # next-token labels of my positions; the last position of the sequence has none
        has_label = pos < S - 1
        labels = tokens[:, (pos + 1).clamp(max=S - 1)]
        logits = model(local, pos, attn)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss_sum = (per_token * has_label.to(per_token.dtype)).sum()
        loss = loss_sum / (S - 1)                # this rank's share of the global mean
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():             # every rank's tokens contribute to every parameter
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    attn.context.close()  # release the plan's process groups before the world is torn down
    return losses, model


# ----------------------------------------------------------------------------------------------- a long-tail batch

def long_tail_batches(steps, longest, vocab, seed):
    """Per step, a batch of 7 sequences: one of `longest` tokens and a tail of shorter ones (about half the one
    before each), one of them packed from two documents; with the token ids of each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = [longest]
        for i in range(6):
            n = max(4, int(longest / 2 ** (i + 1) * (0.5 + torch.rand(1, generator=g).item())))
            lengths.append([n // 2, n - n // 2] if i == 2 else n)
        ids = [torch.randint(0, vocab, (sum(L) if isinstance(L, list) else L,), generator=g) for L in lengths]
        out.append((lengths, ids))
    return out


def labelled(lengths):
    """Tokens with a next-token label: all but the last of each document."""
    return sum(n - 1 for L in lengths for n in (L if isinstance(L, list) else [L]))


def train_batch_reference(data, dtype, lr, seed):
    """One process: every document of every sequence run on its own, the batch's mean loss."""
    torch.manual_seed(seed)
    model = TinyLlama().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for lengths, ids in data:
        total = 0.0
        for L, x in zip(lengths, ids):
            at = 0
            for n in (L if isinstance(L, list) else [L]):
                doc = x[at:at + n][None]
                at += n
                logits = model(doc, torch.arange(n), plain_attention)
                total = total + F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
        loss = total / labelled(lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def step_tokens(plan):
    """Tokens each rank runs in a step of a BatchPlan: over its group's passes, its share of each pass's plan (whose
    devices are the group's, renumbered from 0)."""
    tokens = [0] * plan.cluster.num_devices
    for g, devices in enumerate(plan.groups):
        for p in range(len(plan.passes[g])):
            pass_plan = plan.plan_for(g, p)
            for i, d in enumerate(devices):
                tokens[d] += pass_plan.device_row(i)["tokens"]
    return tokens


def why_idle(plan, planner, lengths, idle):
    """Why the planner leaves `idle` ranks out of a step, in its own pricing (BatchPlanner.cost_matrix: a pass on a
    candidate group costs f, plus c for each sequence it holds)."""
    cost, fixed, _ = planner.cost_matrix(lengths)
    slowest = max(plan.group_time_s)
    least = min(fixed[i] + cost[i].min() for i, g in enumerate(planner.groups) if set(g) & set(idle))
    if least > slowest:
        return (f"a pass on any group of them costs at least {least:.3g} s even for the shortest sequence, more than "
                f"the step's slowest group ({slowest:.3g} s) takes: the model is too small for them to help")
    return (f"the planner priced the step faster without them (slowest group {slowest:.3g} s, gradient sync "
            f"{plan.sync_s:.3g} s)")


def train_batch_hexiseq(data, planner, rank, dtype, lr, seed):
    """Each step's batch planned (hexiseq.BatchPlanner) and run (hexiseq.nn.BatchContext): this rank runs its
    group's passes; every rank's gradients are summed, as for one plan."""
    from hexiseq.nn import BatchContext

    torch.manual_seed(seed)
    model = TinyLlama().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    context = BatchContext(planner)
    losses = []
    for lengths, ids in data:
        plan = planner.plan(lengths, exact=False)  # the per-step mode: milliseconds
        step = context.step(plan)
        if rank == 0:
            tokens = step_tokens(plan)
            idle = [r for r, n in enumerate(tokens) if n == 0]
            said = (f"ranks {idle} idle: {why_idle(plan, planner, lengths, idle)}" if idle else
                    "every rank holds tokens")
            print(f"step of {len(lengths)} sequences: groups {[list(g) for g in plan.groups]}, sequences per group "
                  f"{[plan.sequences_of(g) for g in range(len(plan.groups))]}, tokens per rank {tokens}: {said}")
        n = labelled(lengths)
        opt.zero_grad()
        total = torch.zeros((), dtype=dtype)
        for p in step.passes:
            inp = p.inputs(ids)
            logits = model(inp["input_ids"], inp["position_ids"][0], p.attention)
            loss = F.cross_entropy(logits[0], inp["labels"][0], ignore_index=-100, reduction="sum") / n
            loss.backward()
            total += loss.detach()
        for q in model.parameters():             # a rank whose group the plan left idle adds zeros
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            dist.all_reduce(q.grad)
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item())
    context.close()
    return losses, model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens of the sequence (default 257); with --batch, of each step's longest (default 513)")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", action="store_true",
                    help="train on a long-tail batch of sequences per step (the longest --seq-len tokens), each step "
                         "planned over groups of the devices (hexiseq.BatchPlanner) and run by hexiseq.nn.BatchContext")
    args = ap.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 513 if args.batch else 257
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = example_plan(args.seq_len)
    if world != plan.cluster.num_devices:
        if rank == 0:
            print(f"this example's plan needs {plan.cluster.num_devices} processes, got {world}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    rows = [plan.device_row(r) for r in range(world)]
    idle = [r for r, row in enumerate(rows) if row["tokens"] == 0]
    if idle and not args.batch:
        if rank == 0:
            print(f"--seq-len {args.seq_len} leaves ranks {idle} without tokens in this example's layout (the H100 "
                  "group takes 3/5 of the sequence, device 1 a third of that): give 5 or more", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    dtype = getattr(torch, args.dtype)
    if args.batch:
        data = long_tail_batches(args.steps, args.seq_len, 101, args.seed)
        planner = hexiseq.BatchPlanner(plan.cluster, model=plan.model)
        losses, model = train_batch_hexiseq(data, planner, rank, dtype, args.lr, args.seed)
    else:
        data = batches(args.steps, args.seq_len, 101, args.seed)
        if rank == 0:
            print(plan.explain().split("\n\n")[0])
            print(f"tokens per rank {[row['tokens'] for row in rows]}, query heads per rank "
                  f"{[row['head_count'] for row in rows]}: every rank holds tokens")
        losses, model = train_hexiseq(data, plan, rank, dtype, args.lr, args.seed)
    status = 0
    if rank == 0:
        reference = train_batch_reference if args.batch else train_reference
        ref, ref_model = reference(data, dtype, args.lr, args.seed)
        worst = 0.0
        for step, (a, b) in enumerate(zip(losses, ref)):
            diff = abs(a - b) / abs(b)
            worst = max(worst, diff)
            print(f"step {step}: hexiseq {a!r}  single-process {b!r}  relative difference {diff:.2e}")
        ok = worst <= args.tolerance
        print(f"max relative loss difference {worst:.2e} ({'OK' if ok else 'FAIL'}, tolerance {args.tolerance:g})")
        drift = max(((a - b).abs().max() / b.abs().max()).item()
                    for a, b in zip(model.parameters(), ref_model.parameters()))
        print(f"parameters after training: max relative difference to the single-process model {drift:.2e}")
        status = 0 if ok else 1
    flag = torch.tensor([status])
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
