"""torch's FSDP2 (`fully_shard`) beside hexiseq: what `shard_states` hands it at even shares, and the recipe for a
user who shards with it directly.

Why `shard_states` defers to FSDP2 when every rank's share is the same: FSDP2 is what a practitioner already runs
and trusts, it runs its collectives on CUDA streams of its own, it carries mixed-precision policies, it keeps a
parameter that gets no gradient out of the optimizer's step, and its DTensor parameters work with torch's
state-dict and compile tooling. hexiseq's own engine (states.py) remains for what FSDP2 cannot express: shards of
unequal size, a rank holding nothing. At even shares both give the same gradients; on 2 Gloo ranks of a CPU the
own engine's step measured 0.85-0.91x FSDP2's (benchmarks/results/states.md); on a GPU the two have not been
timed against each other.

FSDP2's limits then apply too. One measured here: a unit run twice in one forward under reentrant activation
checkpointing trains wrongly under FSDP2 (the own engine is exact there): use non-reentrant checkpointing, or
engine="hexiseq".

What changes for the caller at even shares: `module.parameters()` are FSDP2's DTensors under their original names
(no `hexiseq_shard`), and FSDP2's rules of use apply. `full_state_dict`, `load_full_state_dict` and
hexiseq.checkpoint read and write the same formats for both engines, so a checkpoint saved at even shares loads
at uneven ones and back (the elastic restart's case: the survivors' shares are seldom even).
"""

import torch

from ..errors import InvalidArgumentError

__all__ = ["available", "shard", "sum_fsdp2_gradients", "copy_full", "is_dtensor"]


def _api():
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # torch before 2.6: no public FSDP2
        return None
    return fully_shard, DeviceMesh, DTensor, distribute_tensor


def available() -> bool:
    """Whether this torch has FSDP2 (torch.distributed.fsdp.fully_shard)."""
    return _api() is not None


def is_fsdp_module(m) -> bool:
    return hasattr(m, "set_gradient_divide_factor") and hasattr(m, "reshard")


def sum_fsdp2_gradients(module) -> int:
    """Make torch's FSDP2 (`fully_shard`) sum the ranks' gradients instead of averaging them, on every FSDP module
    of `module` (the root and its units); returns how many it set.

    Under sequence parallelism every rank's loss covers only its own tokens: with each rank's loss written as its
    tokens' summed loss over the WHOLE sequence's token count (hexiseq.hf.sharded_causal_lm_loss, or sum / count by
    hand), the gradient of the mean loss is the SUM of the ranks' gradients. FSDP2 divides the reduce-scatter by the
    world size (the mean, right for data parallelism), which leaves the gradients at 1/world of the full-sequence
    gradient. The recipe, exact against one process (tests/test_fsdp2.py)::

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        hexiseq.states.sum_fsdp2_gradients(model)      # after fully_shard, before the first backward

    (`hexiseq.shard_states(model, [1 / world] * world, reduce="sum")` does the same in one call.)
    Data-parallel replicas of a sequence-parallel group (a mesh of replicas x the plan's ranks) want the mean over
    the replicas of these sums: divide the loss by the number of replicas."""
    count = 0
    for m in module.modules():
        if is_fsdp_module(m):
            m.set_gradient_divide_factor(1.0)
            count += 1
    if not count:
        raise InvalidArgumentError(f"{type(module).__name__} holds no FSDP2 module: call fully_shard on it first")
    return count


def shard(module, unit_modules, group, device_type, reduce):
    """fully_shard each unit (innermost first, so an outer unit holds only what its inner ones do not) and then
    the root, over a mesh of `group`; reduce="sum" switches FSDP2's mean to the sum."""
    fully_shard, DeviceMesh, _, _ = _api()
    mesh = DeviceMesh.from_group(group, device_type)
    depth = {id(m): name.count(".") + 1 if name else 0 for name, m in module.named_modules(remove_duplicate=False)}
    for m in sorted((m for m in unit_modules if m is not module), key=lambda m: -depth[id(m)]):
        fully_shard(m, mesh=mesh)
    # not the root's default, which keeps it gathered after its forward for the backward: a forward without one
    # (an evaluation under no_grad) then left plain tensors where the optimizer and the state dicts read DTensors
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    if reduce == "sum":
        sum_fsdp2_gradients(module)


def copy_full(p, full):
    """Copy this rank's slice of `full` (the whole parameter, the same on every rank) into the FSDP2 parameter
    `p`: local slicing, no communication."""
    _, _, _, distribute_tensor = _api()
    with torch.no_grad():
        local = distribute_tensor(full.detach().to(p.device, p.dtype), p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
        p.to_local().copy_(local)


def is_dtensor(t) -> bool:
    api = _api()
    return api is not None and isinstance(t, api[2])

