"""Where a plan's layout puts a sequence's tokens, as plain data: the positions each rank holds, its shard of a
full-sequence tensor, and the full sequence again from every rank's shard.

No planning and no processes: a layout (hexiseq.Layout, or anything with its arrays group_size, group_seq, device,
tokens and chunking) in, positions out. The planner's Plan answers through these functions (Plan.positions, shard,
unshard, group_chunks) and the runtime calls them on a plan's layout, so that executing a plan needs nothing of
the planner. Rank r is cluster device r; a layout's slot s holds device layout.device[s]."""

import numpy as np

from . import _core
from .errors import InvalidArgumentError


def slot(layout, rank, num_devices: int) -> int:
    """The layout slot of `rank` (a device id in [0, num_devices))."""
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_devices:
        raise InvalidArgumentError(f"rank must be a device id in [0, {num_devices}), got {rank!r}")
    found = np.flatnonzero(layout.device == rank)
    if len(found) != 1:
        raise InvalidArgumentError(f"rank {rank} is not a device of the layout")
    return int(found[0])


def chunks(layout) -> list:
    """Every group's positions as contiguous chunks, in ring order: chunks(layout)[g] = [(first position, length),
    ...] in the order group g's members' shares are laid out, as the core lays them out (hexiseq_layout_spans: the
    front chunk then, under zigzag chunking, the mirrored back chunk). Computed once per layout (its arrays are
    read-only) and kept on it."""
    key = (layout.chunking, layout.group_seq.tobytes())
    kept = getattr(layout, "__dict__", {}).get("_geometry_chunks")
    if kept is not None and kept[0] == key:
        return kept[1]
    f0, fn, b0, bn = (a.tolist() for a in _core.layout_spans(layout.group_seq, _core.CHUNKINGS[layout.chunking]))
    out = [[(p, n) for p, n in ((f0[g], fn[g]), (b0[g], bn[g])) if n > 0] for g in range(len(f0))]
    if hasattr(layout, "__dict__"):
        layout.__dict__["_geometry_chunks"] = (key, out)
    return out


def group_of_slot(layout, s: int) -> int:
    """The group (index in ring order) of layout slot s."""
    return int(np.searchsorted(np.cumsum(layout.group_size), s, side="right"))


def slot_positions(layout, s: int, group_chunks=None) -> np.ndarray:
    """The absolute positions slot s holds, in the order of its shard (int64). group_chunks: chunks(layout)[g] of
    the slot's group when the caller has it."""
    g = group_of_slot(layout, s)
    first = int(np.sum(layout.group_size[:g]))
    start = int(layout.tokens[first:s].sum())
    want = int(layout.tokens[s])
    parts = []
    for p0, n in (group_chunks if group_chunks is not None else chunks(layout)[g]):
        if want == 0:
            break
        if start >= n:  # this chunk lies before the slot's share
            start -= n
            continue
        take = min(n - start, want)
        parts.append(np.arange(p0 + start, p0 + start + take, dtype=np.int64))
        want -= take
        start = 0
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def positions(layout, rank, num_devices: int) -> np.ndarray:
    """The absolute positions of the tokens `rank` holds, in the order of its shard; empty for a rank the layout
    parks (no tokens)."""
    return slot_positions(layout, slot(layout, rank, num_devices))


def tokens(layout, rank, num_devices: int) -> int:
    """How many tokens `rank` holds."""
    return int(layout.tokens[slot(layout, rank, num_devices)])


def axis(dim, ndim: int, what: str) -> int:
    """An axis of a tensor of `ndim` dimensions, negative counting from the end as NumPy and torch do."""
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or not -ndim <= dim < ndim:
        raise InvalidArgumentError(f"dim must be an axis of {what} ({ndim} dimension(s): in [{-ndim}, {ndim})), "
                                   f"got {dim!r}")
    return int(dim) % ndim


def take(x, idx, dim: int, seq_len: int):
    """The positions `idx` of a full-sequence tensor or array `x` (seq_len positions along `dim`), in that order."""
    if not hasattr(getattr(x, "shape", None), "__len__"):
        raise InvalidArgumentError(f"x must be an array or a tensor, got {type(x).__name__}")
    dim = axis(dim, len(x.shape), "x")
    if x.shape[dim] != seq_len:
        raise InvalidArgumentError(f"x has {x.shape[dim]} positions along dim {dim}, the plan {seq_len}")
    if hasattr(x, "index_select"):  # torch
        import torch

        return x.index_select(dim, torch.as_tensor(idx, device=x.device))
    return np.take(x, idx, axis=dim)


def unshard(layout, shards, dim: int, num_devices: int):
    """The full sequence from every rank's shard (a list indexed by rank), in position order."""
    n = num_devices
    if isinstance(shards, (str, bytes, dict)) or not isinstance(shards, (list, tuple)):
        raise InvalidArgumentError(f"shards must be a list with one shard per rank ({n}), got {type(shards).__name__}")
    if len(shards) != n:
        raise InvalidArgumentError(f"unshard needs one shard per rank ({n}), got {len(shards)}")
    for r, x in enumerate(shards):
        if not hasattr(getattr(x, "shape", None), "__len__"):
            raise InvalidArgumentError(f"shards[{r}] must be an array or a tensor, got {type(x).__name__}")
    ndim = len(shards[0].shape)
    dim = axis(dim, ndim, "shards[0]")
    every = chunks(layout)
    slots = [slot(layout, r, n) for r in range(n)]
    for r, x in enumerate(shards):
        want = int(layout.tokens[slots[r]])
        if len(x.shape) != ndim or x.shape[dim] != want:
            got = (f"{x.shape[dim]} along dim {dim}" if len(x.shape) == ndim
                   else f"{len(x.shape)} dimension(s), shards[0] {ndim}")
            raise InvalidArgumentError(f"shards[{r}] (rank {r}) must hold the rank's {want} tokens along dim "
                                       f"{dim}, got {got}")
    order = np.concatenate([slot_positions(layout, s, every[group_of_slot(layout, s)]) for s in slots])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    if hasattr(shards[0], "index_select"):
        import torch

        full = torch.cat(list(shards), dim=dim)
        return full.index_select(dim, torch.as_tensor(inverse, device=full.device))
    return np.take(np.concatenate(shards, axis=dim), inverse, axis=dim)
