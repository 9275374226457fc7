"""The memory features on one GPU: what each saves of the peak memory, measured per phase of the step, against what
the cost model says it saves, and what it costs in time, measured against the plain checkpointed stack.

Usage (a CUDA device):  python benchmarks/gpu_memory_features.py [--tokens 32768] [--out FILE.md]
        (no GPU):       python benchmarks/gpu_memory_features.py --dry-run    (tiny sizes on the CPU: the code paths)

A stack of Llama-shaped layers (RMS norm, q/k/v/o projections, SDPA causal attention, a SwiGLU MLP; bf16; hidden 2048,
16 heads of 128, ffn 5632, 8 layers, vocab 32000) runs one forward and backward over `tokens` tokens with activation
checkpointing per layer, six ways: plain; plain again (the gradients' run-to-run spread); checkpoints offloaded
(hexiseq.nn.offloaded_checkpoint); the MLP tiled (hexiseq.nn.TiledMLP, ceil(tokens / 4096) tiles); the loss tiled
(hexiseq.nn.tiled_cross_entropy); all three. For
each, torch.cuda.max_memory_allocated less the parameters' and gradients' bytes in three phases: the layers' forward,
the loss (the head and the loss, forward and backward, up to the gradient of the last layer's output), and the
layers' backward; the step's peak is the largest. A feature saves memory only in the phase where its tensors live
(offloading and the tiled MLP in the layers' backward, the tiled loss in the loss), so each is read there. Beside
them, the cost model's per-token terms for the same shapes (docs/cost_model.md: offloading saves (layers - 2) H b
per token, the tiled MLP 3 F b per token less one tile's, the tiled loss V (b + 8) per token less one tile's), the
step's wall time (median of 3 after a warm-up), and the gradients of each way against the plain one."""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import hexiseq

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import machine  # noqa: E402

TILE = hexiseq._core.TILE_TOKENS  # the cost model's tile (4096 tokens); the dry run uses 256 to exercise tiles


class Layer(torch.nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv, self.o = torch.nn.Linear(h, 3 * h, bias=False), torch.nn.Linear(h, h, bias=False)
        self.mlp = torch.nn.Sequential(SwiGLU(h, ffn))

    def forward(self, x):
        t, h = x.shape[-2:]
        q, k, v = self.qkv(self.n1(x)).view(t, 3, self.heads, h // self.heads).unbind(1)
        # [1, heads, tokens, head_dim]: SDPA takes its flash path on 4-D inputs (3-D ones fell to the math path,
        # which holds the whole score matrix)
        q, k, v = (z.transpose(0, 1)[None] for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        x = x + self.o(a.transpose(0, 1).reshape(t, h))
        return x + self.mlp(self.n2(x))


class SwiGLU(torch.nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 2 * ffn, bias=False), torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        g, u = self.up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


WAYS = {"plain": (), "plain again": (), "offload": ("offload",), "tile_mlp": ("tile_mlp",), "tile_loss": ("tile_loss",),
        "all": ("offload", "tile_mlp", "tile_loss")}
PHASES = ("forward", "loss", "backward")


def step(layers, head, x, labels, features, offloader, tile, mark):
    """One forward and backward; mark(phase) is called as each phase ends (after the layers' forward, when the
    gradient of the last layer's output is known, after the layers' backward)."""
    h = x
    for layer in layers:
        if "offload" in features:
            h = hexiseq.nn.offloaded_checkpoint(layer, h, offloader=offloader)
        else:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
    mark("forward")
    h.register_hook(lambda g: mark("loss"))
    if "tile_loss" in features:
        loss = hexiseq.nn.tiled_cross_entropy(h, head.weight, labels, math.ceil(h.shape[0] / tile))
    else:
        loss = F.cross_entropy(head(h).float(), labels, reduction="sum")
    loss.backward()
    mark("backward")
    return loss.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (float32): the code paths only")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device: run with --dry-run to check the code paths on the CPU")
    dev, dt = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    H, heads, ffn, L, V, n = (2048, 16, 5632, 8, 32000, args.tokens) if cuda else (64, 4, 160, 4, 101, 600)
    tile = TILE if cuda else 256
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(H, heads, ffn) for _ in range(L)).to(dev, dt)
    head = torch.nn.Linear(H, V, bias=False).to(dev, dt)
    x = torch.randn(n, H, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, V, (n,), device=dev)
    params = [*layers.parameters(), *head.parameters()]
    b = torch.finfo(dt).bits // 8
    fixed = sum(p.numel() for p in params) * b * 2  # parameters and their gradients
    predicted = {"offload": (L - 2) * H * b * n, "tile_mlp": 3 * ffn * b * (n - min(n, tile)),
                 "tile_loss": V * (b + 8) * (n - min(n, tile))}
    where = {"offload": "backward", "tile_mlp": "backward", "tile_loss": "loss"}
    rows, ref = [], None
    for way, features in WAYS.items():
        for layer in layers:
            layer.mlp = torch.nn.Sequential(layer.mlp[0]) if "tile_mlp" not in features else torch.nn.Sequential(
                hexiseq.nn.TiledMLP(layer.mlp[0], math.ceil(n / tile)))
        offloader = hexiseq.nn.OffloadCheckpoints()
        times, peaks = [], {}

        def mark(phase):
            if cuda:
                peaks[phase] = (torch.cuda.max_memory_allocated() - fixed) / 2**30
                torch.cuda.reset_peak_memory_stats()
            else:
                peaks[phase] = float("nan")

        for rep in range(4):
            for p in params + [x]:
                p.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            step(layers, head, x, labels, features, offloader, tile, mark)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # on the host: held on the device, they counted in the next ways' peaks (2 GiB each)
        grads = [p.grad.float().cpu() for p in params + [x]]
        if ref is None:
            ref = (dict(peaks), grads)
            err = 0.0
        else:
            err = max(((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for a, r in zip(grads, ref[1]))
        read = [f"{f}: {ref[0][where[f]] - peaks[where[f]]:.3f} / {predicted[f] / 2**30:.3f}" for f in features]
        rows.append(f"| {way} | " + " | ".join(f"{peaks[ph]:.3f}" for ph in PHASES) +
                    f" | {max(peaks.values()):.3f} | {'; '.join(read) or '-'} | "
                    f"{statistics.median(times[1:]) * 1e3:.1f} | {err:.2e} | {offloader.peak_host_bytes / 2**30:.3f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# Memory features on one GPU: measured savings against the cost model's", "",
        f"`python benchmarks/gpu_memory_features.py --tokens {n}`, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU dry run: ' + machine()}, torch {torch.__version__}.", "",
        __doc__.split("\n\n")[2], "",
        "Peaks in GiB beyond the parameters and gradients, measured. Saved: the plain way's peak less this way's in "
        "the phase where the feature acts, measured / the cost model's figure.", "",
        "| way | forward | loss | backward | step peak | saved, GiB (measured / model) | step, ms | "
        "max grad diff vs plain (relative) | host memory, GiB |",
        "|---|---|---|---|---|---|---|---|---|", *rows, ""])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
