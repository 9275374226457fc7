"""The compute floor of a step: its model FLOPs at the devices' catalog rates, with nothing else paid.

A plan's predicted step is at least this whatever the parallelism (layouts, groups, pipelines), so a plan's step
over its floor says how far the chosen parallelism is from the hardware, and the fraction of the devices' dense peak
the step uses (model FLOPs utilisation) follows from the same count."""

from typing import Optional, Sequence, Tuple

from .. import _core
from ..errors import UnsupportedError
from .cluster import Cluster
from .model import Model

__all__ = ["model_flops", "peak_flops", "compute_floor_s", "catalog_rate"]


def _catalog():
    return {g["name"]: g for g in _core.gpu_catalog()}


def catalog_rate(node, efficiency: Optional[str] = "gemm_eff") -> float:
    """One device's rate in FLOP/s on a node: its peak (the node's override, else the catalog's) times its "gemm_eff"
    or "attn_eff" (the node's, else the catalog's), or the peak itself (efficiency None)."""
    spec = _catalog().get(node.gpu, {})
    peak = node.peak_tflops or spec.get("peak_tflops")
    eff = 1.0 if efficiency is None else (getattr(node, efficiency) or spec.get(efficiency))
    if not peak or not eff:
        raise UnsupportedError(f"GPU model {node.gpu!r} has no peak rate or {efficiency} in the catalog or its node: "
                               "give peak_tflops, gemm_eff and attn_eff")
    return peak * 1e12 * eff


_MEASURED = {"gemm_eff": ("gemm_tflops",), "attn_eff": ("attn_tflops", "attn_causal_tflops", "attn_document_tflops")}


def peak_flops(cluster: Cluster, efficiency: Optional[str] = "gemm_eff") -> float:
    """The cluster's dense rate in FLOP/s: catalog_rate of every device, summed; where a device's rates were measured
    (the cluster's DeviceRates), the fastest measured point when it is faster, so that the floor stays below what
    the cost model prices with the measured curves."""
    total, d = 0.0, 0
    for node in cluster.nodes:
        for _ in range(node.count):
            rates = cluster.devices[d] if cluster.devices is not None else None
            measured = [t * 1e12 for field in _MEASURED.get(efficiency, ()) if rates is not None
                        for _, t in (getattr(rates, field) or ())]
            try:
                rate = catalog_rate(node, efficiency)
            except UnsupportedError:
                if not measured:
                    raise
                rate = 0.0
            total += max([rate] + measured)
            d += 1
    return total


def _pairs(length: int, window: Optional[int], causal: bool) -> float:
    if not causal:
        return float(length) * length
    if window is None or window >= length:
        return length * (length + 1) / 2.0
    return window * (window + 1) / 2.0 + (length - window) * float(window)


def model_flops(model: Model, seq_len, sequences: int = 1, causal: bool = True,
                documents: Optional[Sequence[Sequence[int]]] = None) -> Tuple[float, float]:
    """The model FLOPs of a training step (forward and backward, no recomputation), as (matmul, attention): 6 per
    matmul parameter and token (the layers and the output head), and 12 per visible attention pair, head dim and
    query head (a window hides pairs; documents: each sequence's document lengths, whose mask hides the pairs across
    them). seq_len: one length for `sequences` sequences, or with documents ignored (their lengths say it)."""
    one = Model(1, model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn, 1, model.dtype_bytes,
                model.gated_mlp)
    layer = float(_core.model_params(one._as_core())) - 3.0 * model.hidden  # less its 1-word embedding, head, norm
    matmul = model.layers * layer + model.vocab * model.hidden
    docs = documents if documents is not None else [[int(seq_len)]] * int(sequences)
    sliding = model.sliding_layers or 0
    tokens, visible = 0, 0.0
    for seq in docs:
        for d in seq:
            tokens += int(d)
            visible += (model.layers - sliding) * _pairs(int(d), None, causal) + sliding * _pairs(
                int(d), model.sliding_window, causal)
    return 6.0 * tokens * matmul, 12.0 * visible * model.head_dim * model.heads


def compute_floor_s(cluster: Cluster, model: Model, seq_len, sequences: int = 1, causal: bool = True,
                    documents=None) -> float:
    """The step's model FLOPs (model_flops) at the devices' catalog rates, the matmuls at peak x gemm_eff and the
    attention at peak x attn_eff, every device busy and nothing else paid: no plan of any parallelism is faster."""
    matmul, attention = model_flops(model, seq_len, sequences, causal, documents)
    return matmul / peak_flops(cluster, "gemm_eff") + attention / peak_flops(cluster, "attn_eff")
