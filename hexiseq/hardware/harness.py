"""What the calibration and the measurement share to run on the ranks: PyTorch imported on first use (so that
`import hexiseq` works without it), dtypes by name, the agreement on their arguments, a barrier bound to the
rank's device, rank 0's object on every rank, the timing of a call on a device, and the Llama-style layer both
run (its elementwise work written once, so that what calibrate prices and what measure runs are one piece of
code)."""

import statistics
import time

from ..errors import HexiseqError, InvalidArgumentError


def load_torch():
    """(torch, torch.distributed), imported on the first call; HexiseqError without PyTorch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - the CPU test environment has torch
        raise HexiseqError("hexiseq.calibrate and hexiseq.measure need PyTorch (pip install torch)") from None
    return torch, dist


def torch_dtype(dtype, device):
    torch, _ = load_torch()
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
                 "fp64": torch.float64, "float64": torch.float64, "double": torch.float64}
        if key not in names:
            raise InvalidArgumentError(f"dtype {dtype!r} is not one of bf16, fp16, fp32, fp64")
        return names[key]
    if isinstance(dtype, torch.dtype) and dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return dtype
    raise InvalidArgumentError(f"dtype must be a torch floating dtype or a name like 'bf16', got {dtype!r}")


def model_dtype(model, device):
    """The dtype a model trains in by default, which calibrate and measure both default to: the one of its
    dtype_bytes (2: bf16, 4: fp32, 8: fp64), so that the rates are measured in the dtype the plan's bytes are priced
    in; for another width, bf16 on CUDA and fp32 elsewhere."""
    torch, _ = load_torch()
    by_bytes = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    return by_bytes.get(model.dtype_bytes) or torch_dtype(None, device)


def device_barrier(group, device):
    """A barrier of `group`; on NCCL bound to this rank's device (else NCCL guesses one)."""
    _, dist = load_torch()
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def broadcast_object(obj, group):
    """Rank 0's object on every rank (the calibration record must be equal everywhere)."""
    _, dist = load_torch()
    box = [obj]
    src = 0 if group is dist.group.WORLD else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def collective_group(group, error, command):
    """The process group a collective call runs on (the world when None). Without torch.distributed initialised
    there is no other rank to tell: this rank's own argument error is raised as it is, else a message saying how
    to start the ranks (`command`: what follows `-m hexiseq` on a torchrun line)."""
    _, dist = load_torch()
    if not dist.is_available() or not dist.is_initialized():
        if error is not None:
            raise error
        raise HexiseqError("torch.distributed is not initialised: call torch.distributed.init_process_group first "
                           f"(or run `torchrun --nproc_per_node N -m hexiseq {command}`)")
    return group if group is not None else dist.group.WORLD


def agree_arguments(group, error, arguments):
    """Compare every rank's arguments before anything is measured, and learn whether any rank's arguments failed
    validation (`error`, the exception this rank would raise, or None): the runtime's agreement
    (hexiseq.runtime.comm.agree), so every rank raises the same error at once, InvalidArgumentError naming the
    rank and its message, or RankMismatchError naming the argument and each rank's value, instead of ranks
    meeting in different collectives (a Gloo timeout, or a plan fingerprint the user never passed).
    arguments: (name, value) in a fixed order; each value travels as a digest of its repr, and the reprs travel
    only when the ranks disagree. Costs one all-gather of one integer per argument."""
    from ..runtime.comm import agree, collective_device, text_code

    texts = [repr(value) for _, value in arguments]
    agree(group, [text_code(t) for t in texts], [name for name, _ in arguments], error,
          device=collective_device(group), words=texts)


# ---------------------------------------------------------------------------------------------------------- timing

def _warmed(fn, device, warmup: int):
    """fn() run `warmup` times and the device synchronised; returns the synchronisation for the timing after."""
    torch, _ = load_torch()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    return sync


def seconds(fn, device, iters: int, warmup: int) -> float:
    """Median wall seconds of fn() over iters runs after warmup runs, the device synchronised around each."""
    sync = _warmed(fn, device, warmup)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def seconds_queued(fn, device, iters: int, warmup: int) -> float:
    """Mean wall seconds of fn() run `iters` times back to back, the device synchronised only before and after.
    Compute a step queues (a layer's matmuls and elementwise kernels, a ring's blocks) is timed this way: a
    synchronisation after each call adds the device's idle gap while the host issues the next one, which made
    calibrate's rates read 10-25% below what a layer runs at (one H100: matmuls 558-666 TFLOP/s synchronised
    against 678-763 back to back)."""
    sync = _warmed(fn, device, warmup)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


# ------------------------------------------------------------------------------------------ a layer's elementwise work
# The memory-bound work of a Llama-style layer as the Hugging Face Llama code writes it (eager PyTorch): the
# calibration times these functions for the cost model's memory-bound rate, and measure's Llama layer runs the same
# ones, so that what is priced and what is measured are one piece of code.

def rms_norm(x, weight, eps=1e-6):
    """RMS norm computed in float32 and cast back, then scaled by `weight`."""
    torch, _ = load_torch()
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def rotary(x, cos, sin):
    """Rotary position embedding of x [..., tokens, width] in the rotate-half form; cos and sin broadcast to x."""
    torch, _ = load_torch()
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotary_tables(tokens, head_dim, device, dtype, base=10000.0):
    """(cos, sin) [tokens, head_dim] of positions 0..tokens-1."""
    torch, _ = load_torch()
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32), inv)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def llama_layer(model, attention, device, dtype, seed):
    """A Llama-style block around the distributed attention, its elementwise work (RMS norms, rotary embedding of q
    and k, the MLP's activation, residual adds) written as the Hugging Face Llama code writes it, with the functions
    the calibration times for the cost model's memory-bound rate (the functions above)."""
    torch, _ = load_torch()
    nn = torch.nn
    H, A, K, d, F = model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.Parameter(torch.ones(H))
            self.norm2 = nn.Parameter(torch.ones(H))
            self.wqkv = nn.Linear(H, (A + 2 * K) * d, bias=False)
            self.wo = nn.Linear(A * d, H, bias=False)
            self.up = nn.Linear(H, 2 * F if model.gated_mlp else F, bias=False)
            self.down = nn.Linear(F, H, bias=False)
            self._rotary = (None, None, None)  # (tokens, cos, sin) of the last call's length

        def forward(self, x):
            B, s, _ = x.shape
            if self._rotary[0] != s:
                cos, sin = rotary_tables(s, d, x.device, x.dtype)
                self._rotary = (s, cos[:, None, :], sin[:, None, :])
            _, cos, sin = self._rotary
            q, k, v = self.wqkv(rms_norm(x, self.norm1)).split([A * d, K * d, K * d], dim=-1)
            q, k = rotary(q.view(B, s, A, d), cos, sin), rotary(k.view(B, s, K, d), cos, sin)
            o = attention(q, k, v.view(B, s, K, d))
            x = x + self.wo(o.reshape(B, s, A * d))
            h = self.up(rms_norm(x, self.norm2))
            if model.gated_mlp:
                a, b = h.chunk(2, dim=-1)
                h = torch.nn.functional.silu(a) * b
            else:
                h = torch.nn.functional.gelu(h)
            return x + self.down(h)

    torch.manual_seed(seed)
    return Layer().to(device=device, dtype=dtype)
