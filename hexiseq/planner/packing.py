"""How a group's sequences make passes: sequences packed first fit into passes of a group's capacity, split into two
passes of about equal tokens, and the query-key pairs a document leaves visible (what attention costs in a pass).
Plain arithmetic on lengths, shared by the batch planner (hexiseq.planner.batch) and its pricing of kinds of group
(hexiseq.planner.batch_kinds)."""

import numpy as np


def visible_pairs(L, causal):
    """Query-key pairs a document of L tokens leaves visible."""
    L = np.asarray(L, dtype=np.float64)
    return L * (L + 1) / 2 if causal else L * L


def held_by_group(group_of, n_groups):
    """The items of each group, in item order, from the group of each item (one pass over them)."""
    held = [[] for _ in range(n_groups)]
    for i, g in enumerate(group_of):
        held[g].append(i)
    return held


def first_fit(items, total, cap):
    """`items` (indices into `total`) packed first fit by decreasing length into passes of `cap` tokens: the list of
    passes, each a list of items (one pass when they fit together)."""
    if not items:
        return []
    if sum(int(total[i]) for i in items) <= cap:
        return [sorted(items, key=lambda i: -int(total[i]))]
    bins, room = [], []
    for i in sorted(items, key=lambda i: -int(total[i])):
        L = int(total[i])
        for j, r in enumerate(room):
            if r >= L:
                break
        else:
            j = len(bins)
            bins.append([])
            room.append(cap)
        bins[j].append(i)
        room[j] -= L
    return bins


def two_passes(items, total):
    """`items` (indices into `total`) in two passes of about equal tokens: longest first, each to the lighter pass."""
    out, load = ([], []), [0, 0]
    for i in sorted(items, key=lambda i: -int(total[i])):
        k = 0 if load[0] <= load[1] else 1
        out[k].append(i)
        load[k] += int(total[i])
    return [sorted(b) for b in out if b]
