"""Calibration: measure the devices and links of the cluster at hand and describe it as a `hexiseq.Cluster`.

`calibrate()` is a collective: every rank of the process group calls it at the same time, as training would run
them, so ranks that share a core, a PCIe switch or a NIC are measured sharing it. It measures, per rank:

- the token-parallel rate on the model's own matmul shapes (q/k/v and output projections, the MLP), forward and
  backward, at a few row counts (a rate curve);
- the attention rate per block length, full blocks and causal-diagonal blocks, at the model's head_dim and GQA
  ratio, with the block kernels the runtime uses for that device and dtype;
- bandwidth (both directions at once, as the ring and the all-to-all use a link) and one-way latency between
  ranks: every pair for worlds up to `all_pairs_up_to` ranks, else one pair per pair of nodes and one pair inside
  each node, the rest filled in from those (the result says which);
- the all-to-all time at the group sizes a plan can use (recorded with the calibration, for reference);
- free memory (CUDA: free device memory; CPU: available memory shared evenly by the host's ranks).

It returns a Cluster, equal on every rank, that carries the measured curves per device (one curve per node when
the node's devices agree within `tolerance`), the measured bandwidth and latency matrices, and a `calibration`
record of what was measured; `out=` writes it as a cluster YAML that `hexiseq plan` reads unchanged.

Rates follow the cost model's convention (docs/cost_model.md): forward-equivalent TFLOP/s, i.e. forward FLOPs
times the passes the model charges for forward + backward, divided by the measured forward + backward seconds.
"""

import datetime
import math
import os
import socket
import statistics
import sys
import time
import warnings
from typing import List, Optional, Sequence

from .. import _core
from ..errors import InvalidArgumentError
from ..planner.cluster import Cluster
from ..planner.model import Model
from .harness import (agree_arguments, broadcast_object, collective_group, device_barrier, llama_layer, load_torch,
                      model_dtype, seconds, seconds_queued, torch_dtype)

__all__ = ["calibrate"]

# Passes the cost model charges per forward (csrc/model/cost_terms.h: GEMM_BWD_FACTOR = 2, ATTN_BWD_FACTOR = 2.5): a measured
# forward + backward time converts to a forward-equivalent rate with these.
_GEMM_PASSES = 3.0
_ATTN_PASSES = 3.5

def cuda_gpu_name(cuda_name: str) -> str:
    """The catalog name of a device as CUDA names it (torch.cuda.get_device_name: "NVIDIA H100 PCIe") when the
    catalog recognises the part (its device names live with it, in csrc/model/catalog.c), else that name without
    "NVIDIA " and with hyphens for spaces."""
    return _core.gpu_from_device_name(cuda_name) or cuda_name.replace("NVIDIA ", "").replace(" ", "-")


def device_name(device) -> str:
    """The catalog name of a torch device when the catalog knows it, else the device's own name ("CPU" for a
    CPU): a measured device needs no catalog entry."""
    torch, _ = load_torch()
    if device.type != "cuda":
        return "CPU"
    return cuda_gpu_name(torch.cuda.get_device_name(device))


# ---------------------------------------------------------------------------------------------- helpers


class _Progress:
    """Progress lines on rank 0: what is being measured and about how long is left."""

    def __init__(self, enabled: bool, total_points: int):
        self.enabled, self.total, self.done, self.t0 = enabled, max(1, total_points), 0, time.perf_counter()

    def stage(self, text: str):
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        left = f", about {elapsed * (self.total - self.done) / self.done:.0f} s left" if self.done else ""
        print(f"hexiseq calibrate: {text} ({elapsed:.0f} s elapsed{left})", file=sys.stderr, flush=True)

    def tick(self, n: int = 1):
        self.done += n


def _sizes(value, name, default) -> List[int]:
    if value is None:
        return list(default)
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{name} must be a list of positive integers, got {value!r}")
    try:
        out = [int(v) for v in value]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a list of positive integers, got {value!r}") from None
    if not out or any(v < 1 for v in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise InvalidArgumentError(f"{name} must be a non-empty increasing list of positive integers, got {value!r}")
    return out


def _free_memory_gib(device, local_ranks: int) -> float:
    torch, _ = load_torch()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free / 2**30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 2**30 / max(1, local_ranks)
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30 / max(1, local_ranks)


# ---------------------------------------------------------------------------------------------- compute rates


def _matmuls(model: Model, rows, device, dtype, g):
    """(step, flops): one forward + backward of the model's four projection and MLP matmuls alone on `rows` tokens,
    and the FLOPs it does."""
    torch, _ = load_torch()
    H, A, K, d, F = model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn
    shapes = ((H, (A + 2 * K) * d), (A * d, H), (H, 2 * F if model.gated_mlp else F), (F, H))
    weights = [(torch.randn(a, b, generator=g, device=device, dtype=dtype) / math.sqrt(a)).requires_grad_()
               for a, b in shapes]
    x = torch.randn(rows, H, generator=g, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(rows, H, generator=g, device=device, dtype=dtype)

    def step():
        o = (x @ weights[0])[:, :A * d] @ weights[1]
        torch.autograd.grad((o @ weights[2])[:, :F] @ weights[3], [x] + weights, dy)

    return step, 2.0 * sum(a * b for a, b in shapes) * rows * _GEMM_PASSES


def _gemm_curve(model: Model, rows_list, device, dtype, iters, warmup, barrier, progress):
    """(rows, TFLOP/s) of the model's four projection and MLP matmuls alone, forward + backward back to back. The
    MLP's activation is left out: the cost model prices it as memory-bound work, and timing it here too counted it
    twice (5% of a Llama layer's matmul time on an H100)."""
    torch, _ = load_torch()
    g = torch.Generator(device=device).manual_seed(1234)
    # a fresh process pays for lazy initialisation (allocator, thread pools, kernels) on its first calls
    first, _ = _matmuls(model, rows_list[0], device, dtype, g)
    for _ in range(2):
        first()
    curve = []
    for rows in rows_list:
        barrier()
        step, flops = _matmuls(model, rows, device, dtype, g)
        curve.append([rows, flops / seconds_queued(step, device, iters, warmup) / 1e12])
        progress.tick()
    return curve


def _host_link_rate(device, nbytes, iters, warmup, barrier):
    """GB/s per direction of the device's host link as offloaded checkpoints use it: asynchronous copies between a
    pinned host buffer and the device, the slower of the two directions, every rank at once (the devices of a node
    offload together and may share a switch). None off CUDA (a CPU rank has no host link)."""
    torch, _ = load_torch()
    barrier()
    if device.type != "cuda":
        return None
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = seconds(lambda: host.copy_(dev, non_blocking=True), device, iters, warmup)
    back = seconds(lambda: dev.copy_(host, non_blocking=True), device, iters, warmup)
    return nbytes / max(out, back) / 1e9


def _mem_bound_rate(model: Model, rows, device, dtype, iters, warmup, barrier, progress):
    """GB/s of the bytes the cost model counts for a layer's memory-bound work (csrc/model/cost_terms.h:
    layer_mem_elems_per_token elements of the dtype per token, 3 passes for forward + backward), read from a whole
    Llama-style layer's token-parallel work on `rows` tokens: measure's layer (two RMS norms, rotary embedding of q
    and k, the MLP's activation, two residual adds, as the Hugging Face code writes them, around the four matmuls)
    with its attention call left out, less its matmuls alone, both forward + backward back to back. Timed on their
    own, the same elementwise functions ran at 0.65x the rate they reach inside the layer (one H100: 524 against
    about 770 GB/s at 16K tokens), so a rate taken that way priced a Llama layer 20% slow. The difference is held
    to at least 2% of the layer's time, so a rate stays finite where the matmuls are nearly all of it."""
    torch, _ = load_torch()
    g = torch.Generator(device=device).manual_seed(99)
    whole = _token_parallel_step(model, rows, device, dtype, g)
    matmuls, _ = _matmuls(model, rows, device, dtype, g)
    barrier()
    t_layer = seconds_queued(whole, device, iters, max(1, warmup))
    t_matmuls = seconds_queued(matmuls, device, iters, max(1, warmup))
    t = max(t_layer - t_matmuls, 0.02 * t_layer)
    progress.tick()
    return _mem_bound_bytes(model, rows, dtype) / t / 1e9


def _token_parallel_step(model: Model, rows, device, dtype, g):
    """One forward + backward of measure's Llama layer (harness.llama_layer) on `rows` tokens with its attention
    call replaced by the identity on q: a layer's token-parallel work, matmuls and memory-bound work together."""
    torch, _ = load_torch()
    layer = llama_layer(model, lambda q, k, v: q, device, dtype, 99)
    x = torch.randn(1, rows, model.hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(1, rows, model.hidden, generator=g, device=device, dtype=dtype)
    params = [x] + list(layer.parameters())

    def step():
        torch.autograd.grad(layer(x), params, dy)

    return step


def _mem_bound_bytes(model: Model, rows, dtype) -> float:
    """The bytes the cost model counts for a layer's memory-bound work on `rows` tokens, forward + backward
    (csrc/model/cost_terms.h: layer_mem_elems_per_token elements of the dtype per token, 3 passes)."""
    H, q, kv, F = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim, model.ffn
    elems = 4.0 * H + 6.0 * H + 2.0 * (q + kv) + (3.0 if model.gated_mlp else 2.0) * F
    return rows * elems * dtype.itemsize * 3.0


def _attention_heads(model: Model, device, heads):
    """Query and kv heads to measure with: the model's by default. Fewer heads measure faster but can read high:
    on a CPU, curves timed with 3 of a model's 12 heads (and without the merge, then) left the model 26-45%
    optimistic about the attention layer, all 12 heads with the merge within 10%
    (benchmarks/results/heterogeneous_cpu.md); on a GPU the kernels' parallelism depends on them."""
    per = model.heads // model.kv_heads
    if heads is not None:
        h = heads if isinstance(heads, int) and not isinstance(heads, bool) else -1
        if h < 1 or h > model.heads or h % per:
            raise InvalidArgumentError(f"attn_heads must be a multiple of {per} (query heads per kv head) in "
                                       f"[{per}, {model.heads}], got {heads!r}")
        return h, h // per
    return model.heads, model.kv_heads


def _document_sizes(sizes):
    """Document lengths the packed-document curve is timed at: the block sizes below the largest, which is the
    block they are packed in (documents as long as the block are one causal block)."""
    return [n for n in sizes if n < max(sizes)]


def _attention_curves(model: Model, sizes, device, dtype, heads, iters, warmup, barrier, progress):
    """(block, TFLOP/s) for full blocks and causal-diagonal blocks, and (document length, TFLOP/s) for documents
    packed in one block of the largest size under the document mask, forward + backward, through the runtime's
    own block kernels (hexiseq.runtime.blocks, chosen exactly as a ring pass chooses them), back to back as a
    layer queues them (synchronised after each call, an 8K causal block read 0.9x its back-to-back rate on an
    H100)."""
    torch, _ = load_torch()
    from ..runtime import blocks, ops

    h, kv = _attention_heads(model, device, heads)
    d = model.head_dim
    scale = 1.0 / math.sqrt(d)
    kern = blocks.kernels_for(device, dtype)
    acc_dt = kern.acc_dtype
    g = torch.Generator(device=device).manual_seed(4321)
    full, diag = [], []
    for n in sizes:
        q = torch.randn(1, n, h, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, n, kv, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(1, n, kv, d, generator=g, device=device, dtype=dtype)
        do = torch.randn_like(q)
        # a full block as the ring sees one (every key before every query), then the block on the diagonal
        for q_pos0, target in ((n, full), (0, diag)):
            barrier()
            o, lse = kern.forward(q, k, v, True, q_pos0, 0, scale)
            o_acc, lse_acc = o.to(acc_dt), lse.to(acc_dt).clone()
            dq = torch.zeros(q.shape, dtype=acc_dt, device=device)
            dk = torch.zeros(k.shape, dtype=acc_dt, device=device)
            dv = torch.zeros(v.shape, dtype=acc_dt, device=device)

            def fwd():
                # a full block and its merge into the fp32 accumulator, as a later ring step runs them; the diagonal
                # block alone: a chunk's own block comes first in the ring and is written, not merged
                o_p, l_p = kern.forward(q, k, v, True, q_pos0, 0, scale)
                if q_pos0:
                    kern.merge(o_acc, lse_acc, o_p, l_p)

            def bwd():
                kern.backward_into(q, k, v, o, lse, do, True, q_pos0, 0, scale, dq, dk, dv)

            t = seconds_queued(lambda f=fwd, b=bwd: (f(), b()), device, iters, warmup)
            pairs = n * n if q_pos0 else n * (n + 1) / 2
            target.append([n, 4.0 * pairs * d * h * _ATTN_PASSES / t / 1e12])
            progress.tick()
    # Packed documents: one block of the largest size holding documents of n tokens (the last one shorter), as a
    # ring step runs a chunk of a packed sequence; the rate counts the pairs the document mask keeps. Short
    # documents run slower per pair than a lone causal block of their length (work per query row spread over few
    # keys, tiles straddling documents): the cost model prices packed pairs at this curve.
    docs = []
    big = max(sizes)
    q = torch.randn(1, big, h, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, big, kv, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(1, big, kv, d, generator=g, device=device, dtype=dtype)
    do = torch.randn_like(q)
    for n in _document_sizes(sizes):
        lengths = [n] * (big // n) + ([big % n] if big % n else [])
        q_doc = torch.from_numpy(ops.document_starts(lengths)).to(device)
        barrier()
        o, lse = kern.forward(q, k, v, True, 0, 0, scale, q_doc)
        o_acc, lse_acc = o.to(acc_dt), lse.to(acc_dt).clone()
        dq = torch.zeros(q.shape, dtype=acc_dt, device=device)
        dk = torch.zeros(k.shape, dtype=acc_dt, device=device)
        dv = torch.zeros(v.shape, dtype=acc_dt, device=device)

        def fwd():
            o_p, l_p = kern.forward(q, k, v, True, 0, 0, scale, q_doc)
            kern.merge(o_acc, lse_acc, o_p, l_p)

        def bwd():
            kern.backward_into(q, k, v, o, lse, do, True, 0, 0, scale, dq, dk, dv, q_doc)

        t = seconds_queued(lambda f=fwd, b=bwd: (f(), b()), device, iters, warmup)
        pairs = sum(m * (m + 1) / 2 for m in lengths)
        docs.append([n, 4.0 * pairs * d * h * _ATTN_PASSES / t / 1e12])
        progress.tick()
    return full, diag, docs, h, kv


def _runtime_sizes(blocks):
    """Tokens per rank the runtime's own work is timed at: the smallest, middle and largest attention block."""
    return sorted({blocks[0], blocks[len(blocks) // 2], blocks[-1]})


def _runtime_ns(curve, x):
    """A runtime curve's nanoseconds at x elements, as the cost model reads it (the core's own reading: linear in
    the elements between points, the nearest point's ns per element outside them)."""
    return _core.curve_at([tuple(p) for p in curve], x, True)


def _non_increasing(curve):
    """A runtime curve with each point no higher than the points at smaller sizes. Work per element does not grow
    with the size (fixed per-call costs spread over more elements), but a rank's rest can take in a wait the
    phases did not catch: on a 2-core machine one such point, 8x its neighbours, was enough to move the plan onto
    a layout that ran 12% slower. The smaller size's figure bounds it."""
    out, low = [], math.inf
    for size, ns in curve:
        low = min(low, ns)
        out.append([size, low])
    return out


def _scaffold(n):
    """n devices whose memory never binds, for timing the runtime's own work (not a cluster anyone has: the catalog's
    warning about a memory figure past the GPU's is not for it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Cluster.from_dict({"nodes": [{"gpu": "H100", "count": n, "intra_gbps": 100.0, "memory_gib": 1e6}]})


def _runtime_curves(model: Model, sizes, dtype, group, world, rank, global_of, iters, warmup, progress):
    """The runtime's work outside the attention kernels and the collectives, as hexiseq.measure's `rest` of an
    attention layer (forward + backward; the waits at the call checks are timed apart, as `sync`), in two curves
    of (elements, ns per element) that the cost model reads the same way (csrc/model/cost_ring.c, hexiseq_runtime_time_s):
    - runtime: the group's side (its tensors, accumulators, bookkeeping), each rank alone in a group of its own
      on one-device layers of n tokens, elements = n * (heads + 2 kv_heads) * head_dim;
    - runtime_a2a: what a member of a larger group adds by handing its tokens to the all-to-all and taking them
      back (packing, unpacking, the collective's copies): the ranks in all-to-all groups of as many as there are
      heads (one group when the heads go round), n tokens each and the heads split as evenly as they go, less the
      group's side read from the first curve, per element of the rank's own tokens * (heads + 2 kv_heads) *
      head_dim. Empty for one rank;
    - runtime_ring: what a member of a ring adds by receiving the other groups' K, V blocks (assembling them, their
      gradients' accumulators): the ranks in one ring of single-rank groups, n tokens and every head each, less
      the group's side, per element of (S - S_g) * 2 kv_heads * head_dim. Empty for one rank.
    Each curve is made non-increasing in size (see _non_increasing)."""
    import dataclasses

    _, dist = load_torch()
    from .measurement import measure
    from ..planner.model import Training
    from ..planner.plan import evaluate
    from ..planner.plan import plan_layout as make_plan

    # only the layouts matter here: a one-layer model (no memory to fit) in the measured dtype's width
    small = dataclasses.replace(model, layers=1, dtype_bytes=dtype.itemsize)
    per = (model.heads + 2 * model.kv_heads) * model.head_dim
    no_checkpointing = Training(checkpointing=False)

    def rest(p, on):
        m = measure(p, group=on, iters=iters, warmup=max(1, warmup), dtype=dtype)
        return m.ranks[dist.get_rank(on)]["measured"]["rest"]

    def ring_of_ranks(n):
        return {"groups": [{"devices": [r], "seq": n, "tokens": [n], "heads": [model.heads]} for r in range(world)]}

    def a2a_groups(n):
        """Consecutive ranks in groups of up to `heads`, n tokens each, heads split as evenly as they go."""
        k, groups = min(world, model.heads), []
        for lo in range(0, world, k):
            size = min(k, world - lo)
            heads = [model.heads // size + (i < model.heads % size) for i in range(size)]
            groups.append({"devices": list(range(lo, lo + size)), "seq": n * size, "tokens": [n] * size,
                           "heads": heads})
        return {"groups": groups}

    alone = None
    for r in range(world):  # every rank takes part in creating every group
        g = dist.new_group(ranks=[global_of(r)])
        if r == rank:
            alone = g
    one = _scaffold(1)
    own_side = []
    try:
        for n in sizes:
            t = rest(make_plan(one, model=small, seq_len=n, training=no_checkpointing), alone)
            # a floor, not 0: a curve's values are positive (the work is there, if below this clock's reach)
            own_side.append([n * per, max(t, 1e-12) / (n * per) * 1e9])
            progress.tick()
    finally:
        dist.destroy_process_group(alone)
    own_side = _non_increasing(own_side)
    a2a_side, ring_side = [], []
    if world > 1:
        alike = _scaffold(world)
        for n in sizes:
            p = evaluate(alike, model=small, seq_len=n * world, layout=a2a_groups(n), training=no_checkpointing)
            t = rest(p, group)
            dev, slot = p.devices, p._slot(rank)
            g = int(dev.group[slot])
            if int(p.layout.group_size[g]) > 1:  # (a rank alone in its group hands nothing to an all-to-all)
                mine = int(p.layout.group_seq[g]) * (int(dev.head_count[slot]) + 2 * int(dev.kv_count[slot]))
                mine *= model.head_dim
                a2a = int(dev.tokens[slot]) * per
                left = t - _runtime_ns(own_side, mine) * 1e-9
                a2a_side.append([a2a, max(left, 1e-12) / a2a * 1e9])
            progress.tick()
        for n in sizes:
            t = rest(evaluate(alike, model=small, seq_len=n * world, layout=ring_of_ranks(n),
                              training=no_checkpointing), group)
            mine, ring = n * per, (world - 1) * n * 2 * model.kv_heads * model.head_dim
            ring_side.append([ring, max(t - _runtime_ns(own_side, mine) * 1e-9, 1e-12) / ring * 1e9])
            progress.tick()
    return own_side, _non_increasing(a2a_side), _non_increasing(ring_side)


# ---------------------------------------------------------------------------------------------- links


def _rounds(pairs):
    """Pairs grouped into rounds where every rank appears at most once (greedy, in order)."""
    left, rounds = list(pairs), []
    while left:
        busy, this, rest = set(), [], []
        for a, b in left:
            if a in busy or b in busy:
                rest.append((a, b))
            else:
                this.append((a, b))
                busy.update((a, b))
        rounds.append(this)
        left = rest
    return rounds


def _link_pairs(world, node_of, all_pairs_up_to):
    """The pairs to measure and what they stand for: every pair, or representatives per pair of nodes."""
    if world <= all_pairs_up_to:
        return [(a, b) for a in range(world) for b in range(a + 1, world)], "every pair"
    first = {}
    members = {}
    for r, n in enumerate(node_of):
        first.setdefault(n, r)
        members.setdefault(n, []).append(r)
    pairs = []
    for n, rs in members.items():
        if len(rs) > 1:
            pairs.append((rs[0], rs[1]))
    nodes = sorted(first)
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            pairs.append((first[a], first[b]))
    return pairs, "one pair inside each node and one per pair of nodes (the first devices); the others copied"


def _measure_pair(rank, peer, device, message_bytes, lat_iters, bw_iters, global_of):
    """One-way latency (s) and receive bandwidth (bytes/s) with peer; both ranks call it at the same time."""
    torch, dist = load_torch()
    lower = rank < peer
    gpeer = global_of(peer)
    small = torch.zeros(1, dtype=torch.float32, device=device)

    def ping():
        if lower:
            dist.send(small, gpeer)
            dist.recv(small, gpeer)
        else:
            dist.recv(small, gpeer)
            dist.send(small, gpeer)

    n = max(1, message_bytes // 4)
    send = torch.ones(n, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def exchange():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, gpeer), dist.P2POp(dist.irecv, recv, gpeer)])
        for r in reqs:
            r.wait()

    latency = seconds(ping, device, lat_iters, 3) / 2
    return latency, n * 4 / seconds(exchange, device, bw_iters, 1)


def _a2a_sizes(world):
    """Group sizes the all-to-all is timed at: every size up to 8 ranks, then powers of two and the world."""
    if world <= 8:
        return list(range(2, world + 1))
    return sorted({2 ** i for i in range(1, world.bit_length())} | {world})


def _all_to_all_times(world, device, message_bytes, iters, group, global_of):
    """Seconds of an all-to-all of message_bytes per peer in the subgroup of the first k ranks, k in
    _a2a_sizes(world)."""
    torch, dist = load_torch()
    rank = dist.get_rank(group)
    out = []
    for k in _a2a_sizes(world):
        ranks = [global_of(r) for r in range(k)]
        pg = dist.new_group(ranks=ranks) if k < world else group
        if rank < k:
            n = max(1, message_bytes // 4)
            send = torch.ones(n * k, dtype=torch.float32, device=device)
            recv = torch.empty_like(send)
            t = seconds(lambda: dist.all_to_all_single(recv, send, group=pg), device, iters, 1)
        else:
            t = None
        if k < world:
            dist.barrier(group=group)
            dist.destroy_process_group(pg)
        out.append((k, t))
    return out


# ---------------------------------------------------------------------------------------------- the cluster


def _median_curve(curves):
    return [[curves[0][i][0], statistics.median(c[i][1] for c in curves)] for i in range(len(curves[0]))]


def _agree(curves, tolerance):
    if any([p[0] for p in c] != [p[0] for p in curves[0]] for c in curves):
        return False  # measured at other sizes (a runtime curve of unequal shares): each keeps its own
    med = _median_curve(curves)
    return all(abs(c[i][1] - med[i][1]) <= tolerance * med[i][1] for c in curves for i in range(len(med)))


def _build_cluster(rows, bw, lat, pairs_note, a2a, meta, tolerance) -> Cluster:
    """The Cluster every rank builds from the gathered measurements (a pure function of them: equal everywhere)."""
    world = len(rows)
    # nodes: maximal runs of consecutive ranks on one host with one device model (devices are numbered node by node)
    nodes, node_of = [], []
    for r, row in enumerate(rows):
        if nodes and nodes[-1]["host"] == row["host"] and nodes[-1]["gpu"] == row["gpu"]:
            nodes[-1]["ranks"].append(r)
        else:
            nodes.append({"host": row["host"], "gpu": row["gpu"], "ranks": [r]})
        node_of.append(len(nodes) - 1)
    node_specs, devices, uniform = [], [None] * world, []
    for i, n in enumerate(nodes):
        rs = n["ranks"]
        intra = [bw[a][b] for a in rs for b in rs if a != b]
        spec = {"gpu": n["gpu"], "count": len(rs), "memory_gib": round(min(rows[r]["memory_gib"] for r in rs), 3),
                "host": n["host"]}  # a job restarted on fewer machines finds its devices by it (hexiseq.elastic)
        if intra:
            spec["intra_gbps"] = round(statistics.median(intra), 3)
        node_specs.append(spec)
        same = all(_agree([rows[r][key] for r in rs], tolerance)
                   for key in ("gemm", "attn", "attn_causal", "attn_document", "runtime", "runtime_a2a",
                               "runtime_ring"))
        if same:
            uniform.append(i)
        for r in rs:
            entry = {}
            for key, name in (("gemm", "gemm_tflops"), ("attn", "attn_tflops"), ("attn_causal", "attn_causal_tflops"),
                              ("attn_document", "attn_document_tflops"), ("runtime", "runtime_ns"),
                              ("runtime_a2a", "runtime_a2a_ns"), ("runtime_ring", "runtime_ring_ns")):
                curve = _median_curve([rows[x][key] for x in rs]) if same else rows[r][key]
                if curve:  # (no packed-document curve from a single block size)
                    entry[name] = [[int(s), float(f"{v:.6g}")] for s, v in curve]  # (6 digits, never 0)
            entry["memory_gib"] = spec["memory_gib"] if same else round(rows[r]["memory_gib"], 3)
            mem_bound = statistics.median(rows[x]["mem_bound_gbps"] for x in rs) if same else rows[r]["mem_bound_gbps"]
            entry["mem_bound_gbps"] = float(f"{mem_bound:.6g}")
            if rows[r].get("host_gbps"):  # CUDA ranks: pinned copies to and from the host
                entry["host_gbps"] = float(f"{rows[r]['host_gbps']:.6g}")
            devices[r] = entry
    spec = {"nodes": node_specs, "devices": devices}
    inter = [bw[a][b] for a in range(world) for b in range(world) if a != b and node_of[a] != node_of[b]]
    if len(nodes) > 1:
        spec["inter_node_gbps"] = round(statistics.median(inter), 3)
    if world > 1:
        spec["bandwidth_gbps"] = [[round(bw[a][b], 3) if a != b else 0.0 for b in range(world)] for a in range(world)]
        spec["latency_us"] = [[round(lat[a][b], 2) if a != b else 0.0 for b in range(world)] for a in range(world)]
    meta = dict(meta)
    meta["links"] = pairs_note if world > 1 else "one device: no links"
    meta["all_to_all"] = [{"ranks": k, "bytes_per_peer": meta["a2a_bytes"], "seconds": round(t, 6)} for k, t in a2a]
    meta.pop("a2a_bytes")
    meta["uniform_nodes"] = uniform
    meta["tolerance"] = tolerance
    spec["calibration"] = meta
    return Cluster.from_dict(spec)


def calibrate(model="llama3-8b", group=None, dtype=None, *, gemm_rows: Optional[Sequence[int]] = None,
              attn_blocks: Optional[Sequence[int]] = None, attn_heads: Optional[int] = None,
              message_bytes: Optional[int] = None, iters: Optional[int] = None, warmup: int = 1,
              all_pairs_up_to: int = 16, tolerance: float = 0.10, out=None, progress: bool = True) -> Cluster:
    """Measure the devices and links of `group` (default: the world) and return the Cluster they make.

    A collective: every rank calls it with the same arguments (under torchrun or any init_process_group; Gloo on
    CPU, NCCL on GPU); they are compared before anything is measured: an invalid argument on any rank raises
    InvalidArgumentError, ranks that pass different ones RankMismatchError naming the argument and each rank's
    value, on every rank alike (`progress` may differ). Rank r becomes cluster device r, so ranks of one host must be consecutive to share a node.

    model: a Model, preset name or Hugging Face config path: its matmul shapes, head_dim and GQA ratio are measured.
    dtype: the training dtype (default: the model's, by its dtype_bytes: 2 bf16, 4 fp32, 8 fp64; what
        hexiseq.measure then defaults to as well, reading it from the cluster's calibration record).
    gemm_rows, attn_blocks: the sizes of the rate curves (defaults suit the device type).
    attn_heads: query heads to time attention with (default: the model's; fewer is quicker, less exact).
    message_bytes: bytes per link measurement (default 64 MiB on CUDA, 4 MiB on CPU).
    iters: timed repetitions per point (default 5 on CUDA, 3 on CPU), after `warmup`.
    out: a path to write the cluster YAML to (rank 0 writes; every rank returns the Cluster).
    progress: print what is being measured and about how long is left (rank 0, stderr)."""
    torch, dist = load_torch()
    error = None
    rows_list = blocks = dt = None
    try:  # every local check first: a rank whose arguments fail still meets the others in the agreement below
        if not isinstance(model, Model):
            model = Model.from_name_or_path(model)
        gemm_rows = _sizes(gemm_rows, "gemm_rows", ())
        attn_blocks = _sizes(attn_blocks, "attn_blocks", ())
        if message_bytes is not None and (not isinstance(message_bytes, int) or message_bytes < 4):
            raise InvalidArgumentError(f"message_bytes must be an int >= 4, got {message_bytes!r}")
        if iters is not None and (not isinstance(iters, int) or iters < 1):
            raise InvalidArgumentError(f"iters must be an int >= 1, got {iters!r}")
        if not isinstance(warmup, int) or warmup < 0:
            raise InvalidArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
        if not isinstance(tolerance, (int, float)) or not (0 <= tolerance < 1):
            raise InvalidArgumentError(f"tolerance must be in [0, 1), got {tolerance!r}")
        if not isinstance(all_pairs_up_to, int) or all_pairs_up_to < 2:
            raise InvalidArgumentError(f"all_pairs_up_to must be an int >= 2, got {all_pairs_up_to!r}")
    except Exception as e:  # noqa: BLE001  (whatever it is, the other ranks must learn of it, not hang)
        error = e
    group = collective_group(group, error, "calibrate ...")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    cuda = device.type == "cuda"
    if error is None:
        try:
            dt = model_dtype(model, device) if dtype is None else torch_dtype(dtype, device)
            rows_list = gemm_rows or [512, 2048, 8192] if cuda else gemm_rows or [64, 256, 1024]
            blocks = attn_blocks or ([256, 1024, 2048, 4096, 8192, 16384, 32768] if cuda else [64, 128, 256, 512, 1024])
            message_bytes = message_bytes or (64 << 20 if cuda else 4 << 20)
            iters = iters or (5 if cuda else 3)
            _attention_heads(model, device, attn_heads)  # checks attn_heads before anything runs
        except Exception as e:  # noqa: BLE001
            error = e
    # Every argument that shapes what is measured, or which collectives run, must be equal on every rank (the
    # defaults resolved: they depend only on the backend, the same on every rank). `progress` is left out: only
    # rank 0 prints, so `progress=(rank == 0)` is a reasonable call; `group` is the group itself.
    agree_arguments(group, error, [
        ("model", model), ("dtype", str(dt)), ("gemm_rows", rows_list), ("attn_blocks", blocks),
        ("attn_heads", attn_heads), ("message_bytes", message_bytes), ("iters", iters), ("warmup", warmup),
        ("all_pairs_up_to", all_pairs_up_to), ("tolerance", tolerance),
        ("out", None if out is None else str(out))])

    def global_of(r):
        return r if group is dist.group.WORLD else dist.get_global_rank(group, r)

    def barrier():
        device_barrier(group, device)

    t_start = time.perf_counter()
    host = socket.gethostname()
    hosts = [None] * world
    dist.all_gather_object(hosts, host, group=group)
    node_of = [0]  # a node: a run of consecutive ranks on one host
    for prev, h in zip(hosts, hosts[1:]):
        node_of.append(node_of[-1] + (h != prev))
    pairs, pairs_note = _link_pairs(world, node_of, all_pairs_up_to)
    rounds = _rounds(pairs)
    a2a_sizes = len(_a2a_sizes(world)) if world > 1 else 0
    prog = _Progress(progress and rank == 0,
                     len(rows_list) + 1 + 2 * len(blocks) + len(_document_sizes(blocks)) +
                     len(_runtime_sizes(blocks)) * (3 if world > 1 else 1) +
                     len(rounds) + a2a_sizes)

    prog.stage(f"{world} rank(s), {device.type}, {str(dt).replace('torch.', '')}: matmul rates on {model.name}'s "
               f"shapes at {', '.join(map(str, rows_list))} rows")
    gemm = _gemm_curve(model, rows_list, device, dt, iters, warmup, barrier, prog)
    prog.stage(f"memory-bound work (norms, residual adds, rotary, activation) at {max(rows_list)} rows")
    mem_bound = _mem_bound_rate(model, max(rows_list), device, dt, iters, warmup, barrier, prog)
    # the block backends the runtime will use for this head shape, measured (or forced) first: the attention
    # curves below time the ones chosen, so the cost model prices what runs
    h_run, kv_run = _attention_heads(model, device, attn_heads)
    backends = _block_backends(device, dt, h_run, kv_run, model.head_dim)
    prog.stage(f"attention rates through the block backends chosen here (pairs: {backends['pairs']}, documents: "
               f"{backends['documents']}), full and causal blocks of {', '.join(map(str, blocks))} tokens and "
               f"documents packed in {max(blocks)}, head_dim {model.head_dim}")
    full, diag, packed, h_meas, kv_meas = _attention_curves(model, blocks, device, dt, attn_heads, iters, warmup,
                                                            barrier, prog)
    prog.stage(f"the runtime's work around the kernels, attention layers of "
               f"{', '.join(map(str, _runtime_sizes(blocks)))} tokens per rank")
    runtime, runtime_a2a, runtime_ring = _runtime_curves(model, _runtime_sizes(blocks), dt, group, world, rank,
                                                         global_of, iters, warmup, prog)
    host_gbps = _host_link_rate(device, message_bytes, iters, warmup, barrier)
    local = sum(1 for h in hosts if h == host)
    memory = _free_memory_gib(device, local)

    lat = [[0.0] * world for _ in range(world)]
    bw = [[0.0] * world for _ in range(world)]
    mine = {}
    if world > 1:
        prog.stage(f"links: {len(pairs)} pair(s) ({pairs_note}) in {len(rounds)} round(s), "
                   f"{message_bytes / 2**20:.1f} MiB each way")
        for rnd in rounds:
            barrier()
            for a, b in rnd:
                if rank in (a, b):
                    peer = b if rank == a else a
                    mine[peer] = _measure_pair(rank, peer, device, message_bytes, 20 if cuda else 50, iters,
                                               global_of)
            prog.tick()
        prog.stage("all-to-all at the group sizes a plan can use")
        a2a_bytes = max(4, message_bytes // 16)
        a2a = _all_to_all_times(world, device, a2a_bytes, iters, group, global_of)
        prog.tick(a2a_sizes)
    else:
        a2a, a2a_bytes = [], 0
    row = {"host": host, "gpu": device_name(device), "memory_gib": memory, "gemm": gemm, "attn": full,
           "attn_causal": diag, "attn_document": packed, "runtime": runtime, "runtime_a2a": runtime_a2a,
           "runtime_ring": runtime_ring, "block_backends": backends, "mem_bound_gbps": mem_bound,
           "host_gbps": host_gbps,
           "links": {p: (l, b) for p, (l, b) in mine.items()},
           "a2a": [t for _, t in a2a]}
    rows = [None] * world
    dist.all_gather_object(rows, row, group=group)
    # bandwidth a -> b is what b received per second; a pair's latency is the mean of both ends' figures
    for r, rr in enumerate(rows):
        for peer, (l, b) in rr["links"].items():
            bw[peer][r] = b / 1e9
            lat[r][peer] = lat[peer][r] = (l + rows[peer]["links"][r][0]) / 2 * 1e6
    if world > all_pairs_up_to:  # copy the representatives to every pair of the same two nodes
        rep = {}
        for a, b in pairs:
            rep[(node_of[a], node_of[b])] = (a, b)
            rep[(node_of[b], node_of[a])] = (b, a)
        for a in range(world):
            for b in range(world):
                if a != b and not bw[a][b]:
                    x, y = rep[(node_of[a], node_of[b])]
                    bw[a][b], lat[a][b] = bw[x][y], lat[x][y]
    a2a_max = [(k, max(t for t in (rows[r]["a2a"][i] for r in range(k)) if t is not None))
               for i, (k, _) in enumerate(a2a)]
    meta = {"model": model.name, "dtype": str(dt).replace("torch.", ""), "head_dim": model.head_dim,
            "attn_heads": h_meas, "attn_kv_heads": kv_meas, "backend": backend, "world": world,
            "kernels": "hexiseq" if (device.type == "cpu" or _runtime_uses_c(device, dt)) else "torch",
            "hosts": sorted(set(hosts)), "iters": iters, "message_bytes": message_bytes, "a2a_bytes": a2a_bytes,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": round(time.perf_counter() - t_start, 1)}
    meta["block_backends"] = [rr["block_backends"] for rr in rows]  # per device, rank order (runtime.nn adopts)
    meta = broadcast_object(meta, group)
    cluster = _build_cluster(rows, bw, lat, pairs_note, a2a_max, meta, tolerance)
    if out is not None and rank == 0:
        cluster.to_yaml(out)
    if out is not None:
        barrier()
    prog.stage(f"done: {cluster.describe()}" + (f", written to {out}" if out is not None else ""))
    return cluster


def _block_backends(device, dtype, heads, kv_heads, head_dim):
    from ..runtime import fused

    return fused.choices(device, dtype, heads, kv_heads, head_dim)


def _runtime_uses_c(device, dtype):
    torch, _ = load_torch()
    from ..runtime import blocks

    return blocks.use_c_kernels(torch.empty(0, device=device, dtype=dtype))
