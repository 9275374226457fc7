"""The rank side of tests/test_states.py (imported by spawned children, so it lives in a module): uneven
sharding of model states against a single-process reference, its memory behaviour, and its contract."""

import datetime
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dist_worker

VOCAB, DIM, HIDDEN, LAYERS, TOKENS = 23, 13, 29, 3, 7  # odd sizes: shards cut parameters in the middle


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        if getattr(self, "use_spare", False):  # the spare layer of Net(spare=True), in the steps that use it
            x = x + self.spare(x).sum(-1, keepdim=True)
        return x


class Net(nn.Module):
    """Embedding, a ModuleList of blocks, a norm and a head; `ckpt`: None, "plain" (non-reentrant) or
    "reentrant" checkpointing around each block; `tied`: the head shares the embedding's weight; `twice`: the
    first block runs twice in every forward; `spare`: every
    block holds a layer its forward never uses (no gradient reaches it)."""

    def __init__(self, dim=DIM, tied=False, ckpt=None, spare=False, twice=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, HIDDEN) for _ in range(LAYERS))
        if spare:
            for b in self.blocks:
                b.spare = nn.Linear(dim, 3)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.ckpt, self.twice = ckpt, twice  # twice: the first block runs twice (weights shared across depth)
        self.mid = None  # called on the activation after the second block (a test's hook), when set

    def forward(self, idx):
        x = self.embed(idx)
        for i, b in enumerate(self.blocks):
            if self.ckpt is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
            if i == 0 and self.twice:
                x = b(x)
            if i == 1 and self.mid is not None:
                self.mid(x)
        return self.head(self.norm(x))


def make_net(seed=0, **kw):
    torch.manual_seed(seed)
    net = Net(**kw).double()
    with torch.no_grad():  # LayerNorm starts at ones and zeros: perturb it so its gradients are exercised
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
    return net


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, TOKENS), generator=g), torch.randint(0, VOCAB, (2, TOKENS), generator=g)


def loss_of(net, idx, target):
    return F.cross_entropy(net(idx).reshape(-1, VOCAB), target.reshape(-1))


def max_diff(a, b):
    assert list(a) == list(b), (list(a), list(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_scenario(rank, world, shares, reduce="mean", ckpt=None, tied=False, fallback=False, steps=3, spare=False,
                   engine="auto", expect="hexiseq", clip=None, twice=False):
    """`steps` Adam steps sharded, each rank on its own batch, against the reference on all the batches; the
    largest difference of the full parameters over the steps, and the state dicts' keys and shapes agreement."""
    import hexiseq

    ref = make_net(tied=tied, spare=spare, twice=twice)
    net = hexiseq.shard_states(make_net(tied=tied, ckpt=ckpt, spare=spare, twice=twice), shares, reduce=reduce,
                               engine=engine)
    if net._hexiseq_states.engine != expect:
        raise AssertionError(f"sharded by {net._hexiseq_states.engine}, expected {expect}")
    if fallback:  # the all-gather-list and all-reduce paths of backends without the single-tensor collectives
        rec = net._hexiseq_states
        rec.comm.single_gather = rec.comm.single_reduce = False
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    worst = max_diff(hexiseq.full_state_dict(net), ref.state_dict())
    for step in range(steps):
        opt.zero_grad()
        loss_of(net, *batch(step, rank)).backward()
        if clip is not None:  # the whole gradient's norm, alike on every rank and in the reference
            norm = hexiseq.states.clip_grad_norm_(net, clip[0], norm_type=clip[1])
        opt.step()
        ref_opt.zero_grad()
        for r in range(world):
            loss_of(ref, *batch(step, r)).backward()
        if reduce == "mean":
            for p in ref.parameters():
                if p.grad is not None:
                    p.grad /= world
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip[0], norm_type=clip[1])
            worst = max(worst, abs(float(norm) - float(ref_norm)))
            if float(ref_norm) <= clip[0]:
                raise AssertionError(f"the norm {float(ref_norm)} is not clipped at {clip[0]}: a test of nothing")
        ref_opt.step()
        worst = max(worst, max_diff(hexiseq.full_state_dict(net), ref.state_dict()))
    return worst


class Boom(Exception):
    pass


def recover_scenario(rank, world):
    """A backward that raises halfway (a hook on the second block's output, on every rank: a NaN check, say),
    caught; then two steps as usual: the parameters as the reference's that took only those two."""
    import hexiseq

    ref = make_net()
    net = hexiseq.shard_states(make_net(), [0.5, 0.3, 0.2])
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    net.mid = lambda x: x.register_hook(lambda g: (_ for _ in ()).throw(Boom("a check in the backward")))
    loss = loss_of(net, *batch(0, rank))
    net.mid = None
    try:
        loss.backward()
        raise AssertionError("the hook did not raise")
    except Boom:
        pass
    worst = 0.0
    for step in (1, 2):
        opt.zero_grad()
        loss_of(net, *batch(step, rank)).backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(world):
            (loss_of(ref, *batch(step, r)) / world).backward()
        ref_opt.step()
        worst = max(worst, max_diff(hexiseq.full_state_dict(net), ref.state_dict()))
    return worst


def eval_first_scenario(rank, world):
    """FSDP2 (even shares): a forward under no_grad before anything else, then the optimizer: every parameter it
    gets is a DTensor, and the full state dict is the model's."""
    import hexiseq

    net = hexiseq.shard_states(make_net(), [1 / 3] * 3)
    with torch.no_grad():
        net(batch(0, rank)[0])
    kinds = sorted({type(p).__name__ for p in net.parameters()})
    return max_diff(hexiseq.full_state_dict(net), make_net().state_dict()), kinds


def memory_scenario(rank, world, free_after_forward=True):
    """Gathered flat vectors alive after the forward (before the backward), gathers made by the forward and by
    the backward, with the saved-tensor hooks on or off, in a second step (the first teaches the order of the
    units, so in the second every gather but the first of each pass was posted ahead: counted too)."""
    import hexiseq
    from hexiseq import states

    net = hexiseq.shard_states(make_net(), [0.5, 0.3, 0.2])
    comm = net._hexiseq_states.comm
    states._free_after_forward = free_after_forward
    loss_of(net, *batch(1, rank)).backward()
    taken, dropped = comm.taken, comm.dropped
    calls = []
    original = states._Unit.gather

    def counting(unit, **kw):
        calls.append(unit.index)
        return original(unit, **kw)

    states._Unit.gather = counting
    states._free_after_forward = free_after_forward
    try:
        loss = loss_of(net, *batch(0, rank))
        alive = len(states._gathered)
        forward = len(calls)
        forward_ahead = comm.taken - taken
        loss.backward()
        backward = len(calls) - forward
        del loss
        after = len(states._gathered)
    finally:
        states._Unit.gather = original
        states._free_after_forward = True
    return {"alive_after_forward": alive, "forward_gathers": forward, "backward_gathers": backward,
            "alive_after_backward": after, "units": len(net._hexiseq_states.units),
            "forward_ahead": forward_ahead, "backward_ahead": comm.taken - taken - forward_ahead,
            "dropped": comm.dropped - dropped}


def optimizer_scenario(rank, world, shares):
    """Elements of this rank's Adam state (exp_avg and exp_avg_sq) after one step, this rank's shard elements,
    and the units' sizes."""
    import hexiseq

    net = hexiseq.shard_states(make_net(), shares)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    loss_of(net, *batch(0, rank)).backward()
    opt.step()
    state = sum(s[k].numel() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    mine = sum(p.numel() for p in net.parameters())
    totals = [u.total for u in net._hexiseq_states.units]
    return {"state": state, "shard": mine, "totals": totals}


def roundtrip_scenario(rank, world, shares=(0.6, 0.0, 0.4)):
    """Load a full state dict into a sharded model and read it back; names and shapes as the plain model's."""
    import hexiseq

    plain = make_net(seed=7, tied=True)
    net = hexiseq.shard_states(make_net(seed=0, tied=True), list(shares))
    hexiseq.load_full_state_dict(net, plain.state_dict())
    back = hexiseq.full_state_dict(net, device="cpu")
    same_shapes = all(back[k].shape == v.shape for k, v in plain.state_dict().items())
    return max_diff(back, plain.state_dict()), same_shapes, [n for n, _ in net.named_parameters()]


class InPlace(nn.Module):
    """Changes in place a tensor that autograd saved."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        y = self.lin(x)
        z = y.sin()  # saves y
        y.add_(1)
        return z


def misuse_scenario(rank, world, what):
    """Changes between a forward and its backward that autograd must refuse: "activation" changes a saved
    activation inside a unit (where our saved-tensor hooks replace autograd's own check), "shard" changes the
    shards (as an optimizer step would)."""
    import hexiseq

    net = make_net()
    net.blocks.append(InPlace().double())
    hexiseq.shard_states(net, [0.5, 0.3, 0.2])
    if what == "activation":
        out = net.blocks[LAYERS](torch.randn(2, DIM, dtype=torch.float64, requires_grad=True))
    else:
        out = loss_of(net, *batch(0, rank))
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(1.0)
    out.sum().backward()


def run_all(rank, world, init, results):
    try:
        import hexiseq

        torch.set_num_threads(1)  # three ranks on a small shared machine: no intra-op threads fighting for it
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        report = {}

        scenario = dist_worker.scenarios(report)

        good = [0.5, 0.3, 0.2]
        # the contract first: the ranks must still be in step for everything after it
        scenario("wrong_length", lambda: hexiseq.shard_states(make_net(), [0.5, 0.5]))
        scenario("negative", lambda: hexiseq.shard_states(make_net(), [0.5, 0.6, -0.1] if rank == 1 else good))
        scenario("sum", lambda: hexiseq.shard_states(make_net(), [0.5, 0.3, 0.3]))
        scenario("nan", lambda: hexiseq.shard_states(make_net(), [float("nan"), 0.5, 0.5] if rank == 2 else good))
        scenario("reduce", lambda: hexiseq.shard_states(make_net(), good, reduce="max" if rank == 0 else "mean"))
        scenario("mismatch", lambda: hexiseq.shard_states(make_net(), [0.4, 0.4, 0.2] if rank == 2 else good))
        scenario("units", lambda: hexiseq.shard_states(make_net(dim=DIM + 1 if rank == 1 else DIM), good))

        def tied_across():  # the head's weight is the embedding's, which stays in the root unit
            net = make_net(tied=True)
            hexiseq.shard_states(net, good, units=[net.head])

        scenario("tied_across", tied_across)
        # replicas: not a partition of the ranks, shares that do not sum to 1 within one, ranks that disagree
        scenario("replicas_overlap", lambda: hexiseq.shard_states(make_net(), "even", replicas=[[0, 1], [1, 2]]))
        scenario("replicas_missing", lambda: hexiseq.shard_states(make_net(), "even", replicas=[[0], [1]]))
        scenario("replicas_sum", lambda: hexiseq.shard_states(make_net(), [1.0, 0.5, 0.4], replicas=[[0], [1, 2]]))
        scenario("replicas_mismatch", lambda: hexiseq.shard_states(
            make_net(), "even", replicas=[[0, 1], [2]] if rank == 2 else [[0], [1, 2]]))
        scenario("replicas_fsdp2", lambda: hexiseq.shard_states(make_net(), "even", replicas=[[0], [1, 2]],
                                                                engine="fsdp2"))
        # weights that differ between the ranks: a different seed on every rank, or one rank loading another
        # checkpoint (each rank would keep its slice of its own weights: a silent mix)
        scenario("seeds", lambda: hexiseq.shard_states(make_net(seed=rank), good))

        def load(full, strict=True, shares=good):
            net = hexiseq.shard_states(make_net(), shares)
            hexiseq.load_full_state_dict(net, full, strict=strict)
            return max_diff(hexiseq.full_state_dict(net), make_net(seed=5).state_dict())

        scenario("load_seeds", lambda: load(make_net(seed=6 if rank == 1 else 5).state_dict()))
        scenario("load_missing", lambda: load({k: v for k, v in make_net(seed=5).state_dict().items()
                                               if rank != 0 or not k.startswith("blocks.1.")}))
        scenario("load_good", lambda: load(make_net(seed=5).state_dict()))
        scenario("plan_object", lambda: plan_scenario())
        even = [1 / 3] * 3  # handed to FSDP2 unless told otherwise
        scenario("fsdp2_uneven", lambda: hexiseq.shard_states(make_net(), good, engine="fsdp2"))
        scenario("engine", lambda: hexiseq.shard_states(make_net(), even, engine="zero3" if rank == 1 else "auto"))
        scenario("engine_mismatch", lambda: hexiseq.shard_states(make_net(), even,
                                                                 engine="hexiseq" if rank == 2 else "auto"))
        scenario("load_good_fsdp2", lambda: load(make_net(seed=5).state_dict(), shares=even))
        scenario("load_missing_fsdp2", lambda: load({k: v for k, v in make_net(seed=5).state_dict().items()
                                                     if rank != 0 or not k.startswith("blocks.1.")}, shares=even))
        scenario("even_fsdp2", lambda: train_scenario(rank, world, even, expect="fsdp2"))
        scenario("even_fsdp2_sum", lambda: train_scenario(rank, world, even, reduce="sum", ckpt="plain", tied=True,
                                                          spare=True, expect="fsdp2"))
        scenario("clip_uneven", lambda: train_scenario(rank, world, good, clip=(0.05, 2.0)))
        scenario("clip_uneven_inf", lambda: train_scenario(rank, world, [0.7, 0.3, 0.0], clip=(0.01, "inf")))
        scenario("clip_even", lambda: train_scenario(rank, world, even, clip=(0.05, 2.0), expect="fsdp2"))
        scenario("twice", lambda: train_scenario(rank, world, good, twice=True))
        scenario("twice_checkpoint", lambda: train_scenario(rank, world, good, twice=True, ckpt="plain"))
        scenario("recover", lambda: recover_scenario(rank, world))
        scenario("eval_first_fsdp2", lambda: eval_first_scenario(rank, world))
        scenario("even_own", lambda: train_scenario(rank, world, even, engine="hexiseq"))
        scenario("roundtrip_fsdp2", lambda: roundtrip_scenario(rank, world, even))

        scenario("uneven", lambda: train_scenario(rank, world, good))
        scenario("zero_share", lambda: train_scenario(rank, world, [0.7, 0.3, 0.0], tied=True))
        scenario("checkpoint", lambda: train_scenario(rank, world, good, ckpt="plain"))
        scenario("checkpoint_reentrant", lambda: train_scenario(rank, world, [0.2, 0.3, 0.5], ckpt="reentrant"))
        scenario("reduce_sum", lambda: train_scenario(rank, world, good, reduce="sum"))
        scenario("unused", lambda: train_scenario(rank, world, good, spare=True))
        scenario("fallback", lambda: train_scenario(rank, world, [0.7, 0.3, 0.0], fallback=True))
        scenario("inplace_activation", lambda: misuse_scenario(rank, world, "activation"))
        scenario("inplace_shard", lambda: misuse_scenario(rank, world, "shard"))
        scenario("memory", lambda: memory_scenario(rank, world))
        scenario("memory_without_hooks", lambda: memory_scenario(rank, world, free_after_forward=False))
        scenario("optimizer", lambda: optimizer_scenario(rank, world, good))
        scenario("optimizer_zero", lambda: optimizer_scenario(rank, world, [0.7, 0.3, 0.0]))
        scenario("roundtrip", lambda: roundtrip_scenario(rank, world))
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def plan_scenario():
    """A real plan with states shared by memory (two H100s and an L40S): the shares shard_states applies are the
    plan's; reports the plan's shares, this rank's shard elements and the model's total."""
    import hexiseq

    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450},
                                                   {"gpu": "L40S", "count": 1, "intra_gbps": 32}],
                                         "inter_node_gbps": 25})
    plan = hexiseq.plan(cluster, model="gpt-3b", seq_len=4096, training=hexiseq.Training(state_shares="memory"))
    total = sum(p.numel() for p in make_net().parameters())
    net = hexiseq.shard_states(make_net(), plan)
    return plan.state_shares.tolist(), sum(p.numel() for p in net.parameters()), total


def _numpy(state):
    """A state dict as NumPy arrays: tensors sent through a queue live in shared memory that dies with the sender."""
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def checkpoint_phase(rank, world, init, phase, shares, path, *rest):
    """DCP checkpoints of sharded states. phase "save": 2 Adam steps (reduce="sum"; rank r on batch(step, r) of
    three ranks' batches), save, then a third step. phase "load": a model of other weights, sharded over this world
    with other shares, loads the checkpoint and takes the same third step, the three batches split over its ranks.
    Reports (rank, "ok", {"at_save": full state at the save, "after": full state after the third step}) from each
    rank, or (rank, "error", traceback). spare: None; "never" (each block holds a layer no step uses: FSDP2 saves
    no optimizer state for it); "late" (used from the second step on: FSDP2 counts its Adam steps apart), before
    the results queue spawn appends."""
    spare, results = rest if len(rest) == 2 else (None, rest[0])
    try:
        import hexiseq
        from hexiseq.checkpoint import load_states, save_states

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        net = hexiseq.shard_states(make_net(seed=0 if phase == "save" else 5, spare=spare is not None), shares,
                                   reduce="sum")
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        # every phase's ranks cover the three batches of a step between them
        mine = [r for r in range(3) if r % world == rank]

        def step(s):  # one forward per rank (every rank must run the units equally often), its batches stacked
            for b in net.blocks:
                b.use_spare = spare == "late" and s >= 1
            opt.zero_grad()
            idx, target = (torch.cat(t) for t in zip(*(batch(s, r) for r in mine)))
            logits = net(idx).reshape(len(mine), -1, VOCAB)
            loss = sum(F.cross_entropy(lg, tg.reshape(-1)) for lg, tg in zip(logits, target.reshape(len(mine), -1)))
            loss.backward()
            opt.step()

        report = {"engine": net._hexiseq_states.engine}
        if phase == "save":
            for s in range(2):
                step(s)
            save_states(net, path, opt)
            report["at_save"] = _numpy(hexiseq.full_state_dict(net))
        else:
            for g in opt.param_groups:
                g["lr"] = 1.0  # the checkpoint's hyper-parameters must come back
            load_states(net, path, opt)
            report["lr"] = opt.param_groups[0]["lr"]
            report["loaded"] = _numpy(hexiseq.full_state_dict(net))
        step(2)
        report["after"] = _numpy(hexiseq.full_state_dict(net))
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def survivors_phase(rank, world, init, machines, results):
    """hexiseq.elastic.survivors on `world` ranks, rank r told it runs on machines[r] = (HEXISEQ_HOST, LOCAL_RANK):
    reports (the devices found, the cluster's nodes) or the error's class and message."""
    try:
        import os

        import hexiseq

        host, local = machines[rank]
        os.environ["HEXISEQ_HOST"] = host
        os.environ["LOCAL_RANK"] = str(local)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        saved = hexiseq.Cluster.from_dict({"nodes": [
            {"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0, "host": "node-a"},
            {"gpu": "L40S", "count": 2, "intra_gbps": 32.0, "host": "node-b"}], "inter_node_gbps": 25.0})
        try:
            cluster, devices = hexiseq.elastic.survivors(saved)
            out = ("ok", devices, [(n.gpu, n.count, n.host) for n in cluster.nodes])
        except hexiseq.errors.HexiseqError as e:
            out = (type(e).__name__, str(e), None)
        results.put((rank,) + out)
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
