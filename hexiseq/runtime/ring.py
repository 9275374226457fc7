"""One attention layer of a plan on one rank, forward and backward, as plain functions over the rank's shards:

1. all-to-all inside the HP group (uneven split sizes): "my tokens, all heads" -> "all of the group's tokens,
   my head range" for Q and "..., the kv heads my query heads use" for K and V;
2. ring attention across groups: at step k the group's queries attend the K/V block of the group k places
   back in the ring, while the next block arrives by batched asynchronous P2P from the previous group's
   devices that hold the same kv heads (a sub-ring per head range); partial results are merged with their
   log-sum-exp;
3. the reverse all-to-all of the output.

Backward runs the same pattern in reverse: dO goes through the all-to-all, the ring moves K/V blocks again
and carries their dK/dV accumulators along (a kv head held by two devices of a group has its pieces summed
by its first holder), the accumulators arrive home after one extra hop, and dQ, dK, dV go back through the
reverse all-to-all.

Who sends what to whom comes from hexiseq.runtime.topology (no processes), the transfers from hexiseq.runtime.comm, the block
attention from hexiseq.runtime.blocks.
"""

import os

import torch

from .comm import TAG_ACC, TAG_KV, TAG_REDUCE
from .variants import PLAIN
from ..errors import InvalidArgumentError


def slice_count(topology, asked):
    """How many slices a layer is pipelined in: `asked`, else HEXISEQ_A2A_SLICES, else 1. Not more by default:
    on Gloo over 2 CPU processes (benchmarks/results/runtime.md) 4 slices made one-group layers slower (the
    all-to-all wait went from about 9% to 35-39% of the layer) and 2 slices did not help reliably; on GPUs,
    where NCCL's all-to-all runs beside the attention kernels, it is yet to be measured."""
    if asked is None:
        env = os.environ.get("HEXISEQ_A2A_SLICES", "")
        if env:
            try:
                asked = int(env)
            except ValueError:
                raise InvalidArgumentError(f"HEXISEQ_A2A_SLICES={env!r}: expected a positive integer") from None
            if asked < 1:
                raise InvalidArgumentError(f"HEXISEQ_A2A_SLICES={env!r}: expected a positive integer")
        else:
            asked = 1
    elif isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise InvalidArgumentError(f"a2a_slices must be a positive integer, got {asked!r}")
    return asked


def _cols(t, topo, kv):
    """The columns of a full-head tensor [B, S, heads or kv heads, d] that a slice of the layer covers."""
    a, b = topo.kv_window
    return t[:, :, a:b] if kv else t[:, :, a * topo.per_kv:b * topo.per_kv]


def layer_forward(comm, slices, kern, q, k, v, causal, scale, docs=None, variant=PLAIN, sinks=None):
    """q [B, s_r, A, d], k/v [B, s_r, A_kv, d] -> (o [B, s_r, A, d], what layer_backward needs: per slice
    (Qg [B, S_g, h, d], KV [2, B, S_g, kv, d], Og [B, S_g, h, d], the lse of each query chunk)).

    docs: the document mask of the rank's group's query chunks (hexiseq.runtime.documents.chunk_starts), or None for one causal document
    per sequence. Documents do not change who holds what: only the block kernels see them.

    variant: a sliding window and soft-capping (hexiseq.runtime.variants), applied by the block kernels; a block
    pair no query of which sees a key of it under the window is neither computed nor merged. sinks: sink logits
    [A] (or None), folded once into each finished row of the group (BlockKernels.fold_sinks) before the output
    goes home; the saved Og and lse are the folded ones, which is what makes the kernels' backward exact.

    slices: the plan's Topology cut by kv heads (Topology.slices). They are pipelined: the all-to-all into slice
    i + 1 travels while slice i's attention runs, and slice i's output all-to-all while slice i + 1's runs, so
    only the first all-to-all in and the last one out stand alone on the critical path. One slice is the plain
    layer.

    Memory passes are counted: each tensor is copied once into the send buffer, once out of the receive buffer
    (K and V straight into the [2, ...] block the ring sends), the rank's own part not at all, and the output
    is computed in place where the kernels allow (BlockKernels.forward's out=)."""
    rank = comm.rank
    B, s_r, A, d = q.shape
    dev, dt = q.device, q.dtype

    def start_in(topo):  # my tokens of member j's heads (Q, K, V), for every member of my group
        members, me = topo.groups[topo.group_of(rank)], topo.member(rank)
        qs, ks, vs = _cols(q, topo, False), _cols(k, topo, True), _cols(v, topo, True)
        parts = [[qs[:, :, mb.head_lo:mb.head_lo + mb.heads], ks[:, :, mb.kv_lo:mb.kv_lo + mb.kv_n],
                  vs[:, :, mb.kv_lo:mb.kv_lo + mb.kv_n]] for mb in members]
        shapes = [[(B, mb.tokens, me.heads, d), (B, mb.tokens, me.kv_n, d), (B, mb.tokens, me.kv_n, d)]
                  for mb in members]
        return comm.a2a_start(parts, shapes, topo.a2a_in(rank), B * d, dt, dev)

    saved, outs = [], []
    pending = start_in(slices[0])
    for i, topo in enumerate(slices):
        following = start_in(slices[i + 1]) if i + 1 < len(slices) else None
        got, pending = comm.a2a_finish(pending), following
        members, me = topo.groups[topo.group_of(rank)], topo.member(rank)
        Qg = _join([p[0] for p in got])                          # [B, S_g, h, d]
        KV = torch.empty(2, B, topo.S[topo.group_of(rank)], me.kv_n, d, dtype=dt, device=dev)
        for mb, (_, kp, vp) in zip(members, got):
            KV[0, :, mb.tok_lo:mb.tok_lo + mb.tokens] = kp
            KV[1, :, mb.tok_lo:mb.tok_lo + mb.tokens] = vp
        Og, lses = _ring_forward(comm, topo, kern, Qg, KV, causal, scale, docs, variant)
        if sinks is not None and me.heads:
            mine = _my_sinks(sinks, topo, me)
            for (qo, n), lse in zip(_chunk_spans(topo.chunks[topo.group_of(rank)]), lses):
                kern.fold_sinks(Og[:, qo:qo + n], lse, mine)
        # my heads of member j's tokens go back to member j
        parts = [[Og[:, mb.tok_lo:mb.tok_lo + mb.tokens]] for mb in members]
        shapes = [[(B, me.tokens, mb.heads, d)] for mb in members]
        outs.append(comm.a2a_start(parts, shapes, topo.a2a_out(rank), B * d, dt, dev))
        saved.append((Qg, KV, Og, lses))
    if _alone(slices, rank):
        comm.a2a_finish(outs[0])
        return saved[0][2], saved  # alone in my group, with every head: my output is Og itself
    o = torch.empty(B, s_r, A, d, dtype=dt, device=dev)
    for topo, handle in zip(slices, outs):
        oc = _cols(o, topo, False)
        for mb, (piece,) in zip(topo.groups[topo.group_of(rank)], comm.a2a_finish(handle)):
            oc[:, :, mb.head_lo:mb.head_lo + mb.heads] = piece
    return o, saved


def layer_lse(comm, slices, saved, shape, device):
    """The log-sum-exp of this rank's tokens' scaled scores for every head, [B, A, s_r] (flash-attn's layout; the
    accumulation dtype: float32, float64 for float64 inputs), from layer_forward's saved tensors (shape: q's [B,
    s_r, A, d]): each slice's lse of its group's tokens and this rank's heads goes home as the output does (an
    all-to-all out, one value per token and head). With sinks, the lse holds them (what the output was divided by)."""
    B, s_r, A, _ = shape
    rank, out, pending = comm.rank, None, []
    for topo, (_, _, _, lses) in zip(slices, saved):
        g = topo.group_of(rank)
        members, me = topo.groups[g], topo.member(rank)
        dt = lses[0].dtype if lses else torch.float32
        Lg = torch.empty(B, topo.S[g], me.heads, 1, dtype=dt, device=device)
        for (qo, n), lse in zip(_chunk_spans(topo.chunks[g]), lses):
            Lg[:, qo:qo + n, :, 0] = lse.transpose(1, 2)
        parts = [[Lg[:, mb.tok_lo:mb.tok_lo + mb.tokens]] for mb in members]
        shapes = [[(B, me.tokens, mb.heads, 1)] for mb in members]
        pending.append((topo, comm.a2a_start(parts, shapes, topo.a2a_out(rank), B, dt, device), dt))
    for topo, handle, dt in pending:
        if out is None:
            out = torch.empty(B, s_r, A, 1, dtype=dt, device=device)
        oc = _cols(out, topo, False)
        for mb, (piece,) in zip(topo.groups[topo.group_of(rank)], comm.a2a_finish(handle)):
            oc[:, :, mb.head_lo:mb.head_lo + mb.heads] = piece
    return out[..., 0].permute(0, 2, 1).contiguous()


def layer_backward(comm, slices, kern, do, saved, causal, scale, docs=None, variant=PLAIN, sinks=None):
    """dO [B, s_r, A, d] and layer_forward's saved tensors -> (dq, dk, dv) of this rank's shards, pipelined over
    the slices as the forward is; with sinks also their gradient [A], this rank's part (its heads of its group's
    rows; zero elsewhere): summed over the ranks, as every parameter's gradient of a sequence-parallel model is.
    docs, variant, sinks: as given to layer_forward."""
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float64, device=do.device)
    rank = comm.rank
    B, s_r, A, d = do.shape
    dev, dt = do.device, do.dtype
    do = do.contiguous()

    def start_do(topo):  # dO goes through the all-to-all in the q pattern, O's pattern reversed
        members, me = topo.groups[topo.group_of(rank)], topo.member(rank)
        dos = _cols(do, topo, False)
        parts = [[dos[:, :, mb.head_lo:mb.head_lo + mb.heads]] for mb in members]
        shapes = [[(B, mb.tokens, me.heads, d)] for mb in members]
        reverse_out = [(n_in, n_out) for n_out, n_in in topo.a2a_out(rank)]
        return comm.a2a_start(parts, shapes, reverse_out, B * d, dt, dev)

    grads = []
    pending = start_do(slices[0])
    for i, topo in enumerate(slices):
        following = start_do(slices[i + 1]) if i + 1 < len(slices) else None
        got, pending = comm.a2a_finish(pending), following
        members, me = topo.groups[topo.group_of(rank)], topo.member(rank)
        dOg = _join([p[0] for p in got])
        Qg, KV, Og, lses = saved[i]
        dQg, dKVg = _ring_backward(comm, topo, kern, Qg, KV, Og, lses, dOg, causal, scale, docs, variant)
        if sinks is not None and me.heads:
            lo = topo.kv_window[0] * topo.per_kv + me.head_lo
            for (qo, n), lse in zip(_chunk_spans(topo.chunks[topo.group_of(rank)]), lses):
                dsinks[lo:lo + me.heads] += kern.sinks_backward(Og[:, qo:qo + n], dOg[:, qo:qo + n], lse,
                                                                _my_sinks(sinks, topo, me)).double()
        # dQ of member j's tokens for my heads, dK/dV for the kv heads I first-hold
        parts, shapes = [], []
        for mb in members:
            sl = slice(mb.tok_lo, mb.tok_lo + mb.tokens)
            parts.append([dQg[:, sl], dKVg[0, :, sl], dKVg[1, :, sl]])
            shapes.append([(B, me.tokens, mb.heads, d)] + [(B, me.tokens, mb.first_n, d)] * 2)
        grads.append(comm.a2a_start(parts, shapes, topo.a2a_grads(rank), B * d, dt, dev))
    if _alone(slices, rank):
        (dq, dk, dv), = comm.a2a_finish(grads[0])  # every head, every kv head first-held
        return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks.to(sinks.dtype))
    dq = torch.empty(B, s_r, A, d, dtype=dt, device=dev)
    dk = torch.zeros(B, s_r, A // slices[0].per_kv, d, dtype=dt, device=dev)
    dv = torch.zeros_like(dk)
    for topo, handle in zip(slices, grads):
        dqc, dkc, dvc = _cols(dq, topo, False), _cols(dk, topo, True), _cols(dv, topo, True)
        for mb, (gq, gk, gv) in zip(topo.groups[topo.group_of(rank)], comm.a2a_finish(handle)):
            dqc[:, :, mb.head_lo:mb.head_lo + mb.heads] = gq
            dkc[:, :, mb.first_lo:mb.first_lo + mb.first_n] = gk
            dvc[:, :, mb.first_lo:mb.first_lo + mb.first_n] = gv
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks.to(sinks.dtype))


def _my_sinks(sinks, topo, me):
    """The sink logits of the heads this member computes in this slice."""
    lo = topo.kv_window[0] * topo.per_kv + me.head_lo
    return sinks.detach()[lo:lo + me.heads]


def _chunk_spans(chunks):
    """(offset in the group's tokens, length) of each query chunk."""
    spans, off = [], 0
    for _, n in chunks:
        spans.append((off, n))
        off += n
    return spans


def _alone(slices, rank):
    """Whether the rank is alone in its group and the layer is one slice: its group's tensors are then its
    own output and gradients, with no copy into place."""
    return len(slices) == 1 and len(slices[0].groups[slices[0].group_of(rank)]) == 1


def _join(pieces):
    """Pieces [B, n_j, ., d] laid along the tokens: the one piece itself when there is only one (no copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


def _ring_forward(comm, topo, kern, Qg, KV, causal, scale, docs, variant=PLAIN):
    """The group's attention over the ring: (Og [B, S_g, h, d] in Qg's dtype, the lse [B, h, n] of each query
    chunk). Where the kernels accumulate in the inputs' dtype, a chunk's first block pair writes Og in place
    and the later ones merge into it (merging into zeros and -inf gives the same bits, one pass later); else
    the chunks accumulate in fp32 and are cast at the end."""
    rank = comm.rank
    g, me, G = topo.group_of(rank), topo.member(rank), topo.n_groups
    B, Sg, h, d = Qg.shape
    dev, dt = Qg.device, Qg.dtype
    if h == 0:
        return Qg.new_zeros(B, Sg, 0, d), []
    acc_dt = kern.acc_dtype
    chunks = topo.chunks[g]
    qoff = [o for o, _ in _chunk_spans(chunks)]
    in_place = acc_dt == dt
    runs = topo.head_runs(rank)
    # A chunk whose queries meet one block pair in the whole ring, in one head run, takes the block's (out, lse) as
    # they come: no accumulator, no copy, no cast (on one rank: the block backend called alone)
    direct = [not in_place and n == 1 for n in _pairs_per_chunk(topo, g, runs, qoff, causal, variant)]
    Og = torch.empty(B, Sg, h, d, dtype=dt, device=dev) if in_place else None
    O = [Og[:, qo:qo + n] if in_place else None if one else torch.zeros(B, n, h, d, dtype=acc_dt, device=dev)
         for qo, (_, n), one in zip(qoff, chunks, direct)]
    L = [None if one else torch.full((B, h, n), float("-inf"), dtype=acc_dt, device=dev)
         for (_, n), one in zip(chunks, direct)]
    started = [not in_place and not one for one in direct]
    cur = KV                                          # [2, B, S_src, kv, d], the own block first
    sends, recvs = topo.ring_routes(rank, "kv")
    T = topo.ring_steps(causal, variant)  # under a window, the steps past T meet only blocks no query sees
    for step in range(T):
        src = (g - step) % G
        pending = None
        if step < T - 1:
            nxt_src = (g - step - 1) % G
            pending = comm.exchange(
                sends, recvs, lambda lo, n, c=cur: c[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
                lambda lo, n, S=topo.S[nxt_src]: (2, B, S, n, d), dt, dev, TAG_KV)
        for qo, qp0, qn, ko, kp0, kn in topo.block_pairs(g, src):
            i = qoff.index(qo)
            if docs is not None and kp0 + kn <= docs[i][1]:
                continue  # every key lies before every query's document
            if not variant.sees(causal, qp0, qn, kp0, kn):
                continue  # every key lies outside every query's window
            t0 = comm.clock(dev)
            for r in runs:
                hs, ks = slice(r.h_lo, r.h_lo + r.h_n), slice(r.kv_lo, r.kv_lo + r.kv_n)
                args = (Qg[:, qo:qo + qn, hs], cur[0, :, ko:ko + kn, ks], cur[1, :, ko:ko + kn, ks], causal, qp0,
                        kp0, scale, None if docs is None else docs[i][0])
                if direct[i]:
                    O[i], L[i] = kern.forward(*args, variant=variant)
                elif started[i]:
                    kern.merge(O[i][:, :, hs], L[i][:, hs], *kern.forward(*args, variant=variant))
                else:
                    kern.forward(*args, out=O[i][:, :, hs], lse=L[i][:, hs], variant=variant)
            started[i] = True
            comm.phase_s["attn"] += comm.clock(dev) - t0
        if pending is not None:
            reqs, got, _keep = pending
            comm.wait(reqs, dev)
            cur = torch.empty(2, B, topo.S[nxt_src], me.kv_n, d, dtype=dt, device=dev)
            for lo, n, t in got:
                cur[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] = t
    for i, (o, first) in enumerate(zip(O, started)):
        if o is None:  # a direct chunk whose one pair the documents skipped: it sees no key
            n = chunks[i][1]
            O[i] = torch.zeros(B, n, h, d, dtype=dt, device=dev)
            L[i] = torch.full((B, h, n), float("-inf"), dtype=acc_dt, device=dev)
        elif not first:  # only an empty chunk: every other one meets its own positions at step 0; Og is empty()
            o.zero_()
    return (Og if in_place else _join([o.to(dt) for o in O])), L


def _ring_backward(comm, topo, kern, Qg, KV, Og, lses, dOg, causal, scale, docs, variant=PLAIN):
    """The group's attention gradients over the ring: (dQ [B, S_g, h, d], dK/dV [2, B, S_g, first_n, d] of the
    kv heads this member first-holds, whole over the ring), both in Qg's dtype."""
    rank = comm.rank
    g, me, G = topo.group_of(rank), topo.member(rank), topo.n_groups
    B, Sg, h, d = Qg.shape
    dev, dt = Qg.device, Qg.dtype
    kv = me.kv_n
    if h == 0:
        return Qg.new_zeros(B, Sg, 0, d), Qg.new_zeros(2, B, Sg, 0, d)
    acc_dt = kern.acc_dtype
    chunks = topo.chunks[g]
    qoff = [o for o, _ in _chunk_spans(chunks)]
    runs = topo.head_runs(rank)
    co_holders = topo.co_holders(rank)
    pairs = topo.block_pairs(g, g)
    if G == 1 and len(runs) == 1 and len(pairs) == 1 and pairs[0].q_len == pairs[0].k_len == Sg \
            and not any(co_holders) and runs[0].kv_n == kv == me.first_n and (docs is None or pairs[0].k_pos0 + Sg > docs[0][1]) \
            and variant.sees(causal, pairs[0].q_pos0, Sg, pairs[0].k_pos0, Sg):
        # one block pair holds the group's whole attention: its gradients are the answer as they come (no fp32
        # accumulators, no adds, no casts; on one rank, the block backend called alone)
        p, r = pairs[0], runs[0]
        hs, ks = slice(r.h_lo, r.h_lo + r.h_n), slice(r.kv_lo, r.kv_lo + r.kv_n)
        t0 = comm.clock(dev)
        dq, dk, dv = kern.backward(Qg[:, :, hs], KV[0][:, :, ks], KV[1][:, :, ks], Og[:, :, hs], lses[0][:, hs],
                                   dOg[:, :, hs], causal, p.q_pos0, p.k_pos0, scale,
                                   None if docs is None else docs[0][0], variant=variant)
        comm.phase_s["attn"] += comm.clock(dev) - t0
        return dq, torch.stack((dk, dv))
    dQ = torch.zeros(B, Sg, h, d, dtype=acc_dt, device=dev)
    kv_sends, kv_recvs = topo.ring_routes(rank, "kv")
    acc_sends, acc_recvs = topo.ring_routes(rank, "acc")
    cur = KV
    f = slice(me.first_lo - me.kv_lo, me.first_lo - me.kv_lo + me.first_n)

    def assemble(pending, S):
        """Wait for a posted accumulator exchange; the received dK/dV of my first-held heads [2, B, S, ., d]."""
        reqs, got, _keep = pending
        comm.wait(reqs, dev)
        acc = torch.zeros(2, B, S, me.first_n, d, dtype=acc_dt, device=dev)
        for lo, n, t in got:
            acc[:, :, :, lo - me.first_lo:lo - me.first_lo + n] = t
        return acc

    # Both transfers of a step overlap the step's kernels: the next K/V block is posted before them, and the
    # accumulator a step hands on is waited for only at the end of the next step (or after the loop). Under a
    # window the ring stops after T steps (topo.ring_steps): the accumulators then go home directly, T - 1 groups
    # back, instead of round the rest of the ring.
    T = topo.ring_steps(causal, variant)
    home_sends, home_recvs = acc_sends, acc_recvs
    if T < G:
        home_sends, home_recvs = topo.ring_routes(rank, "acc", hops=1 - T)
    acc_pending = None
    for step in range(T):
        src = (g - step) % G
        Ssrc = topo.S[src]
        nxt_src = (g - step - 1) % G
        kv_pending = None
        if step < T - 1:
            kv_pending = comm.exchange(
                kv_sends, kv_recvs, lambda lo, n, c=cur: c[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
                lambda lo, n, S=topo.S[nxt_src]: (2, B, S, n, d), dt, dev, TAG_KV)
        # my contributions to dK/dV of this block, for my whole kv range
        contrib = torch.zeros(2, B, Ssrc, kv, d, dtype=acc_dt, device=dev)
        for qo, qp0, qn, ko, kp0, kn in topo.block_pairs(g, src):
            i = qoff.index(qo)
            if docs is not None and kp0 + kn <= docs[i][1]:
                continue
            if not variant.sees(causal, qp0, qn, kp0, kn):
                continue
            t0 = comm.clock(dev)
            q_s = slice(qo, qo + qn)
            for r in runs:  # the runs read disjoint kv heads: each adds into its own part of contrib
                hs, ks = slice(r.h_lo, r.h_lo + r.h_n), slice(r.kv_lo, r.kv_lo + r.kv_n)
                kern.backward_into(Qg[:, q_s, hs], cur[0, :, ko:ko + kn, ks], cur[1, :, ko:ko + kn, ks],
                                   Og[:, q_s, hs], lses[i][:, hs], dOg[:, q_s, hs], causal, qp0, kp0, scale,
                                   dQ[:, q_s, hs], contrib[0, :, ko:ko + kn, ks], contrib[1, :, ko:ko + kn, ks],
                                   None if docs is None else docs[i][0], variant=variant)
            comm.phase_s["attn"] += comm.clock(dev) - t0
        # kv heads shared with another member: non-first holders hand their piece to the first holder
        contrib = _reduce_shared(comm, me, contrib, co_holders, B, Ssrc, d, acc_dt, dev)
        # the block's accumulator (posted by the previous group during the previous step), plus my part
        if acc_pending is None:
            acc = contrib[:, :, :, f]  # contrib is this step's own tensor: no copy needed
        else:
            acc = assemble(acc_pending, Ssrc)
            acc += contrib[:, :, :, f]
        if T == 1:
            break
        # hand it on (after the last step this hop takes it home); receive the next block's accumulator (after the
        # last step: my own block's, from the group that met it last)
        last = step == T - 1
        acc_pending = comm.exchange(
            home_sends if last else acc_sends, home_recvs if last else acc_recvs,
            lambda lo, n, a=acc: a[:, :, :, lo - me.first_lo:lo - me.first_lo + n],
            lambda lo, n, S=topo.S[g if last else nxt_src]: (2, B, S, n, d), acc_dt, dev, TAG_ACC)
        if kv_pending is not None:
            comm.wait(kv_pending[0], dev)
            cur = torch.empty(2, B, topo.S[nxt_src], kv, d, dtype=dt, device=dev)
            for lo, n, t in kv_pending[1]:
                cur[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] = t
    if T > 1:  # the last hop brought my own group's block home
        acc = assemble(acc_pending, Sg)
    # acc now holds the full dK/dV of my own group's block for the kv heads I first-hold
    return dQ.to(dt), acc.to(dt)


def _pairs_per_chunk(topo, g, runs, qoff, causal=True, variant=PLAIN):
    """Per query chunk of group g, how many block-pair kernel calls the whole ring makes for it (pairs over every
    key group that some query sees under the window, times the head runs)."""
    count = dict.fromkeys(qoff, 0)
    for src in range(topo.n_groups):
        for bp in topo.block_pairs(g, src):
            if variant.sees(causal, bp.q_pos0, bp.q_len, bp.k_pos0, bp.k_len):
                count[bp.q_off] += len(runs)
    return [count[qo] for qo in qoff]


def _reduce_shared(comm, me, contrib, co, B, S, d, acc_dt, dev):
    """Sum the pieces of kv heads this member shares with another member of its group into the first holder."""
    send, recv = co
    if not send and not recv:
        return contrib
    reqs, got, _keep = comm.exchange(
        send, recv, lambda lo, n: contrib[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
        lambda lo, n: (2, B, S, n, d), acc_dt, dev, TAG_REDUCE)
    comm.wait(reqs, dev)
    for lo, n, t in got:
        contrib[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] += t
    return contrib
