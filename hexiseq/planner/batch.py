"""Batch plans: a training step's sequences of unequal lengths spread over groups of unequal devices.

A step's global batch holds a few long sequences and many short ones. One sequence spread over every device pays
for communication a short sequence does not need; a group per sequence cannot hold a long one. A batch plan
partitions the devices into groups, gives each sequence to one group, and lets each group run what it holds as one
packed sequence with its own asymmetric layout (the scheduler's plan for that group), the groups side by side; then
the groups' gradients are combined once.

The model of a step (every figure a prediction of the cost model, never a measurement):

- Candidate groups form a tree fixed once per job (process groups are created once, never per step): the whole
  cluster, its nodes halved down to single nodes (at a change of GPU model near the middle when there is one),
  then each node's devices halved down to one (`candidate_groups`), or the caller's own laminar family
  (`groups=`). A plan's groups are one
  cut of that tree: a partition of the devices.
- Inside a group the model states are sharded over the group's devices (ZeRO-3 within the group, so each group
  holds one replica of the states, as HSDP does), and the group runs the sequences it holds as the documents of one
  packed sequence (one pass; the runtime's document mask keeps them apart), as FlexSP's groups do. A pass of S
  tokens whose documents leave P query-key pairs visible costs f + a S + b P on that kind of group, with f, a and
  b read off the cost model for one of two base layouts of the group (see GroupKind): the ring's and the all-to-alls'
  traffic grows with the pass's tokens whatever its documents, attention with its visible pairs. A sequence then
  costs c = a (its tokens) + b (its pairs), additive over what a group holds, and a group pays f per pass. A pass
  holds at most the longest sequence the group fits (found by bisection, to 0.4%); a group given more runs
  several passes, each paying f again. This linear pricing ranks the cuts; the best few are then scored exactly,
  each pass by the scheduler's own plan for its packed sequence or a base of its kind re-balanced to it, whichever
  is faster (BatchPlan.plan_for), and the best so scored is the plan: its step_time_s is the cost model's figure,
  model_step_time_s the linear one.
- The groups then all-reduce their gradients across replicas, hierarchically (each device with the devices of the
  other groups that hold the same part): 2 (G - 1) / G of a device's part over the slowest link between groups, not
  overlapped with compute (the runtime does not yet overlap it: conservative).
- Step time = the slowest group (passes x f + the sum of its sequences' c), plus that synchronisation.

Lower bound (valid under this model for every cut of the tree and every assignment): the longest sequence (with one
f) on its fastest group, and the weighted device-seconds of each sequence on its most economical group spread over
all devices (weights that grow with a device's speed; see BatchPlanner._bound_weights); the synchronisation is
bounded by 0 (one group needs none).

Solving: every uniform cut of the tree is scored (each sequence to a group by the C core's assignment search,
csrc/assign/batch.c); the best is refined by splitting a loaded group into its children or merging children
back into their parent while that shortens the step; the three best cuts, and the whole cluster as one group
(today's path), are scored exactly.
"""

import dataclasses
import json
import math
import time
from typing import List, Sequence, Tuple

import numpy as np

from .. import _core
from .._validate import integer, number
from ..errors import InvalidArgumentError, MemoryFitError
from .cluster import Cluster, device_set
from .batch_kinds import GroupKind, available_cores, exact_pass, rebalanced_pass, run_in_threads
from .batch_plan import BatchPlan
from .packing import first_fit, held_by_group, two_passes, visible_pairs
from .plan import Plan, Strategy, resolve_inputs, strategy_of
from .plan import plan_layout



# ------------------------------------------------------------------------------------------ candidate groups

def candidate_groups(cluster: Cluster) -> List[Tuple[int, ...]]:
    """The tree of candidate groups the planner cuts, parents before children: the whole cluster, its nodes halved
    down to single nodes, each node's devices halved down to one device. A range of nodes is split at a change of
    GPU model or node size when one lies within the middle half of the range (so that groups of one model stay
    whole where the cluster's order allows), else at its middle: a cluster whose models alternate node by node
    still gets groups of 2, 4, ... nodes for sequences no single node holds. Every group is a tuple of device
    indices in increasing order."""
    starts = np.concatenate([[0], np.cumsum([n.count for n in cluster.nodes])])
    kinds = [(n.gpu, n.count, n.intra_gbps) for n in cluster.nodes]
    out, seen = [], set()

    def add(devices):
        t = tuple(int(d) for d in devices)
        if t and t not in seen:
            out.append(t)
            seen.add(t)

    def halve_devices(lo, hi):
        add(range(lo, hi))
        if hi - lo > 1:
            mid = lo + (hi - lo + 1) // 2
            halve_devices(lo, mid)
            halve_devices(mid, hi)

    def halve_nodes(a, b):  # nodes [a, b)
        add(range(starts[a], starts[b]))
        if b - a == 1:
            halve_devices(starts[a], starts[a + 1])
            return
        mid = a + (b - a + 1) // 2
        changes = [k for k in range(a + 1, b) if kinds[k] != kinds[k - 1]]
        if changes:
            near = min(changes, key=lambda k: abs(k - mid))
            if abs(near - mid) * 4 <= b - a:
                mid = near
        halve_nodes(a, mid)
        halve_nodes(mid, b)

    halve_nodes(0, len(cluster.nodes))
    return out


def _tree(groups):
    """(parent index or -1, children lists) of a laminar family listed in any order; raises InvalidArgumentError
    when two groups overlap without one holding the other, or when the largest groups do not cover the devices."""
    sets = [frozenset(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda i: -len(sets[i]))
    parent = [-1] * len(groups)
    for pos, i in enumerate(order):
        for j in reversed(order[:pos]):  # the smallest earlier (larger or equal) group holding i
            if sets[i] <= sets[j] and sets[i] != sets[j]:
                parent[i] = j
                break
            if sets[i] & sets[j] and not sets[i] <= sets[j]:
                raise InvalidArgumentError(f"groups[{i}] and groups[{j}] overlap without one holding the other: "
                                           "candidate groups must nest (each pair disjoint or one inside the other)")
    children = [[] for _ in groups]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    for p, kids in enumerate(children):
        if kids and frozenset().union(*(sets[k] for k in kids)) != sets[p]:
            missing = sorted(sets[p] - frozenset().union(*(sets[k] for k in kids)))
            raise InvalidArgumentError(f"the groups inside groups[{p}] must cover it, so that it can be split; devices "
                                       f"{missing[:8]} are in none of them")
    return parent, children


def _check_groups(groups, n):
    if not isinstance(groups, (list, tuple)) or not groups:
        raise InvalidArgumentError(f"groups must be a non-empty list of device lists, got {groups!r}")
    out = []
    for i, g in enumerate(groups):
        t = device_set(g, n, f"groups[{i}]")
        if t in out:
            raise InvalidArgumentError(f"groups[{i}] repeats groups[{out.index(t)}]: {list(t)}")
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------ the batch

def _lengths(lengths):
    """(total tokens per sequence, documents per sequence or None) of the `lengths` argument."""
    if isinstance(lengths, (str, bytes, dict)) or not hasattr(lengths, "__iter__"):
        raise InvalidArgumentError(f"lengths must be a list with one entry per sequence, got {lengths!r}")
    lengths = list(lengths)
    if not lengths:
        raise InvalidArgumentError("lengths must hold at least one sequence, got an empty list")
    if all(type(x) is int for x in lengths) and 1 <= min(lengths) and max(lengths) <= 1 << 40:
        return np.array(lengths, dtype=np.int64), [None] * len(lengths)  # the common case, checked at once
    total, docs = [], []
    for i, x in enumerate(lengths):
        if isinstance(x, (list, tuple, np.ndarray)):
            parts = list(x)
            if not parts:
                raise InvalidArgumentError(f"lengths[{i}] must be a token count or a non-empty list of document "
                                           "lengths, got an empty list")
            vals = [_one_length(v, f"lengths[{i}][{j}]") for j, v in enumerate(parts)]
            total.append(sum(vals))
            docs.append(tuple(vals))
        else:
            total.append(_one_length(x, f"lengths[{i}]"))
            docs.append(None)
    return np.array(total, dtype=np.int64), docs


def _one_length(x, where):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        else:
            raise InvalidArgumentError(f"{where} must be a whole number of tokens, got {x!r}")
    if x < 1 or x > (1 << 40):
        raise InvalidArgumentError(f"{where} must be between 1 and 2^40 tokens, got {x}")
    return int(x)


class _Rows:
    """A [candidates, sequences] cost matrix held per kind of group (candidates of one kind have equal rows): read
    like the matrix (rows by a list of candidates, or one candidate and some columns) without ever making it, which
    at 1,024 devices would be thousands of rows copied per step."""

    def __init__(self, by_kind, kind_of):
        self.by_kind, self.kind_of = by_kind, kind_of  # [kinds, sequences], [candidates]

    def __getitem__(self, key):
        if isinstance(key, tuple):
            return self.by_kind[self.kind_of[key[0]], key[1]]
        return self.by_kind[self.kind_of[np.asarray(key)]]

    def full(self):
        return self.by_kind[self.kind_of]


def _bundles(cost, most):
    """The items the search ranks cuts with: every sequence alone when there are at most `most`, else the most
    costly `most` / 2 alone and the others dealt out, in decreasing cost, to `most` / 2 bundles (a bundle's cost on a
    group is the sum of its members': the pricing is additive, so a bundle is priced exactly). A list of index
    arrays. Ranking cuts with a few hundred items instead of thousands keeps a step's search in milliseconds; the
    kept cut's final assignment places every sequence on its own."""
    cost = cost.by_kind  # the order depends only on the cheapest group of each sequence
    n = cost.shape[1]
    if n <= most:
        return [np.array([i]) for i in range(n)]
    finite = np.where(np.isinf(cost), np.nan, cost)
    order = np.argsort(-np.nanmin(finite, axis=0), kind="stable")
    alone, rest = order[:most // 2], order[most // 2:]
    return [np.array([i]) for i in alone] + [rest[k::most // 2] for k in range(most // 2)]


def _bundled(members, total, cost):
    """(tokens [items], cost [groups, items] as _Rows) of the bundles."""
    if all(len(m) == 1 for m in members):
        return total, cost
    owner = np.empty(len(total), dtype=np.int64)
    for k, m in enumerate(members):
        owner[m] = k
    summed = np.zeros((cost.by_kind.shape[0], len(members)))
    np.add.at(summed.T, owner, cost.by_kind.T)
    return np.bincount(owner, weights=total, minlength=len(members)).astype(np.int64), _Rows(summed, cost.kind_of)


class BatchPlanner:
    """The job-level half of batch planning: the candidate groups (fixed for the job) and each kind of group's cost
    per length (computed once, on demand); `plan(lengths)` then chooses the groups and the assignment of one step.
    hexiseq.planner.plan_batch is BatchPlanner(...).plan(lengths) for a single step.

    threads: how many kinds of group are priced side by side (default: the cores this process may use). The
    pricing is the first plan's cost (seconds at 128 devices, minutes at 8,192); the plans are the same for any
    count."""

    FINAL_ROUNDS = 16  # local-search rounds of a per-step plan's final assignment (exact=False)
    # rounds of splits and merges refining a per-step plan's best uniform cut: 4, not 6, found the same steps on 16
    # batches of 512 sequences at 128 devices in 18% less time (3 rounds: up to 0.6% longer steps; 2: 3.8%)
    REFINE_ROUNDS = 4
    # at most this many items rank the cuts of a per-step (exact=False) plan (see _bundles). 256 rather than 512:
    # at 128 devices and 512 sequences a step's plan took 13 ms, and 9 ms so; at 1,024 devices and 4,096 sequences
    # 116 ms, and 51 ms so; the steps of five batches moved by -1.2% to +1.5% (the cut ranked first can change)
    RANKED_ITEMS = 256

    def __init__(self, cluster, *, model="gpt-7b", training=None, causal=True, groups=None, threads=None):
        cluster, model, training, _ = resolve_inputs(cluster, model, training, 1024)
        # kinds of group priced side by side (the one-time pricing: seconds to minutes on large clusters); the
        # plans are the same for any count
        self.threads = available_cores() if threads is None else integer(threads, "threads", minimum=1,
                                                                          maximum=1024)
        if training.sequences != 1:
            raise InvalidArgumentError(f"training.sequences must be 1 for a batch plan (the batch says how many "
                                       f"sequences a step holds), got {training.sequences}")
        self.cluster, self.model, self.training, self.causal = cluster, model, training, bool(causal)
        n = cluster.num_devices
        self.groups = candidate_groups(cluster) if groups is None else _check_groups(groups, n)
        self._parent, self._children = _tree(self.groups)
        roots = [i for i, p in enumerate(self._parent) if p < 0]
        covered = sorted(d for i in roots for d in self.groups[i])
        if covered != list(range(n)):
            missing = sorted(set(range(n)) - set(covered))
            raise InvalidArgumentError(f"the candidate groups must cover every device; devices {missing[:8]} are in "
                                       "none")
        self._roots = roots
        self._depth = []
        for g in range(len(self.groups)):
            p, d = self._parent[g], 0
            while p >= 0:
                d, p = d + 1, self._parent[p]
            self._depth.append(d)
        # every uniform cut: the tree's groups at depth d (and the leaves above it), sorted
        self._uniform_cuts = [tuple(g for g in range(len(self.groups)) if self._depth[g] == d or
                                    (self._depth[g] < d and not self._children[g]))
                              for d in range(max(self._depth) + 1)]
        self._kinds = {}   # group description -> GroupKind
        self._kind = []     # candidate index -> its curve
        for g in self.groups:
            sub = cluster.subset(g)
            spec = sub.to_dict()
            for node in spec["nodes"]:  # machines' names do not change what a group costs
                node.pop("host", None)
            key = json.dumps(spec, sort_keys=True)
            if key not in self._kinds:
                self._kinds[key] = GroupKind(sub, model, training, self.causal, self.threads)
            self._kind.append(self._kinds[key])
        self._kinds_list = list({id(k): k for k in self._kind}.values())
        index = {id(k): i for i, k in enumerate(self._kinds_list)}
        self._kind_of = np.array([index[id(k)] for k in self._kind], dtype=np.int64)
        self._kind_size = [len(self.groups[int(np.argmax(self._kind_of == k))]) for k in range(len(self._kinds_list))]
        self._params_bytes = model.params * model.dtype_bytes
        self._weights = self._bound_weights()
        W = [np.array([w[list(g)].sum() for g in self.groups]) for w in self._weights]
        self._least_weight = [np.array([Wg[self._kind_of == k].min() for k in range(len(self._kinds_list))])
                              for Wg in W]
        self._sync_of_cut = {}  # sorted candidate indices -> sync_s of their devices (_cut_sync)
        self._bw = self._link_matrices()

    def __repr__(self):
        return (f"BatchPlanner({self.cluster.describe()}, model={getattr(self.model, 'name', None) or 'custom'}, "
                f"{len(self.groups)} candidate groups of {len(self._kinds_list)} kinds, threads={self.threads})")

    def _bound_weights(self):
        """Device weights for the lower bound. In any cut, device d is busy for the time of its group, so for any
        weights w >= 0: sum_d w_d busy_d <= T sum_d w_d, and sum_d w_d busy_d = sum_i W_g(i) c[g(i), i] >=
        sum_i min_g W_g c[g, i], with W_g the weight of g's devices: T >= that sum / sum_d w_d. Equal weights
        overrate slow devices (they would take a fair share at a fast device's speed); weights growing with the
        device's catalog speed (peak x GEMM efficiency, a node's own figures first) tighten the bound on mixed
        clusters. Each of a few exponents is tried; all are valid."""
        from .cluster import gpu_catalog

        cat = {g["name"]: g for g in gpu_catalog()}
        speed = []
        for node in self.cluster.nodes:
            entry = cat.get(node.gpu, {})
            peak = node.peak_tflops or entry.get("peak_tflops") or 1.0
            eff = node.gemm_eff or entry.get("gemm_eff") or 1.0
            speed += [peak * eff] * node.count
        speed = np.array(speed) / max(speed)
        return [speed ** a for a in (0.0, 0.5, 1.0, 1.5, 2.0)]

    def _link_matrices(self):
        """(bandwidth GB/s, latency s) between every two devices, as the cost model sees the links."""
        c = self.cluster
        n = c.num_devices
        node = c.device_nodes
        if c.bandwidth_gbps is not None:
            bw = np.array(c.bandwidth_gbps, dtype=np.float64)
        else:
            intra = np.array([c.nodes[k].intra_gbps for k in node])
            same = node[:, None] == node[None, :]
            bw = np.where(same, np.minimum(intra[:, None], intra[None, :]), c.inter_node_gbps)
        if c.latency_us is None:
            lat = np.where(node[:, None] == node[None, :], 10.0, 20.0)
        elif isinstance(c.latency_us, float):
            lat = np.full((n, n), c.latency_us)
        else:
            lat = np.array(c.latency_us)
        return bw, lat * 1e-6

    def sync_s(self, groups) -> float:
        """Gradient all-reduce across `groups` (lists of devices): each device reduces its 1/|g| part with the
        devices of the other groups holding the same part, 2 (G - 1) / G of it over the slowest link between two
        groups and 2 (G - 1) latencies of the largest; 0 for one group."""
        G = len(groups)
        if G <= 1:
            return 0.0
        bw, lat = self._bw
        owner = np.full(self.cluster.num_devices, -1, dtype=np.int64)
        for g, devs in enumerate(groups):
            owner[list(devs)] = g
        node = self.cluster.device_nodes
        if self.cluster.bandwidth_gbps is None and self.cluster.latency_us is None and \
                len({int(node[g[0]]) for g in groups}) > 1:
            # groups on different nodes, node-derived links: the slowest link between two groups is the inter-node
            # link or the intra-node link of a node that holds devices of two groups; the default inter-node
            # latency
            held = owner >= 0
            first = np.full(len(self.cluster.nodes), len(groups))
            last = np.full(len(self.cluster.nodes), -1)
            np.minimum.at(first, node[held], owner[held])
            np.maximum.at(last, node[held], owner[held])
            shared = np.nonzero((last >= 0) & (first != last))[0]
            slow = min([self.cluster.inter_node_gbps] + [float(self.cluster.nodes[k].intra_gbps) for k in shared])
            worst = 20e-6
        else:
            across = owner[:, None] != owner[None, :]
            slow, worst = float(bw[across].min()), float(lat[across].max())
        smallest = min(len(g) for g in groups)
        return 2.0 * (G - 1) / G * self._params_bytes / smallest / (slow * 1e9) + 2.0 * (G - 1) * worst

    def _cut_sync(self, cut):
        """sync_s of a cut given as sorted candidate indices, kept per cut (a step's search scores the same cuts
        again and again, and so do the job's later steps)."""
        if cut not in self._sync_of_cut:
            if len(self._sync_of_cut) > 4096:
                self._sync_of_cut.clear()
            self._sync_of_cut[cut] = self.sync_s([self.groups[g] for g in cut])
        return self._sync_of_cut[cut]

    def cost_matrix(self, lengths):
        """(c [candidates, sequences], f [candidates], capacity [candidates]) of the module docstring for a batch
        (`lengths` as in plan): seconds, inf where a candidate group cannot hold a sequence; tokens one pass holds."""
        total, docs = _lengths(lengths)
        cost, fixed, cap, _ = self._cost_matrix(total, docs)
        return cost.full(), fixed, cap

    def _cost_matrix(self, total, docs=None, expect=None, features=False):
        """(c [candidates, sequences], f [candidates], one pass's capacity in tokens [candidates], the base layout
        each candidate's kind prices with). A sequence costs the sum of its documents' costs (they are documents of
        the group's packed pass either way). expect: {id(kind): the tokens of the pass it is priced for}; by default
        a group's devices' share of the batch. features: a pass holds what the memory features let it hold, whatever
        the batch (by default only when a sequence needs them)."""
        docs = docs if docs is not None else [None] * len(total)
        if all(d is None for d in docs):
            flat, owner = total, None
        else:
            flat = np.array([L for t, d in zip(total, docs) for L in (d if d is not None else (int(t),))],
                            dtype=np.int64)
            owner = np.repeat(np.arange(len(total)), [len(d) if d is not None else 1 for d in docs])
        pairs = visible_pairs(flat, self.causal)
        tokens, visible, longest = float(flat.sum()), float(pairs.sum()), int(total.max(initial=0))
        K = len(self._kinds_list)
        coef = np.zeros((K, 2))  # a, b of each kind: every kind's row made at once below
        f_k, cap_k, base_k, cut_off = np.zeros(K), np.ones(K, dtype=np.int64), [None] * K, np.zeros(K)
        n = self.cluster.num_devices
        # the pass size each kind is priced for: by default its devices' share of the batch
        sizes = [(expect or {}).get(id(kind), float(total.sum()) * self._kind_size[k] / n)
                 for k, kind in enumerate(self._kinds_list)]
        # kinds not priced yet for it are priced side by side first, the largest groups (the longest searches) first
        todo = sorted((k for k, kind in enumerate(self._kinds_list) if not kind.priced(sizes[k])),
                      key=lambda k: -self._kind_size[k])
        run_in_threads(lambda k: self._kinds_list[k].coefficients(tokens, visible, sizes[k]), todo, self.threads)
        for k, kind in enumerate(self._kinds_list):
            got = kind.coefficients(tokens, visible, sizes[k])
            if got is None:
                continue  # holds nothing: its row stays inf (cut_off 0)
            coef[k] = got[0] * kind.correction, got[1] * kind.correction
            f_k[k], base_k[k], cut_off[k] = got[2] * kind.correction, got[3], kind.longest
            # one pass holds what fits without memory features, unless the batch has a sequence only they let the
            # kind hold (their cost is priced as if absent: the linear pricing is made without them)
            cap_k[k] = max(kind.longest if features or longest > kind.anchor else kind.anchor, 1)
        per_doc = coef[:, :1] * flat[None, :] + coef[:, 1:] * pairs[None, :]
        if owner is None:
            rows = per_doc
        else:
            rows = np.zeros((K, len(total)))
            np.add.at(rows.T, owner, per_doc.T)
        rows[total[None, :] > cut_off[:, None]] = math.inf
        return _Rows(rows, self._kind_of), f_k[self._kind_of], cap_k[self._kind_of], \
            [base_k[k] for k in self._kind_of]

    def tree(self):
        """(parent index or -1, children indices) of each candidate group."""
        return list(self._parent), [list(c) for c in self._children]

    def plan(self, lengths, *, time_limit_s=None, exact=True, reprice=None, split_documents=False) -> BatchPlan:
        """Choose this step's groups (a cut of the candidate tree) and give each sequence to one of them.

        split_documents: the documents of a packed sequence (an entry of `lengths` that lists them) may go to
        different groups, cut at their boundaries (each is then a sequence of the plan; `origin` says where it came
        from, `split_batch` cuts a batch's tensors so, `per_caller_sequence` sums figures back). False keeps a packed
        sequence whole, in one group. Documents never see each other either way (the runtime masks them apart), so
        a split changes where they run, not what is computed.

        exact: score the best few cuts exactly (each pass re-balanced from its kind's base layouts) and keep the best
        so scored; False keeps the search's best under the linear pricing and skips those re-balances (the per-step
        mode: group_time_s is then the linear pricing; each pass is still resolved, the fastest of its kind's
        base layouts re-balanced to it, so that the runtime plans nothing).
        reprice: price the kinds again for the passes the first search gave them, and (with exact) learn from the
        exact scores how far each kind's pricing is off and search again (the planner keeps what it learnt for the
        next steps); False: one search under the pricing as it stands (with what earlier exact plans taught it).
        Default: as `exact` (a job plans exactly now and then, and quickly every step in between)."""
        for name, flag in (("split_documents", split_documents), ("exact", exact), ("reprice", reprice)):
            if not isinstance(flag, (bool, np.bool_)) and not (name == "reprice" and flag is None):
                raise InvalidArgumentError(f"{name} must be True or False, got {flag!r}")
        if split_documents:
            total, docs = _lengths(lengths)
            origin = [(i, j) for i, d in enumerate(docs) for j in range(len(d) if d is not None else 1)]
            if len(origin) > len(total):  # else nothing to split: the plain plan below
                flat = [int(L) for t, d in zip(total, docs) for L in (d if d is not None else (int(t),))]
                bp = self.plan(flat, time_limit_s=time_limit_s, exact=exact, reprice=reprice)
                out = dataclasses.replace(bp, origin=tuple(origin))
                out.schedule  # as below: made in the planner's time
                return out
        reprice = exact if reprice is None else bool(reprice)
        t0 = time.perf_counter()
        time_limit_s = number(time_limit_s, "time_limit_s", positive=True, optional=True)
        total, docs = _lengths(lengths)
        cost, fixed, cap, base = self._cost_matrix(total, docs)
        f_kind = np.zeros(len(self._kinds_list))
        f_kind[self._kind_of] = fixed  # a kind's candidates share their f
        best_single = (cost.by_kind + f_kind[:, None]).min(axis=0)
        if np.isinf(best_single).any():
            i = int(np.argmax(np.isinf(best_single)))
            raise MemoryFitError(f"lengths[{i}] = {int(total[i]):,} tokens fits no candidate group of "
                                 f"{self.cluster.describe()} (the largest is the whole cluster: plan it alone with "
                                 "hexiseq.plan to see what would fit)")
        bound = float(best_single.max())
        for w, least in zip(self._weights, self._least_weight):  # any w >= 0 gives a bound: see _bound_weights
            # min over groups of W_g c_g: groups of a kind share c, so the kind's lightest group is the one to take
            bound = max(bound, float((cost.by_kind * least[:, None]).min(axis=0).sum() / w.sum()))
        deadline = None if time_limit_s is None else t0 + time_limit_s

        # Round 1 prices each kind of group for the pass it can expect from its share of the batch; round 2 again,
        # for the passes the groups of round 1's best cut were given (a kind's bases and its linear pricing are
        # made for one pass size, and the share is a crude guess of it). Both rounds' best cuts are finalists.
        prices, expect = [(cost, fixed, cap, base)], None
        # per-step plans rank cuts with bundles of the short sequences (milliseconds); exact plans with every one
        members = _bundles(cost, self.RANKED_ITEMS if not exact else len(total))
        # per-step plans refine the best uniform cut for a few rounds (each round a handful of assignment searches)
        scored = self._search(*_bundled(members, total, cost), fixed, cap, deadline, 0,
                              None if exact else self.REFINE_ROUNDS)
        first = min(scored, key=lambda c: scored[c][0])
        round_one = sorted(scored, key=lambda c: scored[c][0])[:3]  # always finalists: re-pricing never loses them
        if reprice and not math.isinf(scored[first][0]) and (deadline is None or time.perf_counter() < deadline):
            group_of = scored[first][1][0]
            items = _bundled(members, total, cost)[0]
            expect = {}
            for k, g in enumerate(first):
                held = float(items[group_of == k].sum())
                if held > 0:
                    kind = id(self._kind[g])
                    expect[kind] = max(expect.get(kind, 0.0), held)
            prices.append(self._cost_matrix(total, docs, expect))
            scored2 = self._search(*_bundled(members, total, prices[1][0]), *prices[1][1:3], deadline, 1)
            # a cut scored in both rounds keeps the lower price (both are estimates of the same thing)
            for c, v in scored2.items():
                if c not in scored or v[0] < scored[c][0]:
                    scored[c] = v
        limit = 0.0 if time_limit_s is None else max(1e-3, time_limit_s / 4)
        plans, tried, stopped = [], set(), False
        searched = min(v[0] for v in scored.values())
        for correction_round in range(3 if exact else 1):
            finalists = [c for c in sorted(scored, key=lambda c: scored[c][0]) if c not in tried][:3 if exact else 1]
            if correction_round == 0 and exact:
                finalists += [c for c in round_one if c not in finalists]
            for r in self._roots:
                if exact and (r,) in scored and not math.isinf(scored[(r,)][0]) and (r,) not in finalists and \
                        (r,) not in tried and len(self._roots) == 1:
                    finalists.append((r,))
            for cut in finalists:
                if plans and deadline is not None and time.perf_counter() >= deadline:
                    stopped = True  # the best of the cuts scored so far (scoring one takes what it takes)
                    break
                tried.add(cut)
                c, f, cp, _ = prices[scored[cut][2]]
                # per-step plans: a count of local-search rounds (the full search took 52 of a 108 ms step at 1,024
                # devices and 3,497 sequences for a step 0.004% shorter than 16 rounds give in 8 ms)
                assigned = self._assign(total, c, f, cp, list(cut), limit, quick=not exact,
                                        rounds=0 if exact else self.FINAL_ROUNDS)
                if assigned is not None:
                    plans.append(self._build(list(cut), assigned, total, docs, c, f, cp, bound, t0, exact))
            if not exact or not reprice or (deadline is not None and time.perf_counter() >= deadline):
                break
            # The exact scores teach each kind how far its linear pricing is off (a layout re-balanced to a mix of
            # documents it was not made for can be much slower, or a fresh plan much faster): kinds scored off by
            # more than 10% are re-priced by that ratio and the search runs again, its new finalists scored too.
            if not self._learn(plans[-len(finalists):] if finalists else []):
                break
            prices.append(self._cost_matrix(total, docs, expect if len(prices) > 1 else None))
            for k, v in self._search(*_bundled(members, total, prices[-1][0]), *prices[-1][1:3], deadline,
                                     len(prices) - 1).items():
                if k not in tried:
                    scored[k] = v
        longer = exact and reprice and any(k.longest and k.longest > k.anchor for k in self._kinds_list)
        late = deadline is not None and time.perf_counter() >= deadline and bool(plans)
        stopped |= longer and late
        if longer and not late:
            # Passes as long as the memory features allow. The linear pricing takes the features as free, so it
            # packs passes at the capacity without them; where that is a little short of two sequences a group
            # pays its per-pass cost (the parameter gathers) twice, when one pass with the features would often be
            # faster (64 x 128K of a 70B model on 2,048 mixed GPUs: 34.9 s scored, the features' passes 38.3 s;
            # other batches the other way round). Searched again with the longer passes; the exact scores decide.
            prices.append(self._cost_matrix(total, docs, expect, features=True))
            longer = self._search(*_bundled(members, total, prices[-1][0]), *prices[-1][1:3], deadline,
                                  len(prices) - 1)
            for cut in sorted(longer, key=lambda c: longer[c][0])[:2]:
                assigned = self._assign(total, *prices[-1][:3], list(cut), limit, quick=False)
                if assigned is not None:
                    plans.append(self._build(list(cut), assigned, total, docs, *prices[-1][:3], bound, t0))
        if not plans:
            raise MemoryFitError("no cut of the candidate groups holds every sequence of this batch")
        best_plan = min(plans, key=lambda p: p.step_time_s)
        by_count = {}  # groups -> (step, scored exactly): an exactly scored plan where one was made, else the pricing
        for cut, v in scored.items():
            if len(cut) not in by_count or float(v[0]) < by_count[len(cut)][0]:
                by_count[len(cut)] = (float(v[0]), False)
        exact_best = {}
        for p in plans:
            exact_best[len(p.groups)] = min(exact_best.get(len(p.groups), math.inf), p.step_time_s)
        by_count.update({k: (t, True) for k, t in exact_best.items()})
        out = dataclasses.replace(best_plan, solve_s=time.perf_counter() - t0, searched_s=searched,
                                  stopped_early=stopped,
                                  alternatives=tuple((k, t, e) for k, (t, e) in sorted(by_count.items())))
        out.schedule  # made here, in the planner's time, with the fingerprint the runtime compares at every step
        return out

    def _learn(self, plans):
        """Set each kind's correction (the factor on its linear pricing) from exactly scored plans: the largest
        ratio of exact to linear time among its groups. True when some kind's correction moved by more than 10%."""
        ratios = {}
        for p in plans:
            for g, devs in enumerate(p.groups):
                if p.model_group_time_s[g] > 0 and math.isfinite(p.group_time_s[g]):
                    kind = self._kind[self.groups.index(devs)]
                    r = p.group_time_s[g] / p.model_group_time_s[g]
                    ratios[id(kind)] = (kind, max(r, ratios.get(id(kind), (kind, 0.0))[1]))
        moved = False
        for kind, r in ratios.values():
            new = min(max(kind.correction * r, 0.25), 4.0)
            if abs(new / kind.correction - 1.0) > 0.1:
                kind.correction, moved = new, True
        return moved

    def _assign(self, total, cost, fixed, cap, rows, limit, quick=True, rounds=0):
        """(group_of, times, info, passes) of the cut `rows`: every group runs what it holds as one packed pass of
        at most its capacity, or, when the batch does not fit so, in `passes` such passes each; None when no
        assignment is found. With several passes the search sees each group's capacity times the passes in
        aggregate, which whole sequences may not reach (three sequences of 128K in passes of 250K make three passes,
        not two): the times returned are those of the passes first-fit packing makes (as _build packs them), and
        the assignment is also searched with each capacity rounded down to whole longest sequences, the better of
        the two kept."""
        c = np.ascontiguousarray(cost[rows])
        f, cp = fixed[rows], cap[rows]

        def search(capacity):
            passes = max(1, -(-int(total.sum()) // int(capacity.sum())))
            while passes <= 1024:
                try:
                    out = _core.batch_assign(c, f * passes, total, capacity * passes, limit, quick, rounds)
                    return out + (passes,)
                except MemoryFitError:
                    passes *= 2
            return None

        def faster(found, other):
            """`other`, its times those of its packed passes, where its slowest group beats found's."""
            if other is None:
                return found
            other = self._packed(other, total, c, f, cp)
            return other if other[1].max() < found[1].max() else found

        found = search(cp)
        if found is None or found[3] == 1:
            return found
        found = self._packed(found, total, c, f, cp)
        longest = int(total.max())
        whole = cp // longest * longest
        if (whole > 0).all() and (whole < cp).any():
            found = faster(found, search(whole))
        # One pass count for every group holds a fast group to the passes the slow ones need (5,000 sequences of
        # 100-4,000 tokens on 4 H100 and two groups of 2 A100: the H100 group ended a third of a pass short while
        # the A100 groups set the step). Also searched: each group with the passes its share of the batch at equal
        # time needs (its tokens a second against the others'), 5% over so the search can still move sequences.
        fits = np.isfinite(c)
        per_token = np.array([c[k, fits[k]].sum() / max(float(total[fits[k]].sum()), 1.0) for k in range(len(c))])
        if (per_token > 0).all():
            share = (1.0 / per_token) / (1.0 / per_token).sum() * float(total.sum())
            own = np.maximum(1, np.ceil(1.05 * share / np.maximum(cp, 1))).astype(np.int64)
            if (own != found[3]).any():
                try:
                    other = _core.batch_assign(c, f * own, total, cp * own, limit, quick, rounds) + (int(own.max()),)
                except MemoryFitError:
                    other = None
                found = faster(found, other)
        return found

    @staticmethod
    def _packed(found, total, c, f, cap):
        """`found` with each group's time that of the passes its sequences make packed first fit by decreasing
        length into its capacity (_build packs them so): passes x f plus what the group holds."""
        group_of, times, info, passes = found
        times = np.array(times, dtype=np.float64)
        for k, held in enumerate(held_by_group(group_of, len(times))):
            times[k] = len(first_fit(held, total, int(cap[k]))) * float(f[k]) + float(c[k, held].sum()) if held \
                else 0.0
        return group_of, times, info, passes

    def _search(self, total, cost, fixed, cap, deadline, pricing=0, rounds=None):
        """{cut (sorted group indices): (step under this pricing, the assignment found, which pricing)} of the cuts
        the search scored: every uniform cut, then splits of loaded groups and merges of light families while that
        shortens the step."""
        scored = {}

        # the greedy placement and a few rounds of local search: enough to rank cuts. A count of rounds, not a time
        # limit: every rank of a job plans its steps itself and must choose the same cut whatever its load
        rank_rounds = max(1, min(4, 1000 // max(len(total), 1)))

        seen = {}

        def score(cut):
            """(step, the assignment found) of a cut given as sorted candidate indices (the assignment's groups in
            that order); each cut searched once (the refinement's splits and merges come back to cuts it scored)."""
            if cut in seen:
                return seen[cut]
            res = self._assign(total, cost, fixed, cap, list(cut), 0.0, rounds=rank_rounds)
            if res is None:
                seen[cut] = (math.inf, None)
                return seen[cut]
            step = float(res[1].max()) + self._cut_sync(cut)
            scored[cut] = (step, (res[0], res[1]), pricing)
            seen[cut] = (step, res)
            return seen[cut]

        # every uniform cut: the tree's groups at depth d (and the leaves above it)
        best_cut, best = None, (math.inf, None)
        for cut in self._uniform_cuts:
            s = score(cut)
            if s[0] < best[0]:
                best_cut, best = cut, s
        if best_cut is None:
            raise MemoryFitError("no cut of the candidate groups holds every sequence of this batch")
        # refine: split a loaded group into its children, or merge children back into their parent
        improved, done = True, 0
        while improved and (deadline is None or time.perf_counter() < deadline) and (rounds is None or done < rounds):
            improved, done = False, done + 1
            cut = list(best_cut)
            times = best[1][1]
            order = sorted(range(len(cut)), key=lambda k: -times[k])
            moves = []  # a few per round (each is one assignment search): the 3 most loaded groups split, and
            for k in [k for k in order if self._children[cut[k]]][:3]:  # the 3 least loaded families merged
                moves.append(tuple(sorted(cut[:k] + cut[k + 1:] + self._children[cut[k]])))
            members, load = set(cut), dict(zip(cut, times))
            families = [p for p in {self._parent[g] for g in cut if self._parent[g] >= 0}
                        if all(ch in members for ch in self._children[p])]
            for p in sorted(families, key=lambda p: max(load[ch] for ch in self._children[p]))[:3]:
                moves.append(tuple(sorted([g for g in cut if g not in self._children[p]] + [p])))
            for m in moves:
                sc = score(m)
                if sc[0] < best[0] * (1 - 1e-9):
                    best_cut, best, improved = m, sc, True
        return scored

    def _build(self, cut, assigned, total, docs, cost, fixed, cap, bound, t0, exact=True):
        """The BatchPlan of a cut and its assignment, every pass scored exactly (or, exact=False, priced linearly and
        resolved from its kind's bases)."""
        group_of, _, info, _ = assigned
        # groups in device order; sequences renumbered to them. Each group's passes: its sequences packed first fit
        # by decreasing length into passes of its capacity (the search priced passes x capacity in aggregate, which
        # a packing may not reach); its time is then priced with the passes it really makes.
        order = sorted(range(len(cut)), key=lambda k: self.groups[cut[k]])
        rank = {k: r for r, k in enumerate(order)}
        groups = tuple(self.groups[cut[k]] for k in order)
        assignment = tuple(rank[int(g)] for g in group_of)
        packs, model_time, exact_time, pass_plans = [], [], [], []
        held = held_by_group(assignment, len(order))
        for r, k in enumerate(order):
            seqs = held[r]
            bins = first_fit(seqs, total, int(cap[cut[k]]))
            packs.append(tuple(tuple(sorted(b)) for b in bins))
            model_time.append(len(bins) * float(fixed[cut[k]]) + float(cost[cut[k], seqs].sum()))
        if exact:  # every pass of every group planned, side by side (each plan is the pass's own, clock-free)
            jobs = [(r, j) for r in range(len(order)) for j in range(len(packs[r]))]
            scored = {}

            def score(job):
                r, j = job
                kind, items = self._kind[cut[order[r]]], packs[r][j]
                whole = exact_pass(kind, [L for i in items for L in (docs[i] or (int(total[i]),))])
                scored[job] = [(items, whole)]
                # A pass packed past half the group's capacity can be memory-bound: its layout then gives devices
                # the tokens their memory holds, not their speed's share, and a token costs up to 1.75x what it
                # costs in a pass of half the length (gpt-7b on two nodes of H100 and A100-80G, 0.75-1.0 of the
                # capacity against 0.25-0.5), which the linear pricing, fitted below the capacity, does not see.
                # Such a pass, and one scored more than 10% above its linear price, is also scored as two passes,
                # kept when faster (each pays the pass's fixed cost).
                k = cut[order[r]]
                linear = float(fixed[k]) + float(cost[k, list(items)].sum())
                if len(items) < 2 or (2 * sum(int(total[i]) for i in items) <= int(cap[k]) and whole is not None
                                      and whole.step_time_s <= 1.1 * linear):
                    return
                halves = two_passes(items, total)
                plans = [exact_pass(kind, [L for i in h for L in (docs[i] or (int(total[i]),))]) for h in halves]
                if all(p is not None for p in plans) and (whole is None or sum(p.step_time_s for p in plans) <
                                                          whole.step_time_s):
                    scored[job] = list(zip(halves, plans))

            run_in_threads(score, sorted(jobs, key=lambda job: -len(groups[job[0]])), self.threads)
            for r in range(len(order)):
                made = [x for j in range(len(packs[r])) for x in scored[(r, j)]]
                packs[r] = tuple(tuple(sorted(items)) for items, _ in made)
                plans = [p for _, p in made]
                pass_plans.append(tuple(plans))
                exact_time.append(sum(math.inf if p is None else p.step_time_s for p in plans))
        else:  # every pass resolved now, side by side, from its kind's bases: the runtime only reads them
            jobs = [(r, j) for r in range(len(order)) for j in range(len(packs[r]))]
            resolved = {}

            def resolve(job):
                r, j = job
                kind = self._kind[cut[order[r]]]
                pass_docs = [L for i in packs[r][j] for L in (docs[i] or (int(total[i]),))]
                resolved[job] = rebalanced_pass(kind, pass_docs) or exact_pass(kind, pass_docs)

            run_in_threads(resolve, sorted(jobs, key=lambda job: -len(groups[job[0]])), self.threads)
            missing = [job for job, p in resolved.items() if p is None]
            if missing:
                r, j = missing[0]
                raise MemoryFitError(f"no layout of group {r} (devices {list(groups[r])}) holds its pass {j} "
                                     f"({sum(int(total[i]) for i in packs[r][j]):,} tokens)")
            pass_plans = [tuple(resolved[(r, j)] for j in range(len(packs[r]))) for r in range(len(order))]
            exact_time = list(model_time)
        sync = self._cut_sync(tuple(sorted(cut)))
        return BatchPlan(self.cluster, self.model, self.training, self.causal, groups, assignment,
                         tuple(int(x) for x in total), tuple(docs), tuple(exact_time), sync, max(exact_time) + sync,
                         bound, len(self.groups), time.perf_counter() - t0, bool(info["exact"]), tuple(packs),
                         tuple(int(cap[cut[k]]) for k in order), tuple(model_time), math.nan, tuple(pass_plans),
                         scored=bool(exact))


def plan_batch(cluster, *, model="gpt-7b", lengths: Sequence, training=None, causal=True, groups=None,
               time_limit_s=None, split_documents=False, exact=True) -> BatchPlan:
    """The batch plan of one training step: `lengths` holds one entry per sequence of the global batch, a token
    count or the list of the document lengths packed in it (its documents stay together, in one group, unless
    split_documents allows them to go to different groups, cut at their boundaries: see BatchPlanner.plan). The devices
    are split into groups drawn from a tree of candidates (`groups=`: the caller's own, a list of device lists that
    nest; default: `candidate_groups(cluster)`), each sequence goes to one group, each group runs what it holds as
    one packed sequence with the scheduler's layout for that group, and the step's predicted time is the slowest
    group plus the gradient synchronisation across groups. See hexiseq.planner.batch for the model.
    For many steps of one job, build a BatchPlanner once and call its plan(lengths) per step: the groups' costs
    are computed once. exact: as for BatchPlanner.plan (False: the per-step mode, priced linearly, milliseconds).

    Raises MemoryFitError when a sequence fits no candidate group; InvalidArgumentError for bad lengths or groups."""
    return BatchPlanner(cluster, model=model, training=training, causal=causal, groups=groups).plan(
        lengths, time_limit_s=time_limit_s, split_documents=split_documents, exact=exact)


# Above this many devices pricing the candidate groups takes minutes (about 5 for 8,192 on 2 cores, the kinds
# priced side by side), too long to run unasked beside a plan that takes milliseconds: plan(..., batch=True) runs it.
BATCH_AUTO_UP_TO = 1024


def batch_alternative(cluster, model, training, seq_len, causal, chosen, time_limit_s=None, force=False):
    """For several sequences per step, the batch plan of those sequences when it is predicted faster than `chosen`
    (one layout over every device, run once per sequence), or always with force; else None (one sequence, more than
    BATCH_AUTO_UP_TO devices without force, no faster grouping, or no group holds a sequence)."""
    if training.sequences < 2 or (cluster.num_devices > BATCH_AUTO_UP_TO and not force):
        return None
    one = dataclasses.replace(training, sequences=1)
    try:
        bp = plan_batch(cluster, model=model, lengths=[seq_len] * training.sequences, training=one, causal=causal,
                        time_limit_s=time_limit_s)
    except MemoryFitError:
        return None
    return bp if force or bp.step_time_s < chosen.step_time_s else None


def plan(cluster, *, model="gpt-7b", seq_len=131072, strategy="auto", training=None, causal=True,
         time_limit_s=None, documents=None, batch="auto") -> Plan:
    """The plan of one training step: `training.sequences` sequences of `seq_len` tokens of `model` on `cluster`.

    The result is a hexiseq.Plan: groups of devices x passes. Of one group of every device (one layout, run once
    per sequence) it answers for its layout (`layout`, `devices`, `positions`, `shard`, `rebalanced`, ...) and runs
    through every door (hexiseq.nn.HexiSeqAttention, hexiseq.hf.patch_model, HexiSeqTrainer, measure). Of several
    groups (a hexiseq.planner.BatchPlan) each group runs some of the sequences whole with its own layout, data
    parallel across groups: it runs through hexiseq.nn.BatchContext, and `plan.plan_for(g, p)` is the plan of one
    layout group g runs its pass p with.

    cluster: a Cluster, a dict (Cluster.from_dict) or a YAML/JSON file path.
    model: a Model, a preset name ("gpt-7b", "llama3-70b", "7b", ...), a dict, or the path of a Hugging Face
    config.json (or of its folder).
    seq_len: tokens per sequence (an int, or "128k", "1m").
    strategy: "auto" (best of all; the scheduler's plan unless a baseline is strictly faster), "hexiseq"
        (the asymmetric scheduler), "ring", "ulysses" or "usp".
    training: a Training (sequences per step, checkpointing, sharding, reserved memory).
    documents: None (one causal document per sequence) or the lengths of the documents packed into each
        sequence, in sequence order, adding up to seq_len: the cost model counts the pairs the document mask
        leaves visible and the scheduler balances by them, choosing zigzag or contiguous chunks
        (`plan.layout.chunking`). Documents change every batch: `plan.rebalanced(documents)` re-plans the
        sequence split of a plan's structure in milliseconds.
    time_limit_s: None (search to the end) or seconds: the search stops at about this time with the best plan
        found so far, marked `stopped_early` (a first valid plan is always completed, so a tiny limit on a huge
        cluster may take longer). "auto" shares the limit among the strategies.
    batch: for several sequences a step (training.sequences > 1), whether the step may run on groups of devices
        instead of one layout over every device: "auto" (default) returns the plan of groups when it is predicted
        faster, on clusters of up to BATCH_AUTO_UP_TO devices; True returns it on any cluster; False the one
        layout. Only with strategy "auto" and without documents (a batch of unequal sequences:
        hexiseq.planner.plan_batch). Pricing the candidate groups takes seconds to minutes on 2 cores (9 s at 128
        devices, 39 s at 1,024, about 5 minutes at 8,192): a job planning steps should keep a
        hexiseq.BatchPlanner, which prices once and then plans a step in milliseconds.

    Ctrl-C (SIGINT) stops a long search within a fraction of a second with KeyboardInterrupt.

    Raises MemoryFitError naming the device that is short when no layout fits, with what would fit (model
    states per device, the longest sequence that fits, with and without checkpointing: see MemoryFitError);
    UnsupportedError when the strategy has no valid layout (e.g. Ulysses with heads not divisible by the device
    count)."""
    if not (batch is True or batch is False or (isinstance(batch, str) and batch == "auto")):
        raise InvalidArgumentError(f"batch must be 'auto', True or False, got {batch!r}")
    strategy = strategy_of(strategy)
    groups_allowed = strategy is Strategy.AUTO and documents is None
    if batch is True and not groups_allowed:
        raise InvalidArgumentError(f"batch=True plans groups with the 'auto' strategy and no documents, got strategy "
                                   f"{strategy.value!r}" + (" and documents" if documents is not None else ""))
    cluster, model, training, seq_len = resolve_inputs(cluster, model, training, seq_len)
    chosen = plan_layout(cluster, model=model, seq_len=seq_len, strategy=strategy, training=training, causal=causal,
                         time_limit_s=time_limit_s, documents=documents)
    if batch is False or not groups_allowed:
        return chosen
    grouped = batch_alternative(cluster, model, training, seq_len, bool(causal), chosen, time_limit_s,
                                force=batch is True)
    return chosen if grouped is None else grouped

