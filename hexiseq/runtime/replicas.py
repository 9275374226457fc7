"""Copies of the model states across groups of ranks (HSDP with unequal groups and unequal shares).

`shard_states(module, shares, replicas=[[0], [1, 2, 3]])` keeps one whole copy of the states in each replica (a
list of ranks), sharded inside it by the ranks' shares: a rank gathers parameters from, and reduce-scatters
gradients to, the ranks of its own replica only. What remains is to sum the gradients across replicas, which is
what this module does, as the batch planner prices it (hexiseq.BatchPlanner.sync_s): every element of a unit's
flat vector is held by exactly one rank of each replica, so each rank all-reduces what it holds with the ranks of
the other replicas that hold the same elements.

Replicas of unequal size, or of equal size at unequal shares, cut the flat vector at different places. The cuts
of all replicas together split it into segments, each held by one rank per replica: its holders. Segments of the
same holders (within a unit and across units) travel as one all-reduce over a process group of those ranks, made
once, when the module is sharded. A rank takes part in one all-reduce per holder set it belongs to, carrying
exactly its shard (2 (R - 1) / R of it on the wire for R replicas in a ring), so a rank of the smallest replica,
which holds the largest part, is the one the step waits for. The all-reduces run in the order of their holder
sets' first segments, the same on every rank, so that no two ranks wait on each other's second collective.

The sync runs when asked (`hexiseq.states.sync_replicas(module)`, once per step after its last backward), not at
every backward: the replicas may run different numbers of passes in a step (the groups of a batch plan do), and
every rank of the world must meet in it once.
"""

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from .comm import group_timeout

__all__ = ["check_replicas", "holders", "ReplicaSync"]


def check_replicas(replicas, world):
    """`replicas` as a tuple of tuples of ranks (each replica in increasing order) when they partition the ranks
    0..world-1 into non-empty replicas; InvalidArgumentError naming what is wrong otherwise. Accepts anything with
    a `groups` attribute (a batch plan, its schedule) for its groups."""
    given = replicas
    replicas = getattr(replicas, "groups", replicas)
    if isinstance(replicas, (str, bytes, dict)) or not isinstance(replicas, (list, tuple)) or not replicas:
        raise InvalidArgumentError(f"replicas must be a list of lists of ranks (or a plan with groups), got {given!r}")
    out, seen = [], {}
    for j, ranks in enumerate(replicas):
        if isinstance(ranks, (str, bytes, dict)) or not isinstance(ranks, (list, tuple)) or not ranks:
            raise InvalidArgumentError(f"replicas[{j}] must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise InvalidArgumentError(f"replicas[{j}] holds {r!r}, not a rank of the group (0..{world - 1})")
            if r in seen:
                raise InvalidArgumentError(f"rank {r} is in replicas[{seen[r]}] and replicas[{j}]: each rank holds "
                                           "one replica's part")
            seen[r] = j
        out.append(tuple(sorted(int(r) for r in ranks)))
    missing = [r for r in range(world) if r not in seen]
    if missing:
        raise InvalidArgumentError(f"replicas must hold every rank of the group once; ranks {missing} are in none")
    return tuple(out)


def holders(totals, sizes_of, replicas):
    """The segments of every unit: [(holder ranks, unit index, lo, hi)] in unit order, then offset order, where
    sizes_of(unit index, replica) is the replica's ranks' shard sizes of that unit (in the replica's rank order)
    and a segment [lo, hi) of the unit's flat vector is held by one rank of every replica."""
    out = []
    for u, total in enumerate(totals):
        cuts, owners = {0, total}, []
        for j, ranks in enumerate(replicas):
            at, spans = 0, []
            for r, n in zip(ranks, sizes_of(u, j)):
                if n:
                    spans.append((at, at + n, r))
                    cuts.add(at)
                at += n
            owners.append(spans)
        cuts = sorted(cuts)
        for lo, hi in zip(cuts, cuts[1:]):
            ranks = tuple(sorted(next(r for a, b, r in spans if a <= lo < b) for spans in owners))
            out.append((ranks, u, lo, hi))
    return out


class ReplicaSync:
    """The replicas of one sharded module and the cross-replica gradient sum: every replica's process group (this
    rank's, `group`, is the one its gathers and reduce-scatters run over) and, for this rank, the holder sets it
    belongs to, in the order every rank runs them, each with its process group and its pieces (unit, offset in
    this rank's shard, length). Made collectively: every rank of the world makes every group, in one order.

    sizes_of(unit index, replica index): the replica's ranks' shard sizes of the unit; totals: the units' sizes."""

    def __init__(self, world_group, replicas, sizes_of, totals, rank):
        timeout = group_timeout(world_group)
        kw = {"timeout": timeout} if timeout is not None else {}
        world = dist.get_world_size(world_group)

        def made(ranks):  # the replicas need the world as their parent: its ranks are the global ranks
            return world_group if len(ranks) == world else dist.new_group(ranks=list(ranks), **kw)

        self.replicas = replicas
        self.mine = next(j for j, ranks in enumerate(replicas) if rank in ranks)
        self.group = [made(ranks) for ranks in replicas][self.mine]
        at = replicas[self.mine].index(rank)
        offsets = [sum(sizes_of(u, self.mine)[:at]) for u in range(len(totals))]
        order, pieces = [], {}  # holder sets in order of their first segment: the order of the all-reduces
        for ranks, u, lo, hi in holders(totals, sizes_of, replicas):
            if ranks not in pieces:
                order.append(ranks)
                pieces[ranks] = []
            if rank in ranks:
                pieces[ranks].append((u, lo - offsets[u], hi - lo))
        self.groups = []
        for ranks in order:
            if len(ranks) > 1:  # one replica: nothing to sum
                pg = made(ranks)
                if rank in ranks:
                    self.groups.append((ranks, pg, pieces[ranks]))

    def sync(self, units):
        """Sum each shard's gradient over the replicas, in place: one all-reduce per holder set this rank is in. A
        shard without a gradient (its rank ran no backward through it) takes part with zeros and gets the sum."""
        for unit in units:
            if unit.shard.requires_grad and unit.shard.grad is None and unit.shard.numel():
                unit.shard.grad = torch.zeros_like(unit.shard)
        for _, pg, pieces in self.groups:
            pieces = [p for p in pieces if units[p[0]].shard.requires_grad]  # alike on every rank: agreed per unit
            if not pieces:
                continue
            grads = [units[u].shard.grad for u, _, _ in pieces]
            buf = torch.cat([g[a:a + n] for g, (_, a, n) in zip(grads, pieces)])
            dist.all_reduce(buf, group=pg)
            at = 0
            for g, (_, a, n) in zip(grads, pieces):
                g[a:a + n].copy_(buf[at:at + n])
                at += n
