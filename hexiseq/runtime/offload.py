"""Activation checkpoints kept in host memory, so that a device holds two layers' checkpoints instead of every
layer's (what the planner's "offload" memory feature prices: docs/cost_model.md).

A non-reentrant `torch.utils.checkpoint.checkpoint` keeps a layer's inputs for the recompute and saves them through
torch's saved-tensor hooks; its own hooks take every tensor saved inside the layer (to drop and recompute them). So
hooks set around the checkpoint see exactly the layer's inputs, its checkpoint: `OffloadCheckpoints` moves those to
host memory (transformers' `activation_checkpointing_enable(offload=True)` does the same with torch's
`save_on_cpu`, whose copies are synchronous).

On CUDA a checkpoint is copied on a side stream into a pinned host buffer, after the work that produced it (an event
on the current stream), so the copy overlaps the next layer's forward; the device memory is released when the copy
is done (the caching allocator is told the side stream uses it). In the backward, unpacking a checkpoint also starts
bringing back the one saved before it (the previous layer's), which then arrives while this layer's recompute and
backward run. Tensors elsewhere (CPU) already live in host memory and are kept as they are. Either way the values are
the saved ones bit for bit: the gradients are those of the plain checkpoint (tests/test_memory_features.py, float64).

Used by hexiseq.hf.patch_model where the plan chooses offloading for the rank's device, or by hand:

    offload = hexiseq.nn.OffloadCheckpoints()
    y = hexiseq.nn.offloaded_checkpoint(layer, x, offloader=offload)   # a checkpoint whose input goes to the host
"""

import weakref

import torch
import torch.utils.checkpoint

from ..errors import InvalidArgumentError

__all__ = ["OffloadCheckpoints", "offloaded_checkpoint"]


class _Saved:
    """One saved tensor in host memory: the pinned buffer, the event of its copy out, the device it came from, and
    (while prefetched) its copy back with the event that completes it."""

    __slots__ = ("host", "device", "copied", "back", "fetched", "previous", "__weakref__")

    def __init__(self, host, device, copied, previous):
        self.host, self.device, self.copied, self.previous = host, device, copied, previous
        self.back = self.fetched = None


class OffloadCheckpoints(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep the tensors saved inside them in host memory (use around a non-reentrant
    checkpoint: see the module's docstring). Reusable: enter it around every layer's checkpoint.

    min_bytes: CUDA tensors smaller than this stay on the device (default 1 MiB: position tables, masks).
    host_bytes / peak_host_bytes: bytes of saved tensors held in host memory now / at most (CPU tensors count:
    they are in host memory too), for checking against a plan's mem_host_gib."""

    def __init__(self, min_bytes: int = 1 << 20):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise InvalidArgumentError(f"min_bytes must be an integer >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.host_bytes = self.peak_host_bytes = 0
        self.saved = 0  # tensors of at least one element packed so far
        self._last = None  # weak reference to the last _Saved, the previous of the next one
        self._streams = {}
        super().__init__(self._pack, self._unpack)

    def reset_peak(self):
        self.peak_host_bytes = self.host_bytes

    def _count(self, nbytes):
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def _release(self, nbytes):
        self.host_bytes -= nbytes

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, t):
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:  # nothing to move (some torch versions save an empty placeholder beside the inputs)
            return t
        self.saved += 1
        if t.device.type == "cuda" and nbytes < self.min_bytes:
            return t
        if t.device.type != "cuda":  # already in host memory: kept as it is, counted while saved
            saved = _Saved(t, None, None, None)
        else:
            side, current = self._stream(t.device), torch.cuda.current_stream(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            side.wait_stream(current)  # after the work that produced it
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            t.record_stream(side)  # its device memory is reused only after the copy
            saved = _Saved(host, t.device, copied, self._last)
            self._last = weakref.ref(saved)
        self._count(nbytes)
        weakref.finalize(saved, self._release, nbytes)  # when autograd lets the saved tensor go
        return saved

    def _fetch(self, saved):
        side = self._stream(saved.device)
        with torch.cuda.stream(side):
            side.wait_event(saved.copied)
            saved.back = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
            saved.back.copy_(saved.host, non_blocking=True)
            saved.fetched = torch.cuda.Event()
            saved.fetched.record(side)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved  # a small CUDA tensor left on the device
        if saved.device is None:
            return saved.host
        if saved.back is None:
            self._fetch(saved)
        before = saved.previous() if saved.previous is not None else None
        if before is not None and before.back is None:
            self._fetch(before)  # the previous layer's checkpoint travels during this layer's backward
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(saved.fetched)
        t, saved.back, saved.fetched = saved.back, None, None
        t.record_stream(current)
        return t


def offloaded_checkpoint(fn, *args, offloader: OffloadCheckpoints = None, **kwargs):
    """`torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)` with its inputs (the checkpoint)
    kept in host memory by `offloader` (an OffloadCheckpoints; a new one when None)."""
    if kwargs.pop("use_reentrant", False):
        raise InvalidArgumentError("offloaded_checkpoint needs a non-reentrant checkpoint (use_reentrant=False): a "
                                   "reentrant one does not save its inputs through saved-tensor hooks")
    if offloader is None:
        offloader = OffloadCheckpoints()
    if not isinstance(offloader, OffloadCheckpoints):
        raise InvalidArgumentError(f"offloader must be a hexiseq.nn.OffloadCheckpoints, got {offloader!r}")
    with offloader:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
