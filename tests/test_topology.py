"""The runtime's geometry (hexiseq.runtime.topology) for every plan the distributed tests execute, checked without
starting a process: shares partition the sequence and the heads, kv ranges and first holders follow the GQA
ratio, every ring route and shared-head reduction has its matching other end, each member receives exactly the
kv heads it needs, and the block pairs cover every visible (query, key) pair exactly once."""


import pytest

from hexiseq.runtime.topology import Topology

from dist_plans import CASES, layout_plan, tiny_model

PLANS = dict(CASES)
PLANS["replica"] = lambda: layout_plan((2,), tiny_model(6, 2), 45, [
    {"devices": [0, 1], "seq": 45, "tokens": [30, 15], "heads": [4, 2]}])


@pytest.fixture(params=sorted(PLANS))
def topo(request):
    plan = PLANS[request.param]()
    return Topology(plan, causal=plan.causal)


def _heads_of(ranges):
    out = []
    for lo, n in ranges:
        out += range(lo, lo + n)
    return sorted(out)


def test_members_partition_tokens_and_heads(topo):
    for g, members in enumerate(topo.groups):
        assert sum(mb.tokens for mb in members) == topo.S[g]
        assert [mb.tok_lo for mb in members] == [sum(m.tokens for m in members[:i]) for i in range(len(members))]
        assert _heads_of((mb.head_lo, mb.heads) for mb in members) == list(range(topo.heads))
        for mb in members:
            need = sorted({h // topo.per_kv for h in range(mb.head_lo, mb.head_lo + mb.heads)})
            assert list(range(mb.kv_lo, mb.kv_lo + mb.kv_n)) == need, mb
    ranks = sorted(mb.rank for members in topo.groups for mb in members)
    assert ranks == list(range(topo.pass_layout.num_devices))
    for r in ranks:
        assert topo.member(r).rank == r and topo.member(r) in topo.groups[topo.group_of(r)]


def test_first_holders(topo):
    for members in topo.groups:
        held = _heads_of((mb.kv_lo, mb.kv_n) for mb in members)
        firsts = _heads_of((mb.first_lo, mb.first_n) for mb in members)
        assert firsts == sorted(set(held)), "every held kv head has exactly one first holder"
        for mb in members:
            for h in range(mb.first_lo, mb.first_lo + mb.first_n):
                assert mb.kv_lo <= h < mb.kv_lo + mb.kv_n
                first = next(m for m in members if m.kv_lo <= h < m.kv_lo + m.kv_n)
                assert first.rank == mb.rank, f"kv head {h}: first holder is {first.rank}, not {mb.rank}"


@pytest.mark.parametrize("what", ["kv", "acc"])
def test_ring_routes_match_and_cover(topo, what):
    ranks = [mb.rank for members in topo.groups for mb in members]
    routes = {r: topo.ring_routes(r, what) for r in ranks}
    sent = sorted((r, s.peer, s.lo, s.n) for r in ranks for s in routes[r][0])
    received = sorted((s.peer, r, s.lo, s.n) for r in ranks for s in routes[r][1])
    assert sent == received, "every send has its receive at the other end"
    G = topo.n_groups
    for r in ranks:
        g, mb = topo.group_of(r), topo.member(r)
        sends, recvs = routes[r]
        if G == 1 or mb.heads == 0:
            assert not sends and not recvs
            continue
        need = (mb.kv_lo, mb.kv_n) if what == "kv" else (mb.first_lo, mb.first_n)
        assert _heads_of((s.lo, s.n) for s in recvs) == list(range(need[0], need[0] + need[1]))
        prev = {m.rank for m in topo.groups[(g - 1) % G]}
        nxt = {m.rank for m in topo.groups[(g + 1) % G]}
        assert all(s.peer in prev for s in recvs) and all(s.peer in nxt for s in sends)
        # only first-held heads leave a member
        assert all(mb.first_lo <= s.lo and s.lo + s.n <= mb.first_lo + mb.first_n for s in sends)


def test_co_holders_reduce_into_first_holders(topo):
    for members in topo.groups:
        sent, received = [], []
        for mb in members:
            send, recv = topo.co_holders(mb.rank)
            sent += [(mb.rank, s.peer, s.lo, s.n) for s in send]
            received += [(s.peer, mb.rank, s.lo, s.n) for s in recv]
            # a member sends exactly the heads it holds but does not first-hold
            others = sorted(set(range(mb.kv_lo, mb.kv_lo + mb.kv_n)) - set(range(mb.first_lo, mb.first_lo + mb.first_n)))
            assert _heads_of((s.lo, s.n) for s in send) == others
        assert sorted(sent) == sorted(received)


def test_block_pairs_cover_visible_pairs_once(topo):
    for gq in range(topo.n_groups):
        qpos = [p for p0, n in topo.chunks[gq] for p in range(p0, p0 + n)]
        for gk in range(topo.n_groups):
            kpos = [p for p0, n in topo.chunks[gk] for p in range(p0, p0 + n)]
            want = {(i, j) for i, qp in enumerate(qpos) for j, kp in enumerate(kpos) if not topo.causal or kp <= qp}
            got = []
            for bp in topo.block_pairs(gq, gk):
                assert qpos[bp.q_off] == bp.q_pos0 and kpos[bp.k_off] == bp.k_pos0
                pairs = [(bp.q_off + i, bp.k_off + j) for i in range(bp.q_len) for j in range(bp.k_len)
                         if not topo.causal or bp.k_pos0 + j <= bp.q_pos0 + i]
                assert pairs, f"block pair {bp} has no visible pair"
                got += pairs
            assert len(got) == len(set(got)) and set(got) == want, (gq, gk)


def test_head_runs_cover_each_members_heads_in_gqa_ratio(topo):
    """Every member's query heads, cut into runs that the kernels take with K/V in GQA ratio: in order, without
    gaps, each run's heads reading exactly its kv heads, the runs' kv heads disjoint (the backward adds each
    run's dK/dV into its own part), one run for heads aligned to kv heads, at most three otherwise."""
    p = topo.per_kv
    for members in topo.groups:
        for mb in members:
            runs = topo.head_runs(mb.rank)
            assert sum(r.h_n for r in runs) == mb.heads
            at, kv_seen = 0, set()
            for r in runs:
                assert r.h_lo == at and r.h_n > 0 and r.h_n % r.kv_n == 0
                heads = range(mb.head_lo + r.h_lo, mb.head_lo + r.h_lo + r.h_n)
                assert {h // p - mb.kv_lo for h in heads} == set(range(r.kv_lo, r.kv_lo + r.kv_n))
                assert all((h // p - mb.kv_lo - r.kv_lo) == (h - heads[0]) // (r.h_n // r.kv_n) for h in heads)
                assert kv_seen.isdisjoint(range(r.kv_lo, r.kv_lo + r.kv_n))
                kv_seen.update(range(r.kv_lo, r.kv_lo + r.kv_n))
                at += r.h_n
            if not mb.heads:
                assert runs == []
            elif mb.head_lo % p == 0 and mb.heads % p == 0:
                assert len(runs) == 1
            else:
                assert 1 <= len(runs) <= 3


def test_head_runs_of_unaligned_heads():
    """Four query heads per kv head, members holding heads 0-1, 2-8 and 9-11: the middle one reads the rest of
    kv head 0, kv head 1 whole and the start of kv head 2, as three runs."""
    plan = layout_plan((3,), tiny_model(12, 3), 48, [{"devices": [0, 1, 2], "seq": 48, "tokens": [16, 16, 16],
                                                      "heads": [2, 7, 3]}])
    topo = Topology(plan)
    assert topo.head_runs(0) == [(0, 2, 0, 1)]
    assert topo.head_runs(1) == [(0, 2, 0, 1), (2, 4, 1, 1), (6, 1, 2, 1)]
    assert topo.head_runs(2) == [(0, 3, 0, 1)]


def test_ring_routes_refuse_an_unknown_kind(topo):
    with pytest.raises(ValueError, match="'kv' or 'acc'"):
        topo.ring_routes(0, "grad")


def test_bytes_sent_are_the_bytes_the_cost_model_charges(topo):
    """What the runtime moves, counted from the topology it executes (ring routes; all-to-all parts, which the
    runtime checks against the topology on every call), equals the traffic the cost model prices, per device:
    ring bytes per token of a block, and one layer's all-to-all bytes for one sequence, forward and backward
    (the backward returns dK, dV of first-held kv heads only)."""
    plan = topo.plan
    elem = plan.model.head_dim * plan.model.dtype_bytes
    t = plan.devices
    for slot, rank in enumerate(t.device.tolist()):
        sends, recvs = topo.ring_routes(rank, "kv")
        assert sum(2 * r.n * elem for r in sends) == t.ring_send_bytes[slot], (rank, sends)
        assert sum(2 * r.n * elem for r in recvs) == t.ring_recv_bytes[slot], (rank, recvs)
        g = topo.group_of(rank)
        peers = [i for i, mb in enumerate(topo.groups[g]) if mb.rank != rank]  # its own part stays local
        a2a_in, a2a_out = topo.a2a_in(rank), topo.a2a_out(rank)
        sent = sum(a2a_in[i][0] + a2a_out[i][0] for i in peers) * elem
        received = sum(a2a_in[i][1] + a2a_out[i][1] for i in peers) * elem
        assert sent == t.a2a_send_bytes[slot] and received == t.a2a_recv_bytes[slot], (rank, sent, received)
        a2a_grads = topo.a2a_grads(rank)
        sent = sum(a2a_out[i][1] + a2a_grads[i][0] for i in peers) * elem     # dO goes the output's way back
        received = sum(a2a_out[i][0] + a2a_grads[i][1] for i in peers) * elem
        assert sent == t.a2a_grad_send_bytes[slot] and received == t.a2a_grad_recv_bytes[slot], (rank, sent, received)


@pytest.mark.parametrize("pattern", ["a2a_in", "a2a_out", "a2a_grads"])
def test_all_to_all_counts_match_end_to_end(topo, pattern):
    """Every all-to-all the runtime runs (it sizes and checks each one from these counts): what a member sends to
    another is what that one expects from it."""
    for members in topo.groups:
        counts = {mb.rank: getattr(topo, pattern)(mb.rank) for mb in members}
        for i, a in enumerate(members):
            for j, b in enumerate(members):
                assert counts[a.rank][j][0] == counts[b.rank][i][1], (pattern, a.rank, b.rank)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_slices_add_up_to_the_whole_layer(topo, n):
    """The runtime pipelines a layer in slices of kv heads: every query and kv head is in exactly one slice, each
    slice is itself a consistent topology (the checks above, on it), and the slices' transfers (ring routes of
    both kinds, shared-head reductions, all three all-to-alls) add up, per rank and per peer, to the whole
    layer's, so slicing moves no byte the cost model does not charge."""
    slices = topo.slices(n)
    assert len(slices) == min(n, topo.kv_heads)
    assert slices[0].kv_window[0] == 0 and slices[-1].kv_window[1] == topo.kv_heads
    assert all(a.kv_window[1] == b.kv_window[0] for a, b in zip(slices, slices[1:]))
    for s in slices:
        test_members_partition_tokens_and_heads(s)
        test_first_holders(s)
        test_ring_routes_match_and_cover(s, "kv")
        test_ring_routes_match_and_cover(s, "acc")
        test_co_holders_reduce_into_first_holders(s)
    for rank in (mb.rank for members in topo.groups for mb in members):
        for pattern in ("a2a_in", "a2a_out", "a2a_grads"):
            whole = getattr(topo, pattern)(rank)
            parts = [getattr(s, pattern)(rank) for s in slices]
            assert [tuple(map(sum, zip(*col))) for col in zip(*parts)] == whole, (pattern, rank)
        for kind in ("kv", "acc"):
            for i in (0, 1):
                whole = {}
                for r in topo.ring_routes(rank, kind)[i]:
                    whole[r.peer] = whole.get(r.peer, 0) + r.n
                summed = {}
                for s in slices:
                    for r in s.ring_routes(rank, kind)[i]:
                        summed[r.peer] = summed.get(r.peer, 0) + r.n
                assert summed == whole, (kind, i, rank)
        for i in (0, 1):
            whole = sum(r.n for r in topo.co_holders(rank)[i])
            assert sum(r.n for s in slices for r in s.co_holders(rank)[i]) == whole, rank


def test_touching_chunks_are_one_chunk(topo):
    """A group's chunks are the plan's positions in the plan's order, and no chunk starts where the one before it
    ends (those are one block call, not two): one group's attention is one diagonal block pair."""
    for g in range(topo.n_groups):
        assert [p for p0, n in topo.chunks[g] for p in range(p0, p0 + n)] == topo.plan.group_positions(g).tolist()
        assert all(a[0] + a[1] != b[0] for a, b in zip(topo.chunks[g], topo.chunks[g][1:]))
    if topo.n_groups == 1:
        assert topo.chunks[0] == [(0, topo.S[0])] and len(topo.block_pairs(0, 0)) == 1
