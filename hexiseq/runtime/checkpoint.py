"""Checkpoints of a model sharded by `shard_states` (and of its optimizer) in torch.distributed.checkpoint's format
(DCP), so that a checkpoint taken at one world size and one set of shares loads at another, and into a plain model
in one process.

What is written: every original parameter under its state-dict name and its full shape, each rank writing the part
of it that its shard holds. A rank's shard is a contiguous range of its unit's flattened parameters, so its part of
one parameter is a contiguous range of that parameter in row-major order, which is cut into at most 2 x ndim
rectangles (a partial row, whole rows, a partial row, recursively): the chunks DCP's sharded tensors describe, as a
`ShardedTensor` with those chunks as its shards. Buffers and parameters outside every unit go as plain tensors (DCP
writes a tensor every rank holds once). The optimizer's per-parameter states that have the shard's shape (Adam's
moments) are cut the same way under `optimizer.<parameter name>.<state>`; its other states (Adam's step) and its
hyper-parameters go as they are.

Loading builds the same description for the module as it is sharded now (any world size, any shares), with views
of this rank's shard as the chunks to fill, and lets DCP copy from whatever chunks overlap them. A plain model loads
the weights with `torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=path, no_dist=True)`.

Why not DTensor for hexiseq's own engine: its shards are those of `torch.chunk` over a mesh, even up to the last;
hexiseq's shares are arbitrary, which DCP's sharded tensors (chunks of any offsets and sizes) express directly. At
even shares, where shard_states hands the module to FSDP2, the parameters and the optimizer's moments are FSDP2's
DTensors and go to DCP as they are, under the same names; scalar states (Adam's step) go once per parameter
under FSDP2 and once per unit, under its first parameter's name, on the own engine, and a load takes the
parameter's own or else its unit's: one format, so a checkpoint saved by either engine loads into the other at
any world size.
"""

import math
import warnings

import torch
import torch.distributed as dist

from .comm import agree, collective_device
from .states import SHARD_NAME, sharding_of
from ..errors import InvalidArgumentError

__all__ = ["save_states", "load_states"]

_OPT = "optimizer."


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import (Shard, ShardedTensor, ShardedTensorMetadata,
                                                         ShardMetadata, TensorProperties)
    return dcp, Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata, TensorProperties


def chunks(lo, hi, shape):
    """The flat range [lo, hi) of a row-major tensor of `shape` as rectangles: [(flat_lo, flat_hi, offsets, sizes)],
    in order, covering it exactly (at most 2 ndim - 1 of them)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(lo, hi, [lo] if shape else [], [hi - lo] if shape else [])]
    inner = math.prod(shape[1:])
    r0, a = divmod(lo, inner)
    r1, b = divmod(hi, inner)

    def within(row, x, y):  # a piece of one outer row: the row fixed, the inner dims cut recursively
        return [(row * inner + f0, row * inner + f1, [row] + o, [1] + s) for f0, f1, o, s in chunks(x, y, shape[1:])]

    if r0 == r1:
        return within(r0, a, b)
    out = []
    if a:
        out += within(r0, a, inner)
        r0 += 1
    if r1 > r0:
        out.append((r0 * inner, r1 * inner, [r0] + [0] * (len(shape) - 1), [r1 - r0] + list(shape[1:])))
    if b:
        out += within(r1, 0, b)
    return out


def _sharded(unit, entry, flat, group_rank, device, api):
    """A ShardedTensor of `entry`'s full shape whose local shards are views of this rank's `flat` (a tensor laid
    out as the unit's shard: the shard itself, or an optimizer state of its shape)."""
    _, Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata, TensorProperties = api
    metas, local = [], []
    group = unit.comm.group
    for r, (lo, n) in enumerate(zip(unit.offsets, unit.sizes)):
        a, b = max(lo, entry.offset), min(lo + n, entry.offset + entry.numel)
        placed = r if group is dist.group.WORLD else dist.get_global_rank(group, r)  # placements name global ranks
        for f0, f1, off, size in chunks(a - entry.offset, b - entry.offset, entry.shape):
            meta = ShardMetadata(shard_offsets=off, shard_sizes=size, placement=f"rank:{placed}/{device}")
            metas.append(meta)
            if r == group_rank:
                start = entry.offset + f0 - lo
                local.append(Shard(flat[start:start + f1 - f0].view(size), meta))
    props = TensorProperties(dtype=flat.dtype, requires_grad=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(entry.shape), tensor_properties=props)
    with warnings.catch_warnings():  # ShardedTensor announces its own deprecation; DCP still reads and writes it
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta,
                                                                         process_group=unit.comm.group)


def _placement(t):
    return "cpu" if t.device.type == "cpu" else str(t.device)


def _describe(module, optimizer, api, loading, ckpt_keys=None):
    """The state dict DCP writes or fills: (dict, what to copy after a load)."""
    rec = sharding_of(module)
    rank = dist.get_rank(rec.comm.group)
    out, after = {}, []
    for u in rec.units:
        for entry in u.layout:
            if not entry.shape:  # a 0-d parameter: one element, written plainly by whoever holds it
                raise InvalidArgumentError(f"{entry.names[0]} is a 0-d parameter: checkpoints of sharded 0-d "
                                           "parameters are not supported; give it shape [1]")
            if rec.engine == "fsdp2":  # a DTensor, whose chunks DCP knows
                out[entry.names[0]] = rec.parameter(module, entry).detach()
            else:
                out[entry.names[0]] = _sharded(u, entry, u.shard.detach(), rank, _placement(u.shard), api)
    shard_keys = {k for k in module.state_dict(keep_vars=True) if k.rpartition(".")[2] == SHARD_NAME}
    for k, v in module.state_dict().items():
        if k not in shard_keys and k not in out:
            out[k] = v
    if optimizer is None:
        return out, after
    # the optimizer's parameters: one flat shard per unit (hexiseq's engine) or one DTensor per entry (FSDP2)
    if rec.engine == "fsdp2":
        owners = {rec.parameter(module, e): (u, [e]) for u in rec.units for e in u.layout}
    else:
        owners = {u.shard: (u, u.layout) for u in rec.units}
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        if p not in owners:
            raise InvalidArgumentError("the optimizer holds a parameter that is not a shard of this module: build "
                                       "it from module.parameters() after shard_states")
    loaded = {}  # checkpoint key -> the tensor DCP fills for it (one per key; other holders copy it after)
    saved = _saved_states(ckpt_keys) if loading else None
    for p, (u, entries) in owners.items():
        state = optimizer.state.get(p, {})
        if loading:  # the states the checkpoint holds for this parameter, made here when the optimizer has none
            _make_states(state, p, u, entries, saved)
            if state:
                optimizer.state[p] = state
        for key, val in state.items():
            if isinstance(val, torch.Tensor) and val.shape == p.shape and val.dim() >= 1:  # moments, cut like p
                for entry in entries:
                    if loading and key not in saved.get(entry.names[0], {}):
                        continue  # saved for a parameter that had no states yet (FSDP2): it keeps zeros
                    out[f"{_OPT}{entry.names[0]}.{key}"] = (val.detach() if rec.engine == "fsdp2" else
                                 _sharded(u, entry, val.detach(), rank, _placement(val), api))
                continue
            # a scalar state (a step count), the same on every rank: FSDP2 keeps one per parameter, the own engine
            # one per unit (under its first parameter's name); a load reads the parameter's own, else its unit's
            name = _scalar_key(u, entries, key, saved)
            if name is None:
                continue
            tensor = isinstance(val, torch.Tensor)
            if name in loaded:  # another parameter reading the same key: a copy of it after the load
                after.append((state, key, loaded[name], tensor))
                continue
            loaded[name] = out[name] = val if tensor else torch.tensor(val)
            if not tensor:
                after.append((state, key, out[name], False))
    for i, g in enumerate(optimizer.param_groups):  # flat keys: DCP's own flattening of lists does not load back
        for k, v in g.items():
            if k != "params":
                out[f"{_OPT}param_groups.{i}.{k}"] = v
    return out, after


def _saved_states(ckpt_keys):
    """{parameter name: {state: "tensor" or "other"}} of the optimizer states a checkpoint holds (its keys are
    optimizer.<parameter name>.<state>; parameter names hold dots, state names do not)."""
    saved = {}
    for k, kind in ckpt_keys.items():
        if k.startswith(_OPT) and not k.startswith(_OPT + "param_groups."):
            name, _, key = k[len(_OPT):].rpartition(".")
            saved.setdefault(name, {})[key] = kind
    return saved


def _make_states(state, p, u, entries, saved):
    """Zeros for the states the checkpoint holds for a parameter (of the optimizer's own shapes), for DCP to fill:
    its moments under any of its entries' names, and its scalars only where it has moments (a parameter saved
    without states, by FSDP2 before its first gradient, gets none: an optimizer step with a count and no moments
    fails)."""
    for e in entries:
        for key, kind in saved.get(e.names[0], {}).items():
            if kind == "tensor":
                state.setdefault(key, torch.zeros_like(p.detach()))
    if not state:
        return
    for e in entries + u.layout:
        for key, kind in saved.get(e.names[0], {}).items():
            if kind == "other":
                state.setdefault(key, torch.zeros((), dtype=torch.float32))


def _scalar_key(u, entries, key, saved):
    """The checkpoint key of a parameter's scalar state: saving (saved None), its own (FSDP2: one entry) or its
    unit's (the own engine: every entry, under the first); loading, the first of those the checkpoint holds, then
    any other of the unit's (a checkpoint of the other engine), or None."""
    if saved is None:
        return f"{_OPT}{entries[0].names[0]}.{key}"
    name = next((e.names[0] for e in entries + u.layout if key in saved.get(e.names[0], {})), None)
    return None if name is None else f"{_OPT}{name}.{key}"


def save_states(module, path, optimizer=None):
    """Write `module` (sharded by `shard_states`) and, when given, `optimizer` (built from its parameters after
    sharding) to the DCP checkpoint folder `path`. Collective over the module's group: every rank calls it. Of a
    module sharded with replicas, the first replica's ranks write (after sync_replicas and the optimizer step,
    every replica holds the same states) and the others wait until they have."""
    api = _dcp()
    rec = sharding_of(module)
    state, _ = _describe(module, optimizer, api, loading=False)
    if rec.replicas is None:
        api[0].save(state, checkpoint_id=str(path), process_group=rec.comm.group)
        return
    # the first replica writes the states (every replica holds them whole); the others wait for it in an agreement
    # that carries the writers' failure, so every rank raises it instead of the others waiting out the timeout
    error = None
    if dist.get_rank(rec.parent) in rec.replicas.replicas[0]:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            api[0].save(state, checkpoint_id=str(path), process_group=rec.comm.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            error = InvalidArgumentError(f"saving the states to {path} failed: {type(e).__name__}: "
                                         f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
    agree(rec.parent, [], [], error, device=collective_device(rec.parent))


def load_states(module, path, optimizer=None):
    """Load a checkpoint written by `save_states` (at any world size and shares) into `module` as it is sharded
    now, and into `optimizer` when given (its hyper-parameters too). Collective over the module's group."""
    api = _dcp()
    dcp = api[0]
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise InvalidArgumentError(f"{path}: not a checkpoint written by save_states ({e})") from None
    kinds = {k: ("tensor" if hasattr(m, "size") and len(m.size) > 0 else "other")
             for k, m in meta.state_dict_metadata.items()}
    if optimizer is not None and not any(k.startswith(_OPT + "param_groups") for k in kinds):  # DCP flattens lists
        raise InvalidArgumentError(f"{path} holds no optimizer states (it was saved without an optimizer)")
    if optimizer is not None:
        saved = {int(k.split(".")[2]) for k in kinds if k.startswith(_OPT + "param_groups.")}
        if len(saved) != len(optimizer.param_groups):
            raise InvalidArgumentError(f"{path} holds {len(saved)} optimizer parameter groups, the optimizer "
                                       f"{len(optimizer.param_groups)}")
    state, after = _describe(module, optimizer, api, loading=True, ckpt_keys=kinds)
    dcp.load(state, checkpoint_id=str(path), process_group=sharding_of(module).comm.group)
    for holder, key, t, tensor in after:
        holder[key] = t.clone() if tensor else t.item()
    if optimizer is not None:
        for i, g in enumerate(optimizer.param_groups):
            for k in g:
                if k != "params":
                    g[k] = state[f"{_OPT}param_groups.{i}.{k}"]
    rest = {k: v for k, v in state.items() if not k.startswith(_OPT) and not hasattr(v, "local_shards")}
    module.load_state_dict(rest, strict=False)
    return module
