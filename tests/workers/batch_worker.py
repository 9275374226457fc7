"""The rank side of tests/test_batch_runtime.py (imported by spawned children, so it lives in a module): steps of
BatchPlans, sequences of unequal length on groups of unequal devices, trained with a small attention language model
in float64 and checked against one process that runs every sequence on its own."""

import contextlib
import datetime
import functools
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import attention

VOCAB, HEAD_DIM, MAX_POS = 31, 4, 512


PLANNING = ("plan_strategy", "rebalance", "evaluate", "batch_assign", "memory_tokens_bound")


@contextlib.contextmanager
def planning_refused():
    """The core's planning entry points raise inside: a plan is data, and running a step of it plans nothing."""
    from hexiseq import _core

    saved = {name: getattr(_core, name) for name in PLANNING}

    def planning(*args, **kwargs):
        raise AssertionError("the runtime planned during a step")

    for name in PLANNING:
        setattr(_core, name, planning)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(_core, name, fn)


def planner_for(candidates):
    """The BatchPlanner of the tests: 2 H100 and 2 A100 in two nodes; a model whose attention has 8 query and 2 kv
    heads, sized so that sequences of a few hundred tokens get groups of different sizes; the runtime executes it
    with head dim HEAD_DIM (it takes any head dim)."""
    import hexiseq

    nodes = [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 300.0}, {"gpu": "A100-80G", "count": 2, "intra_gbps": 300.0}]
    cluster = hexiseq.Cluster.from_dict({"nodes": nodes, "inter_node_gbps": 25.0})
    model = hexiseq.Model(layers=2, hidden=4096, heads=8, kv_heads=2, head_dim=512, ffn=16384, vocab=32000)
    return hexiseq.BatchPlanner(cluster, model=model, groups=candidates)


def init_params(heads, kv_heads, seed=7):
    g = torch.Generator().manual_seed(seed)
    hidden = heads * HEAD_DIM

    def w(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5).requires_grad_()
    return {"emb": w(VOCAB, hidden), "pos": w(MAX_POS, hidden), "wq": w(hidden, heads * HEAD_DIM),
            "wk": w(hidden, kv_heads * HEAD_DIM), "wv": w(hidden, kv_heads * HEAD_DIM), "wo": w(heads * HEAD_DIM, hidden)}


def lm_logits(params, ids, pos, attend, heads, kv_heads):
    """[1, s, VOCAB] logits of a one-layer attention LM on ids [1, s] at positions pos [1, s]."""
    x = params["emb"][ids] + params["pos"][pos]
    s = ids.shape[1]
    q = (x @ params["wq"]).view(1, s, heads, HEAD_DIM)
    k = (x @ params["wk"]).view(1, s, kv_heads, HEAD_DIM)
    v = (x @ params["wv"]).view(1, s, kv_heads, HEAD_DIM)
    h = x + attend(q, k, v).reshape(1, s, heads * HEAD_DIM) @ params["wo"]
    return h @ params["emb"].T


def token_losses(params, ids, pos, labels, attend, heads, kv_heads):
    """Per-token cross entropy [tokens] (0 where the label is ignored) of lm_logits."""
    logits = lm_logits(params, ids, pos, attend, heads, kv_heads)
    return F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="none")


def batches(seed, count, sequences):
    """`count` batches of long-tail lengths (a few long, many short: lognormal, 3-460 tokens), some sequences
    packed from several documents, with their token ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = []
        for i in range(sequences):
            n = int(min(460, max(3, torch.empty(1).log_normal_(3.6, 1.1, generator=g).item())))
            if i % 4 == 3 and n >= 8:  # a sequence that is itself packed documents
                cut = 1 + int(torch.randint(n - 2, (1,), generator=g))
                lengths.append([cut, n - cut])
            else:
                lengths.append(n)
        ids = [torch.randint(VOCAB, (sum(L) if isinstance(L, list) else L,), generator=g) for L in lengths]
        out.append((lengths, ids))
    return out


def documents(L, x):
    """The documents of one sequence (L: its length, or its documents' lengths; x: its token ids), each [1, n]."""
    at = 0
    for n in (L if isinstance(L, list) else [L]):
        yield x[at:at + n][None]
        at += n


def reference_loss(logits_of, L, x):
    """One process: the summed next-token loss of every document of one sequence run on its own; logits_of(doc
    [1, n]) -> [1, n, vocab]."""
    return sum(F.cross_entropy(logits_of(d)[0, :-1], d[0, 1:], reduction="sum") for d in documents(L, x))


def sum_gradients(params):
    """The step's gradient: every rank's part, summed (a rank whose group the plan left idle adds zeros)."""
    for t in params:
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        dist.all_reduce(t.grad)


def reference_step(params, lengths, ids, heads, kv_heads, variant=None):
    """One process: every document of every sequence on its own. (loss sum per sequence, labelled tokens).
    variant: the attention's window and softcap (and params["sinks"] its sinks), as train_on_batch_plans takes it."""
    variant = variant or {}

    def logits_of(d):
        return lm_logits(params, d, torch.arange(d.shape[1])[None],
                         lambda q, k, v: attention(q, k, v, causal=True, window=variant.get("window"),
                                                   softcap=variant.get("softcap"), sinks=params.get("sinks"))[0],
                         heads, kv_heads)
    per_seq = [reference_loss(logits_of, L, x) for L, x in zip(lengths, ids)]
    return per_seq, sum(d.shape[1] - 1 for L, x in zip(lengths, ids) for d in documents(L, x))


def train_on_batch_plans(rank, world, init, candidates, steps, results, variant=None):
    """`steps` SGD steps on long-tail batches, each planned by the candidates' BatchPlanner (exact and per-step plans
    in turn) and run by BatchContext with the core's planning refused (planning_refused); beside it, every rank runs the same steps in one process as the reference. Reports, per step, the relative
    errors of the loss, the per-sequence loss sums and the gradients, the groups the plan chose, and at the end the
    largest parameter difference. variant: {"window": (left, right), "softcap": c, "sinks": True} (any of them):
    the attention's variant, sinks a parameter [heads] trained with the others."""
    variant = variant or {}
    try:
        from hexiseq.nn import BatchContext

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        planner = planner_for(candidates)
        heads, kv_heads = planner.model.heads, planner.model.kv_heads
        ctx = BatchContext(planner)
        ours, ref = init_params(heads, kv_heads), init_params(heads, kv_heads)
        if variant.get("sinks"):
            for params in (ours, ref):
                params["sinks"] = torch.linspace(-1.0, 1.5, heads, dtype=torch.float64).requires_grad_()
        report = []
        for i, (lengths, ids) in enumerate(batches(11, steps, 9)):
            plan = planner.plan(lengths, exact=i % 2 == 0)  # exact plans and per-step plans in turn
            with planning_refused():
                step = ctx.step(plan)
                labelled = step.labelled_tokens()
                per_pass = []
                for p in step.passes:
                    with p:
                        inp = p.inputs(ids)
                        attend = functools.partial(p.attention, window=variant.get("window"),
                                                   softcap=variant.get("softcap"), sinks=ours.get("sinks"))
                        tl = token_losses(ours, inp["input_ids"], inp["position_ids"], inp["labels"], attend,
                                          heads, kv_heads)
                        (tl.sum() / labelled).backward()
                        per_pass.append(tl.detach())
                sum_gradients(ours.values())
                seq_sums = step.per_sequence(per_pass)
            loss = seq_sums.sum() / labelled
            ref_seq, ref_labelled = reference_step(ref, lengths, ids, heads, kv_heads, variant)
            ref_loss = sum(ref_seq) / ref_labelled
            ref_loss.backward()
            ref_seq = torch.stack([s.detach() for s in ref_seq])
            grads = max(float((ours[n].grad - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp_min(1e-30))
                        for n in ours)
            report.append({"groups": [list(g) for g in plan.groups], "passes": [len(ps) for ps in plan.passes],
                           "labelled": (labelled, ref_labelled),
                           "loss": abs(float(loss - ref_loss.detach())) / abs(float(ref_loss.detach())),
                           "per_sequence": float((seq_sums - ref_seq).abs().max() / ref_seq.abs().max()),
                           "grads": grads})
            with torch.no_grad():
                for n in ours:
                    ours[n] -= 0.5 * ours[n].grad
                    ref[n] -= 0.5 * ref[n].grad
                    ours[n].grad = None
                    ref[n].grad = None
        params = max(float((ours[n] - ref[n]).abs().max()) for n in ours)
        ctx.close()
        results.put((rank, "ok", {"steps": report, "params": params}, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def batch_refusals(rank, world, init, results):
    """Scenarios in which the ranks hold different BatchPlans, or an invalid one: per scenario what this rank raised,
    then a good step still runs (the ranks stayed in step)."""
    try:
        import hexiseq
        from hexiseq.nn import BatchContext

        import dist_worker

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        planner = planner_for(None)
        ctx = BatchContext(planner)
        report = {}
        run = dist_worker.scenarios(report)
        run("different_plans", lambda: ctx.step(planner.plan([300, 20, 7] if rank == 2 else [300, 20, 8])))
        run("not_a_plan", lambda: ctx.step(planner.plan([30, 7]).to_dict()))
        other = hexiseq.BatchPlanner(planner.cluster, model="gpt-7b")
        run("other_model", lambda: ctx.step(other.plan([300, 20])))
        # a plan of one layout over every device is the one-group, one-pass step (its schedule)
        one = hexiseq.plan(planner.cluster, model=planner.model, training=planner.training, seq_len=300, batch=False)
        run("one_layout", lambda: [(p.sequences, p.tokens, len(one.positions(rank))) for p in ctx.step(one).passes])

        probe = planner.plan([300, 20, 7])
        busy = list(probe.groups[probe.assignment[0]])  # a group with a pass
        bad = busy[-1]
        report["probe"] = ("ok", (bad, busy), 0.0)

        def wrong_values():  # the bad rank gives one value too many
            step = ctx.step(probe)
            step.per_sequence([torch.zeros(p.tokens + (rank == bad)) for p in step.passes])
        run("per_sequence_values", wrong_values)

        def wrong_shape():  # the bad rank feeds one token too many to its pass: its group raises, naming it
            step = ctx.step(probe)
            for p in step.passes:
                n = p.tokens + (rank == bad)
                q = torch.zeros(1, n, 8, HEAD_DIM, dtype=torch.float64)
                kv = torch.zeros(1, n, 2, HEAD_DIM, dtype=torch.float64)
                p.attention(q, kv, kv)
        run("pass_input", wrong_shape)

        def good():
            step = ctx.step(planner.plan([300, 20, 7]))
            return [p.tokens for p in step.passes]
        run("good_after", good)
        run("not_a_planner", lambda: BatchContext(planner.plan([30, 7]) if rank == 1 else planner).close())
        ctx.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def hf_batch_training(rank, world, init, steps, results):
    """A transformers Llama patched with a BatchContext (hexiseq.hf.patch_model(model, context)) trained for `steps`
    AdamW steps on long-tail batches and one of two short sequences (packed into one pass that parks a rank of its
    group: that rank feeds its empty shard), against the same model trained in one process on every document on its
    own (sdpa, float64). Reports per step the relative loss error and whether a pass parked this rank, and, at the
    end, the largest parameter difference."""
    try:
        torch.set_num_threads(1)
        import copy

        import hf_worker
        from hexiseq.hf import patch_model
        from hexiseq.nn import BatchContext

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        planner = planner_for(None)
        ref = hf_worker.tiny_model("llama", 3)
        ours = copy.deepcopy(ref)
        context = BatchContext(planner)
        patch_model(ours, context)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        report = []
        g = torch.Generator().manual_seed(5)
        short = ([9, [2, 2]], [torch.randint(97, (9,), generator=g), torch.randint(97, (4,), generator=g)])
        for lengths, ids in batches(23, steps, 7) + [short]:
            ids = [x % 97 for x in ids]
            plan = planner.plan(lengths)
            step = context.step(plan)
            n = step.labelled_tokens()
            opt_ours.zero_grad()
            total = torch.zeros((), dtype=torch.float64)
            for p in step.passes:
                with p:
                    logits = ours(**p.hf_inputs(ids)).logits
                    loss = F.cross_entropy(logits[0], p.labels(ids)[0], ignore_index=-100, reduction="sum") / n
                    loss.backward()
                    total += loss.detach()
            sum_gradients(ours.parameters())
            dist.all_reduce(total)
            opt_ours.step()
            opt_ref.zero_grad()
            ref_loss = sum(reference_loss(lambda d: ref(input_ids=d).logits, L, x) for L, x in zip(lengths, ids)) / n
            ref_loss.backward()
            opt_ref.step()
            report.append({"groups": [list(g) for g in plan.groups],
                           "loss": abs(float(total) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
                           "parked": any(p.tokens == 0 for p in step.passes)})
        params = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), ref.parameters()))
        context.close()
        results.put((rank, "ok", {"steps": report, "params": params}, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


class _Block(torch.nn.Module):
    def __init__(self, heads, kv_heads, attention):
        super().__init__()
        self.heads, self.kv_heads, self.attention = heads, kv_heads, attention
        h = heads * HEAD_DIM
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv_heads) * HEAD_DIM, dtype=torch.float64)
        self.o = torch.nn.Linear(heads * HEAD_DIM, h, dtype=torch.float64)

    def forward(self, x):
        s = x.shape[1]
        q, k, v = self.qkv(x).split([self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], -1)
        a = self.attention(q.view(1, s, self.heads, HEAD_DIM), k.view(1, s, self.kv_heads, HEAD_DIM),
                           v.view(1, s, self.kv_heads, HEAD_DIM))
        return x + self.o(a.reshape(1, s, self.heads * HEAD_DIM))  # s may be 0: a parked rank


class _Net(torch.nn.Module):
    def __init__(self, heads, kv_heads, attention):
        super().__init__()
        torch.manual_seed(17)
        h = heads * HEAD_DIM
        self.emb = torch.nn.Embedding(VOCAB, h, dtype=torch.float64)
        self.pos = torch.nn.Embedding(MAX_POS, h, dtype=torch.float64)
        self.layers = torch.nn.ModuleList(_Block(heads, kv_heads, attention) for _ in range(2))
        self.head = torch.nn.Linear(h, VOCAB, dtype=torch.float64)

    def forward(self, ids, pos):
        x = self.emb(ids) + self.pos(pos)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def train_beside_reference(context, ours, ref, opt, opt_ref, steps, plan_of, passes_of, loss_scale=1.0,
                           before_step=None):
    """`steps` optimizer steps of `ours` (a _Net with sharded states) on the steps plan_of(lengths) gives, running
    passes_of(step) on this rank, and of `ref` in one process on every document alone; before_step() runs between
    the backward passes and ours' optimizer step. Returns the passes per group of each step."""
    shapes = []
    for lengths, ids in batches(5, steps, 9):
        plan = plan_of(lengths)
        step = context.step(plan)
        n = step.labelled_tokens()
        shapes.append([len(ps) for ps in plan.passes])
        opt.zero_grad()
        for p in passes_of(step):
            with p:
                inp = p.inputs(ids)
                logits = ours(inp["input_ids"], inp["position_ids"])
                loss = F.cross_entropy(logits[0], inp["labels"][0], ignore_index=-100, reduction="sum") / n
                (loss * loss_scale).backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt_ref.zero_grad()
        total = sum(reference_loss(lambda d: ref(d, torch.arange(d.shape[1])[None]), L, x)
                    for L, x in zip(lengths, ids))
        (total / n).backward()
        opt_ref.step()
    return shapes


def train_with_sharded_states(rank, world, init, candidates, steps, results):
    """A model whose states hexiseq.states.shard_states shards unevenly over all ranks (reduce="sum"), trained on
    batch plans: every rank runs step.padded_passes() (its group's passes, then empty ones up to the busiest
    group's count), so that the parameter gathers meet on every rank. Against one process on every document alone;
    reports the largest parameter difference after the steps and the passes per group of each step."""
    try:
        torch.set_num_threads(1)
        from hexiseq.nn import BatchAttention, BatchContext
        from hexiseq.states import full_state_dict, shard_states

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        planner = planner_for(candidates)
        heads, kv_heads = planner.model.heads, planner.model.kv_heads
        context = BatchContext(planner)
        ours = _Net(heads, kv_heads, BatchAttention(context))
        ref = _Net(heads, kv_heads, lambda q, k, v: attention(q, k, v, causal=True)[0])
        shard_states(ours, [0.4, 0.3, 0.2, 0.1], reduce="sum")
        opt = torch.optim.SGD(ours.parameters(), lr=0.3)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.3)
        shapes = train_beside_reference(context, ours, ref, opt, opt_ref, steps, planner.plan,
                                        lambda step: step.padded_passes())
        full = full_state_dict(ours)
        diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
        context.close()
        results.put((rank, "ok", {"params": diff, "passes": shapes}, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def both_groups_busy(planner, lengths, groups):
    """A step over `groups` = ((0,), (1, 2, 3)) of the planner's cluster in which both groups work, the first in two
    passes and the second in one (for these short batches the planner itself leaves one group idle: its gradient
    sync across groups outweighs the work): plain data, each pass's layout from a plan of the pass's packed length
    over the group's devices (a sub-cluster of the planner's)."""
    import hashlib

    import hexiseq
    from hexiseq.schedule import Schedule

    whole = planner.cluster.to_dict()
    node_of = [k for k, n in enumerate(whole["nodes"]) for _ in range(n["count"])]

    def sub_cluster(devices):
        nodes = []
        for k, node in enumerate(whole["nodes"]):
            count = sum(node_of[d] == k for d in devices)
            if count:
                nodes.append(dict(node, count=count))
        return hexiseq.Cluster.from_dict(dict(whole, nodes=nodes))

    mine = [i for i in range(len(lengths)) if i % 2 == 0], [i for i in range(len(lengths)) if i % 2 == 1]
    passes = ((tuple(mine[0][::2]), tuple(mine[0][1::2])), (tuple(mine[1]),))
    size = [sum(L) if isinstance(L, list) else L for L in lengths]
    layouts = tuple(tuple(hexiseq.plan(sub_cluster(g), model=planner.model, seq_len=sum(size[i] for i in p),
                                       batch=False).pass_layout for p in ps) for g, ps in zip(groups, passes))
    docs = tuple(tuple(L) if isinstance(L, list) else None for L in lengths)
    text = repr((groups, passes, size, docs, [pl.fingerprint for ls in layouts for pl in ls]))
    return Schedule(planner.cluster.num_devices, True, tuple(tuple(g) for g in groups), passes, tuple(size), docs,
                    layouts, repr((planner.cluster.to_dict(), planner.model.to_dict())),
                    hashlib.sha256(text.encode()).hexdigest())


def train_with_replicated_states(rank, world, init, candidates, steps, tmp, results):
    """A model whose states are held once per group of the steps (shard_states(..., replicas=the groups), unequal
    shares inside the group of three, reduce="mean"), trained with Adam on steps whose groups make different numbers
    of passes (both_groups_busy): every rank runs only its own group's passes (no padding: gathers and reductions
    stay inside the group), then sync_replicas sums the gradients across the groups. Against one process on every
    document alone; reports the largest parameter difference after the steps, the passes per group of each step,
    and the difference after a save_states / load_states round trip into a model sharded over the world."""
    try:
        torch.set_num_threads(1)
        from hexiseq.checkpoint import load_states, save_states
        from hexiseq.nn import BatchAttention, BatchContext
        from hexiseq.states import full_state_dict, shard_states, sync_replicas

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        planner = planner_for(candidates)
        heads, kv_heads = planner.model.heads, planner.model.kv_heads
        context = BatchContext(planner)
        ours = _Net(heads, kv_heads, BatchAttention(context))
        ref = _Net(heads, kv_heads, lambda q, k, v: attention(q, k, v, causal=True)[0])
        shard_states(ours, [1.0, 0.5, 0.3, 0.2], replicas=[list(g) for g in candidates], reduce="mean")
        opt = torch.optim.Adam(ours.parameters(), lr=0.01)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
        # reduce="mean" divides the sum over ranks by the world size: the loss is scaled back up by it
        shapes = train_beside_reference(context, ours, ref, opt, opt_ref, steps,
                                        lambda lengths: both_groups_busy(planner, lengths, candidates),
                                        lambda step: step.passes, loss_scale=world,
                                        before_step=lambda: sync_replicas(ours))
        full = full_state_dict(ours)
        diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
        save_states(ours, tmp, opt)
        blocked = tmp + ".file"  # a path the first group cannot write a checkpoint folder to: every rank raises
        if rank == 0:
            open(blocked, "w").close()
        dist.barrier()
        try:
            save_states(ours, blocked)
            refused = ("ok", "")
        except Exception as e:  # noqa: BLE001
            refused = (type(e).__name__, str(e))
        other = _Net(heads, kv_heads, BatchAttention(context))
        shard_states(other, [0.4, 0.3, 0.2, 0.1])
        load_states(other, tmp)
        loaded = full_state_dict(other)
        round_trip = max(float((loaded[k] - v).abs().max()) for k, v in ref.state_dict().items())
        context.close()
        results.put((rank, "ok", {"params": diff, "passes": shapes, "round_trip": round_trip, "refused": refused},
                     None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
