"""A job restarted on the machines that are left: which devices of the saved cluster its ranks run on.

When a machine is lost, torchrun's elastic agent (`--nnodes MIN:MAX --max-restarts N`) restarts the job on the
survivors, with new ranks. `survivors(cluster)` (collective: every rank calls it) gathers each rank's machine name
and local rank, finds its device in the saved cluster (the k-th device of the nodes that name that machine as their
`host`: hexiseq calibrate writes the names), and returns the saved cluster less the devices no rank claimed, in
rank order (device r is rank r's), with their links and measured rates::

    cluster, devices = hexiseq.elastic.survivors(hexiseq.Cluster.from_file("cluster.yaml"))
    plan = hexiseq.plan(cluster, model=..., seq_len=...)     # the same plan on every rank
    model = hexiseq.shard_states(model, plan.state_shares)
    hexiseq.checkpoint.load_states(model, last_checkpoint, optimizer)   # re-sharded to the new shares

A rank's machine is `socket.gethostname()` unless HEXISEQ_HOST names it (containers whose host names are not
the machine's, or several agents on one machine standing in for several); its local rank is torchrun's
LOCAL_RANK. Every rank computes the answer from the same gathered names, so a refusal (a machine the cluster does
not name, a local rank past its devices, two ranks on one device, a machine's ranks not consecutive) is raised on
every rank alike, naming the rank and the value.
"""

import os
import socket

import torch.distributed as dist

from ..errors import InvalidArgumentError
from ..planner.cluster import Cluster

__all__ = ["survivors", "this_host"]


def this_host() -> str:
    """The name this process's machine goes by: HEXISEQ_HOST, else the host name."""
    return os.environ.get("HEXISEQ_HOST") or socket.gethostname()


def survivors(cluster, group=None):
    """(the cluster of the devices the ranks of `group` run on, in rank order; [rank r's device in `cluster`'s
    numbering]). Collective over `group` (default: the world). See hexiseq.integrations.elastic."""
    if not isinstance(cluster, Cluster):
        raise InvalidArgumentError(f"cluster must be a hexiseq Cluster (Cluster.from_file(...)), got "
                                   f"{type(cluster).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("hexiseq.elastic.survivors is collective: call torch.distributed."
                                   "init_process_group first (torchrun sets up the environment)")
    local = os.environ.get("LOCAL_RANK")
    try:
        local = int(local) if local is not None else None
    except ValueError:
        local = f"not a number: {local!r}"
    world = dist.get_world_size(group)
    mine = (this_host(), local)
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    return _match(cluster, every)


def _match(cluster, every):
    """The answer of survivors() from every rank's (machine, local rank): a pure function of the gathered list, so
    every rank reaches the same result or the same error."""
    hosts = cluster.host_devices()
    if not hosts:
        raise InvalidArgumentError("the saved cluster names no machines: give each node its `host:` (hexiseq "
                                   "calibrate writes them) so that restarted ranks can find their devices")
    devices, owner = [], {}
    for r, (host, local) in enumerate(every):
        if not isinstance(local, int):
            raise InvalidArgumentError(f"rank {r}: LOCAL_RANK must be the process's local rank (torchrun sets it), "
                                       f"got {local!r}" if local is not None else
                                       f"rank {r}: LOCAL_RANK is not set (start the job with torchrun)")
        if host not in hosts:
            raise InvalidArgumentError(f"rank {r} runs on machine {host!r}, which the saved cluster does not name "
                                       f"(its machines: {', '.join(sorted(hosts))}; HEXISEQ_HOST overrides the name)")
        if not 0 <= local < len(hosts[host]):
            raise InvalidArgumentError(f"rank {r}: local rank {local} on {host!r}, which holds {len(hosts[host])} "
                                       f"device(s) in the saved cluster")
        d = hosts[host][local]
        if d in owner:
            raise InvalidArgumentError(f"ranks {owner[d]} and {r} both run on device {d} ({host!r}, local rank "
                                       f"{local})")
        owner[d] = r
        devices.append(d)
    try:
        return cluster.for_ranks(devices), devices
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"the ranks of one machine must be consecutive (as torchrun numbers them): rank r "
                                   f"runs on device {devices}[r], and {e}") from None
