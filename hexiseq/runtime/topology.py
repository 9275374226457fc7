"""Who holds what and who sends what to whom under a plan: plain data, no torch.distributed.

The runtime (hexiseq.nn) executes these routes; here they can be inspected and tested without starting a
process. A plan's devices form head-parallel (HP) groups in ring order. Inside group g, member m holds
`tokens` of the group's sequence for the token-parallel work and, after the all-to-all, the query heads
[head_lo, head_lo + heads) of all S_g tokens of its group, with the kv heads they need, [kv_lo, kv_lo + kv_n).
A kv head needed by several members of a group has one *first holder* (the lowest member in layout order that
holds it): only first holders send K/V to the next group and accumulate dK/dV for it, the others reduce their
contributions into the first holder.
"""

from typing import List, NamedTuple, Tuple

import numpy as np

from .. import geometry
from ..schedule import as_pass
from ..errors import HexiseqError

__all__ = ["Member", "Topology", "BlockPair", "Route", "HeadRun"]


class Member(NamedTuple):
    """One device's place in its HP group (all ranges are [lo, lo + n))."""

    rank: int      # the plan's device id (= rank in the plan's process group)
    tokens: int    # token-parallel share of the group's sequence
    tok_lo: int    # where that share starts in the group's token order
    head_lo: int   # query heads held during attention
    heads: int
    kv_lo: int     # kv heads those query heads read
    kv_n: int
    first_lo: int  # kv heads this member first-holds (contiguous)
    first_n: int


class Route(NamedTuple):
    """A transfer of the kv heads [lo, lo + n) to or from `peer` (a rank)."""

    peer: int
    lo: int
    n: int


class HeadRun(NamedTuple):
    """Query heads [h_lo, h_lo + h_n) of a member that read the kv heads [kv_lo, kv_lo + kv_n), both counted from
    the member's first (query or kv) head, in the integer GQA ratio h_n / kv_n: a kernel call's worth of heads."""

    h_lo: int
    h_n: int
    kv_lo: int
    kv_n: int


class BlockPair(NamedTuple):
    """Two contiguous chunks of positions with at least one visible (query, key) pair: offsets and lengths in
    the groups' token order, and the absolute position of each chunk's first token."""

    q_off: int
    q_pos0: int
    q_len: int
    k_off: int
    k_pos0: int
    k_len: int


class Topology:
    """The geometry of a plan for the runtime: members per group, ring routes, co-holders, block pairs."""

    def __init__(self, plan, causal: bool = True, kv_window: Tuple[int, int] = None):
        """plan: a hexiseq.Plan or the PassLayout it runs as (hexiseq.schedule); only the PassLayout is read.
        kv_window=(a, b): the topology of the kv heads [a, b) and their query heads only, numbered from 0 (a
        slice of the layer, which the runtime pipelines; see slices())."""
        self.plan = plan
        self.pass_layout = pl = as_pass(plan)
        self.causal = bool(causal)
        self.per_kv = pl.heads // pl.kv_heads
        ka, kb = kv_window if kv_window is not None else (0, pl.kv_heads)
        if not 0 <= ka < kb <= pl.kv_heads:
            raise HexiseqError(f"internal: kv window [{ka}, {kb}) outside [0, {pl.kv_heads})")
        self.kv_window = (ka, kb)
        self.heads, self.kv_heads = (kb - ka) * self.per_kv, kb - ka
        lay = pl.layout
        sizes = lay.group_size.tolist()
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.n_groups = len(sizes)
        self.groups: List[List[Member]] = [self._members(lay, offsets[g], offsets[g + 1]) for g in range(self.n_groups)]
        self.S = [int(x) for x in lay.group_seq]
        # A group's chunks that touch (the front and back chunk of zigzag's middle group, and of the only group of a
        # one-group plan) are one chunk here: the same positions in the same order, attended in one block call
        # instead of three smaller ones and two merges. On one rank that is the block backend called once, as the
        # user would call it alone (the runtime's tax there was three 4K-token calls for one 8K-token sequence).
        self.chunks = [_touching_joined(c) for c in geometry.chunks(lay)]
        self._where = {mb.rank: (g, mb) for g, members in enumerate(self.groups) for mb in members}

    def _members(self, lay, first_slot, end_slot) -> List[Member]:
        """The members of one group, from the plan's tables: kv ranges and first holders as the core computed
        them for the cost model (the PassLayout's), cut to this topology's kv window and renumbered from it."""
        t = self.pass_layout
        ka, kb = self.kv_window
        rows, tok = [], 0
        cols = [a[first_slot:end_slot].tolist() for a in (lay.device, lay.tokens, lay.head_lo, lay.head_count,
                                                          t.kv_lo, t.kv_count, t.first_lo, t.first_count)]
        for device, tokens, head_lo, heads, kv_lo, kv_count, first_lo, first_count in zip(*cols):
            lo, hi = max(head_lo, ka * self.per_kv), min(head_lo + heads, kb * self.per_kv)
            kv = _cut(kv_lo, kv_count, ka, kb)
            first = _cut(first_lo, first_count, ka, kb)
            head = (lo - ka * self.per_kv, hi - lo) if hi > lo else (0, 0)
            rows.append(Member(device, tokens, tok, *head, *kv, *first))
            tok += tokens
        return rows

    def slices(self, n: int) -> List["Topology"]:
        """The layer cut into up to n slices of whole kv heads (contiguous, as even as the kv heads allow), each
        with its query heads: the runtime pipelines them, one slice's all-to-all travelling while another's
        attention runs. Every kv head is in exactly one slice, so the slices' transfers add up to the whole
        layer's (tests/test_topology.py)."""
        ka, kb = self.kv_window
        n = max(1, min(int(n), kb - ka))
        cuts = [ka + (kb - ka) * i // n for i in range(n + 1)]
        if n == 1:
            return [self]
        return [Topology(self.pass_layout, self.causal, (cuts[i], cuts[i + 1])) for i in range(n)]

    def group_of(self, rank: int) -> int:
        return self._where[rank][0]

    def member(self, rank: int) -> Member:
        return self._where[rank][1]

    def head_runs(self, rank: int) -> List[HeadRun]:
        """The member's query heads cut where the kernels can take them with K/V in GQA ratio: at most a partial
        kv head first, whole kv heads, a partial kv head last. Members whose heads are aligned to kv heads get
        one run; others get up to three, so that K/V never has to be expanded to one head per query head."""
        me, p = self.member(rank), self.per_kv
        runs, h, end = [], me.head_lo, me.head_lo + me.heads
        while h < end:
            kv = h // p
            if h % p or end - h < p:      # part of one kv head
                stop, kv_n = min(end, (kv + 1) * p), 1
            else:                         # whole kv heads
                stop = h + (end - h) // p * p
                kv_n = (stop - h) // p
            runs.append(HeadRun(h - me.head_lo, stop - h, kv - me.kv_lo, kv_n))
            h = stop
        return runs

    def ring_routes(self, rank: int, what: str, hops: int = 1) -> Tuple[List[Route], List[Route]]:
        """P2P routes of one ring step for `rank`. what = "kv": K/V of its kv range from the previous group's first
        holders, and to the next group's members what it first-holds of their ranges; what = "acc": dK/dV
        accumulators, first holder to first holder. hops: to the group that many places on (and from the group
        that many places back) instead of the neighbours: a ring cut short by a window sends its accumulators
        home directly. Returns (sends, recvs) in member order."""
        if what not in ("kv", "acc"):
            raise ValueError(f"what must be 'kv' or 'acc', got {what!r}")
        g, me = self._where[rank]
        G = self.n_groups
        if G == 1 or me.heads == 0 or hops % G == 0:
            return [], []
        prev, nxt = self.groups[(g - hops) % G], self.groups[(g + hops) % G]

        def need(mb):
            return (mb.kv_lo, mb.kv_n) if what == "kv" else (mb.first_lo, mb.first_n)

        recvs = []
        lo, n = need(me)
        for src in prev:  # each kv head has exactly one first holder
            a, b = max(lo, src.first_lo), min(lo + n, src.first_lo + src.first_n)
            if src.first_n and b > a:
                recvs.append(Route(src.rank, a, b - a))
        sends = []
        for dst in nxt:
            dlo, dn = need(dst)
            a, b = max(dlo, me.first_lo), min(dlo + dn, me.first_lo + me.first_n)
            if me.first_n and b > a:
                sends.append(Route(dst.rank, a, b - a))
        return sends, recvs

    def co_holders(self, rank: int) -> Tuple[List[Route], List[Route]]:
        """Members of `rank`'s group that share kv heads with it: the heads it sends to their first holder (it
        holds them, another first-holds them) and those it receives (it first-holds them, another holds them)."""
        g, me = self._where[rank]
        send, recv = [], []
        for mb in self.groups[g]:
            if mb.rank == me.rank or not mb.kv_n:
                continue
            a, b = max(me.kv_lo, mb.first_lo), min(me.kv_lo + me.kv_n, mb.first_lo + mb.first_n)
            if b > a:
                send.append(Route(mb.rank, a, b - a))
            a, b = max(mb.kv_lo, me.first_lo), min(mb.kv_lo + mb.kv_n, me.first_lo + me.first_n)
            if b > a:
                recv.append(Route(mb.rank, a, b - a))
        return send, recv

    def a2a_in(self, rank: int) -> List[Tuple[int, int]]:
        """The all-to-all into attention, per member of `rank`'s group (member order): (elements sent, elements
        received) per batch row and head-dim column. It sends each member its tokens of that member's query and kv
        heads (Q, K, V) and receives the member's tokens of its own heads. Its own entry stays local."""
        g, me = self._where[rank]
        return [(me.tokens * (mb.heads + 2 * mb.kv_n), mb.tokens * (me.heads + 2 * me.kv_n)) for mb in self.groups[g]]

    def a2a_out(self, rank: int) -> List[Tuple[int, int]]:
        """The all-to-all out of attention, per member: (elements sent, received) per batch row and head-dim
        column. It sends each member the attention output of that member's tokens for its own heads."""
        g, me = self._where[rank]
        return [(mb.tokens * me.heads, me.tokens * mb.heads) for mb in self.groups[g]]

    def a2a_grads(self, rank: int) -> List[Tuple[int, int]]:
        """The backward's all-to-all out of attention, per member: (elements sent, received) per batch row and
        head-dim column. It sends each member dQ of that member's tokens for its own query heads, and dK, dV for
        the kv heads it first-holds (the co-holders' shares are already reduced into them)."""
        g, me = self._where[rank]
        return [(mb.tokens * (me.heads + 2 * me.first_n), me.tokens * (mb.heads + 2 * mb.first_n))
                for mb in self.groups[g]]

    def ring_steps(self, causal: bool, variant) -> int:
        """How many ring steps a layer of this variant needs: one more than the farthest step at which some group
        meets a key block some query of it sees under the window (all of them without one). The same on every
        rank (the plan's geometry alone); kept per (causal, variant)."""
        key = (causal, variant)
        cache = self.__dict__.setdefault("_ring_steps", {})
        if key not in cache:
            G, last = self.n_groups, 0
            if variant.window is None:
                last = G - 1
            for g in range(G) if variant.window is not None else ():
                for s in range(G - 1, last, -1):  # only steps past the farthest found so far can raise it
                    if any(variant.sees(causal, p.q_pos0, p.q_len, p.k_pos0, p.k_len)
                           for p in self.block_pairs(g, (g - s) % G)):
                        last = s
                        break
            cache[key] = last + 1
        return cache[key]

    def block_pairs(self, gq: int, gk: int) -> List[BlockPair]:
        """The contiguous chunk pairs of group gq's queries and group gk's keys with any visible key."""
        out = []
        qo = 0
        for qp0, qn in self.chunks[gq]:
            ko = 0
            for kp0, kn in self.chunks[gk]:
                if not (self.causal and kp0 > qp0 + qn - 1):
                    out.append(BlockPair(qo, qp0, qn, ko, kp0, kn))
                ko += kn
            qo += qn
        return out


def _touching_joined(chunks):
    """[(first position, length), ...] with each chunk that starts where the one before it ends joined to it."""
    out = []
    for p0, n in chunks:
        if out and out[-1][0] + out[-1][1] == p0:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((p0, n))
    return out


def _cut(lo: int, n: int, a: int, b: int) -> Tuple[int, int]:
    """The range [lo, lo + n) cut to [a, b) and renumbered from a, as (lo, n); (0, 0) when they do not meet."""
    x, y = max(lo, a), min(lo + n, b)
    return (x - a, y - x) if y > x else (0, 0)
