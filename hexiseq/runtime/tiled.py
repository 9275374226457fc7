"""Token-local work over tiles of the sequence, so that a layer's working memory stops growing with the sequence.

At long context the largest tensors of a step are not attention's (the runtime streams it block by block) but the
MLP's intermediate activations ([tokens, ffn], 3.5x the hidden size for Llama) and the logits ([tokens, vocab],
128K columns for Llama 3). Both are token-local: each token's output depends on that token alone, so they can be
computed a tile of tokens at a time, and the backward can recompute a tile's activations from its input instead of
keeping them (the Arctic Long Sequence Training recipe).

- `TiledMLP(mlp, tiles)`: wraps a token-local module (an MLP block: [batch, tokens, hidden] -> same). The forward
  runs it tile by tile under no_grad and keeps only its input; the backward runs each tile again with autograd and
  back-propagates it at once, so at most one tile's activations exist at a time. Parameter gradients add up over
  the tiles exactly as autograd adds them over the tokens.
- `tiled_cross_entropy(hidden, weight, labels, tiles)`: the summed cross entropy of logits = hidden @ weight.T over
  `labels` (ignore_index -100), never holding more than one tile's logits; its backward recomputes each tile's
  logits and softmax.
Exact against the untiled computation up to the order of the sums over tiles (tests/test_tiled.py, float64).
"""

import torch

from ..errors import InvalidArgumentError

__all__ = ["TiledMLP", "tiled_cross_entropy"]


def _bounds(n, tiles):
    tiles = max(1, min(int(tiles), n)) if n else 1
    return [n * i // tiles for i in range(tiles + 1)]


def _check_tiles(tiles):
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise InvalidArgumentError(f"tiles must be a positive integer, got {tiles!r}")


class _TiledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module, tiles, dim, *params):
        ctx.module, ctx.tiles, ctx.dim, ctx.n_params = module, tiles, dim, len(params)
        # the backward runs the tiles again under the autocast state of this forward, as torch's checkpoint does
        kind = x.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        b = _bounds(x.shape[dim], tiles)
        with torch.no_grad():
            return torch.cat([module(x.narrow(dim, lo, hi - lo)) for lo, hi in zip(b[:-1], b[1:])], dim)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        grads = [None] * len(params)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        b = _bounds(x.shape[ctx.dim], ctx.tiles)
        for lo, hi in zip(b[:-1], b[1:]):
            xt = x.narrow(ctx.dim, lo, hi - lo).detach().requires_grad_(ctx.needs_input_grad[0])
            kind, enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
                yt = ctx.module(xt)
            inputs = ([xt] if ctx.needs_input_grad[0] else []) + params
            got = torch.autograd.grad(yt, inputs, dy.narrow(ctx.dim, lo, hi - lo), allow_unused=True)
            if ctx.needs_input_grad[0]:
                dx.narrow(ctx.dim, lo, hi - lo).copy_(got[0])
                got = got[1:]
            grads = [g if a is None else a if g is None else a + g for a, g in zip(grads, got)]
        return (dx, None, None, None, *grads)


class TiledMLP(torch.nn.Module):
    """`mlp` run over `tiles` tiles of the token dimension `dim` (default -2: [batch, tokens, hidden] or
    [tokens, hidden]), keeping one tile's activations at a time. `mlp` must be token-local (each output token a
    function of its input token alone) and deterministic (it runs again in the backward, under the forward's
    autocast state): an MLP, a norm, an activation; not attention, not dropout."""

    def __init__(self, mlp: torch.nn.Module, tiles: int, dim: int = -2):
        super().__init__()
        _check_tiles(tiles)
        self.mlp, self.tiles, self.dim = mlp, tiles, dim

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise InvalidArgumentError(f"x must be a tensor of at least 2 dimensions ([tokens, hidden]), got "
                                       f"{type(x).__name__}{list(x.shape) if isinstance(x, torch.Tensor) else ''}")
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return _TiledFn.forward(_NoCtx(), x, self.mlp, self.tiles, self.dim % x.dim())
        return _TiledFn.apply(x, self.mlp, self.tiles, self.dim % x.dim(), *params)


class _NoCtx:
    """A stand-in for autograd's ctx when no backward will run (inference): nothing is kept."""

    def save_for_backward(self, *tensors):
        pass


class _TiledCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tiles, ignore_index):
        ctx.tiles, ctx.ignore_index = tiles, ignore_index
        ctx.save_for_backward(hidden, weight, labels)
        total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        b = _bounds(hidden.shape[0], tiles)
        for lo, hi in zip(b[:-1], b[1:]):
            logits = hidden[lo:hi] @ weight.T
            total = total + torch.nn.functional.cross_entropy(logits.float() if logits.dtype != torch.float64
                                                              else logits, labels[lo:hi], ignore_index=ignore_index,
                                                              reduction="sum")
        return total

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels = ctx.saved_tensors
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        b = _bounds(hidden.shape[0], ctx.tiles)
        for lo, hi in zip(b[:-1], b[1:]):
            logits = hidden[lo:hi] @ weight.T
            lt = logits.float() if logits.dtype != torch.float64 else logits
            p = torch.softmax(lt, -1)
            y = labels[lo:hi]
            keep = y != ctx.ignore_index
            p[keep, y[keep]] -= 1.0
            p[~keep] = 0.0
            g = (p * dloss).to(logits.dtype)                      # d loss / d logits of the tile
            if dh is not None:
                dh[lo:hi] = g @ weight
            if dw is not None:
                dw += g.T @ hidden[lo:hi]
        return dh, dw, None, None, None


def tiled_cross_entropy(hidden, weight, labels, tiles: int, ignore_index: int = -100):
    """sum over tokens of cross_entropy(hidden @ weight.T, labels) (tokens whose label is ignore_index count 0),
    computed over `tiles` tiles of tokens: hidden [tokens, hidden_size] (or [1, tokens, hidden_size]), weight
    [vocab, hidden_size] (the LM head's), labels [tokens] (or [1, tokens]). Divide by the labelled tokens for the
    mean. The logits are taken in float32 (float64 for float64 inputs), as a loss in a lower precision should."""
    _check_tiles(tiles)
    if hidden.dim() == 3:
        if hidden.shape[0] != 1:
            raise InvalidArgumentError(f"hidden must be [tokens, hidden] or [1, tokens, hidden], got {list(hidden.shape)}")
        hidden, labels = hidden[0], labels.reshape(-1)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise InvalidArgumentError(f"hidden [tokens, h], weight [vocab, h] and labels [tokens] do not agree: "
                                   f"{list(hidden.shape)}, {list(weight.shape)}, {list(labels.shape)}")
    if labels.dtype != torch.long:
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise InvalidArgumentError(f"labels must be integer class indices, got {labels.dtype}")
        labels = labels.long()
    return _TiledCE.apply(hidden, weight, labels, tiles, ignore_index)
