"""Tiled token-local work (hexiseq.nn.TiledMLP, tiled_cross_entropy): forward and backward equal the untiled
computation in float64 (1e-12 relative: the same products, the sums over tiles in another order), on odd sizes and
tile counts that do not divide them, with one tile's activations alive at a time."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from hexiseq.errors import InvalidArgumentError  # noqa: E402
from hexiseq.nn import TiledMLP, tiled_cross_entropy  # noqa: E402


class SwiGLU(torch.nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.norm = torch.nn.RMSNorm(h, dtype=torch.float64)
        self.gate = torch.nn.Linear(h, f, bias=False, dtype=torch.float64)
        self.up = torch.nn.Linear(h, f, bias=False, dtype=torch.float64)
        self.down = torch.nn.Linear(f, h, bias=True, dtype=torch.float64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("tokens,tiles", [(97, 5), (64, 64), (13, 100), (50, 1)])
def test_tiled_mlp_equals_untiled(tokens, tiles):
    torch.manual_seed(tokens)
    mlp = SwiGLU(12, 37)
    x = torch.randn(2, tokens, 12, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, tokens, 12, dtype=torch.float64)
    y = mlp(x)
    y.backward(dy)
    want = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    mlp.calls = 0
    yt = TiledMLP(mlp, tiles)(x)
    yt.backward(dy)
    n = min(tiles, tokens)
    assert mlp.calls == 2 * n, "each tile runs once forward and once again in the backward"
    assert rel(yt, y) <= 1e-12
    for w, g in zip(want, [x.grad] + [p.grad for p in mlp.parameters()]):
        assert rel(g, w) <= 1e-12
    with torch.no_grad():  # inference: no activation kept, same output
        assert rel(TiledMLP(mlp, tiles)(x), y) <= 1e-12


@pytest.mark.parametrize("tokens,tiles", [(97, 4), (31, 31), (8, 3)])
def test_tiled_cross_entropy_equals_untiled(tokens, tiles):
    torch.manual_seed(tokens)
    h = torch.randn(tokens, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(53, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(53, (tokens,))
    labels[::5] = -100
    loss = F.cross_entropy(h @ w.T, labels, reduction="sum")
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    tl = tiled_cross_entropy(h, w, labels, tiles)
    (tl * 3.0).backward()
    assert abs(float(tl - loss)) / abs(float(loss)) <= 1e-12
    assert rel(h.grad, 3.0 * gh) <= 1e-12 and rel(w.grad, 3.0 * gw) <= 1e-12


def test_tiles_are_checked():
    with pytest.raises(InvalidArgumentError, match="tiles must be a positive integer, got 0"):
        TiledMLP(torch.nn.Identity(), 0)
    with pytest.raises(InvalidArgumentError, match="do not agree"):
        tiled_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 2), torch.zeros(4, dtype=torch.long), 2)


def test_tiled_mlp_recomputes_under_the_forwards_autocast():
    """Under torch.autocast the backward's recomputation runs in the forward's precision (bf16 here, as torch's
    checkpoint does), not in the parameters' float32: every run of the inner Linear, forward and recomputed, gives
    bf16; and the gradients are those of the untiled model under the same autocast up to bf16 rounding."""
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    seen = []
    mlp[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x = torch.randn(1, 40, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
    y.float().sum().backward()
    want = x.grad.clone()
    x.grad = None
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt = TiledMLP(mlp, 4)(x)
    yt.float().sum().backward()   # outside the autocast region, as a training loop runs it
    assert seen == [torch.bfloat16] * 8, seen
    assert yt.dtype == y.dtype == torch.bfloat16
    assert rel(x.grad, want) <= 1e-2


def test_tiled_mlp_tiles_the_tokens_of_a_2d_input():
    torch.manual_seed(2)
    mlp = SwiGLU(8, 20)
    x = torch.randn(37, 8, dtype=torch.float64)
    assert rel(TiledMLP(mlp, 4)(x), mlp(x)) <= 1e-12
