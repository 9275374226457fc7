"""Cluster descriptions: nodes of GPUs, the links inside and between them."""

import json
import os
from dataclasses import asdict, dataclass
from typing import List, Optional

import numpy as np

from . import _core
from ._validate import integer, number
from .errors import InvalidArgumentError

__all__ = ["Node", "Cluster", "gpu_catalog"]


def gpu_catalog():
    """The built-in GPU catalog: a list of dicts (name, peak_tflops, memory_gib, hbm_gbps, gemm_eff,
    attn_eff, source)."""
    return _core.gpu_catalog()


@dataclass(frozen=True)
class Node:
    """`count` GPUs of one model behind a switch of `intra_gbps` GB/s per device and direction.

    The optional fields override the catalog for this node (e.g. with measured rates)."""

    gpu: str
    count: int
    intra_gbps: float
    memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None
    gemm_eff: Optional[float] = None
    attn_eff: Optional[float] = None

    def _as_core(self):
        def opt(x):
            return 0.0 if x is None else x

        return (self.gpu, self.count, self.intra_gbps, opt(self.memory_gib), opt(self.peak_tflops),
                opt(self.gemm_eff), opt(self.attn_eff))


_NODE_KEYS = {"gpu", "count", "intra_gbps", "memory_gib", "peak_tflops", "gemm_eff", "attn_eff"}


class Cluster:
    """A heterogeneous cluster. Devices are numbered node by node, in the order the nodes are listed.

    Bandwidths are GB/s (1e9 bytes/s) per device and direction. `bandwidth_gbps`, when given, is a full
    device-by-device matrix that replaces the node-derived links (its diagonal is ignored)."""

    def __init__(self, nodes: List[Node], inter_node_gbps: float = 25.0, bandwidth_gbps=None):
        if not isinstance(nodes, (list, tuple)) or not nodes:
            raise InvalidArgumentError(f"nodes must be a non-empty list, got {nodes!r}")
        checked = []
        for i, node in enumerate(nodes):
            if isinstance(node, dict):
                node = _node_from_dict(node, f"nodes[{i}]")
            if not isinstance(node, Node):
                raise InvalidArgumentError(f"nodes[{i}] must be a Node or a dict, got {node!r}")
            if not isinstance(node.gpu, str):
                raise InvalidArgumentError(f"nodes[{i}].gpu must be a GPU model name, got {node.gpu!r}")
            node = Node(
                gpu=node.gpu,
                count=integer(node.count, f"nodes[{i}].count"),
                intra_gbps=number(node.intra_gbps, f"nodes[{i}].intra_gbps"),
                memory_gib=number(node.memory_gib, f"nodes[{i}].memory_gib", positive=True, optional=True),
                peak_tflops=number(node.peak_tflops, f"nodes[{i}].peak_tflops", positive=True, optional=True),
                gemm_eff=number(node.gemm_eff, f"nodes[{i}].gemm_eff", positive=True, optional=True),
                attn_eff=number(node.attn_eff, f"nodes[{i}].attn_eff", positive=True, optional=True),
            )
            checked.append(node)
        self.nodes = tuple(checked)
        self.inter_node_gbps = number(inter_node_gbps, "inter_node_gbps")
        if bandwidth_gbps is not None:
            try:
                bandwidth_gbps = np.array(bandwidth_gbps, dtype=np.float64)
            except (TypeError, ValueError):
                raise InvalidArgumentError("bandwidth_gbps must be a square matrix of numbers") from None
            n = sum(node.count for node in checked)
            if bandwidth_gbps.shape != (n, n):
                raise InvalidArgumentError(f"bandwidth_gbps must be a {n} x {n} matrix (one row per device), "
                                           f"got shape {bandwidth_gbps.shape}")
            bandwidth_gbps.setflags(write=False)
        self.bandwidth_gbps = bandwidth_gbps
        # The core validates every value (counts, bandwidths, known GPU models) and names the field.
        self.num_devices = _core.check_cluster(self._core_nodes(), self.inter_node_gbps, self.bandwidth_gbps)
        # Canonical GPU names (aliases like "A100" resolved).
        self.nodes = tuple(Node(**{**asdict(n), "gpu": _core.gpu_find(n.gpu)}) for n in self.nodes)

    # ------------------------------------------------------------------ construction

    @classmethod
    def example(cls) -> "Cluster":
        """One node of 8 H100-SXM (NVLink 450 GB/s) and one of 8 A100-80G (NVLink 300 GB/s), 25 GB/s between."""
        return cls([Node("H100-SXM", 8, 450.0), Node("A100-80G", 8, 300.0)], inter_node_gbps=25.0)

    @classmethod
    def from_dict(cls, spec: dict) -> "Cluster":
        if not isinstance(spec, dict):
            raise InvalidArgumentError(f"a cluster description must be a mapping, got {type(spec).__name__}")
        unknown = set(spec) - {"nodes", "inter_node_gbps", "bandwidth_gbps"}
        if unknown:
            raise InvalidArgumentError(f"unknown cluster field(s) {sorted(unknown)}; "
                                       "expected nodes, inter_node_gbps, bandwidth_gbps")
        if "nodes" not in spec:
            raise InvalidArgumentError("cluster description needs a 'nodes' list")
        nodes = spec["nodes"]
        if not isinstance(nodes, list):
            raise InvalidArgumentError(f"nodes must be a list, got {nodes!r}")
        inter = spec.get("inter_node_gbps", 25.0 if len(nodes) > 1 else 1.0)
        if len(nodes) > 1 and "inter_node_gbps" not in spec and spec.get("bandwidth_gbps") is None:
            raise InvalidArgumentError("inter_node_gbps is required for a cluster of several nodes")
        return cls([_node_from_dict(n, f"nodes[{i}]") for i, n in enumerate(nodes)], inter,
                   spec.get("bandwidth_gbps"))

    @classmethod
    def from_file(cls, path) -> "Cluster":
        """Read a YAML (.yaml, .yml) or JSON file in the format of `from_dict`."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read cluster file {path!r}: {e.strerror}") from None
        if path.endswith(".json"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"{path}: not valid JSON: {e}") from None
        else:
            import yaml

            try:
                spec = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise InvalidArgumentError(f"{path}: not valid YAML: {e}") from None
        return cls.from_dict(spec)

    def to_dict(self) -> dict:
        nodes = []
        for n in self.nodes:
            d = {"gpu": n.gpu, "count": n.count, "intra_gbps": n.intra_gbps}
            for k in ("memory_gib", "peak_tflops", "gemm_eff", "attn_eff"):
                if getattr(n, k) is not None:
                    d[k] = getattr(n, k)
            nodes.append(d)
        out = {"nodes": nodes, "inter_node_gbps": self.inter_node_gbps}
        if self.bandwidth_gbps is not None:
            out["bandwidth_gbps"] = self.bandwidth_gbps.tolist()
        return out

    # ------------------------------------------------------------------ queries

    def _core_nodes(self):
        return [n._as_core() for n in self.nodes]

    def _core_args(self):
        return self._core_nodes(), self.inter_node_gbps, self.bandwidth_gbps

    @property
    def device_gpus(self) -> np.ndarray:
        """GPU model name of every device, in device order."""
        return np.array([n.gpu for n in self.nodes for _ in range(n.count)])

    @property
    def device_nodes(self) -> np.ndarray:
        """Node index of every device, in device order."""
        return np.repeat(np.arange(len(self.nodes), dtype=np.int32), [n.count for n in self.nodes])

    def describe(self) -> str:
        parts = [f"{n.count}x {n.gpu}" for n in self.nodes]
        return f"{self.num_devices} devices ({', '.join(parts)})"

    def __eq__(self, other):
        return isinstance(other, Cluster) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"Cluster({self.describe()}, inter_node_gbps={self.inter_node_gbps})"


def _node_from_dict(d, where) -> Node:
    if isinstance(d, Node):
        return d
    if not isinstance(d, dict):
        raise InvalidArgumentError(f"{where} must be a mapping like {{gpu: H100-SXM, count: 8, intra_gbps: 450}}, got {d!r}")
    unknown = set(d) - _NODE_KEYS
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown field(s) {sorted(unknown)}; expected {sorted(_NODE_KEYS)}")
    for key in ("gpu", "count", "intra_gbps"):
        if key not in d:
            if key == "intra_gbps" and d.get("count") == 1:
                continue
            raise InvalidArgumentError(f"{where}.{key} is required")
    return Node(gpu=d["gpu"], count=d["count"], intra_gbps=d.get("intra_gbps", 1.0),
                memory_gib=d.get("memory_gib"), peak_tflops=d.get("peak_tflops"),
                gemm_eff=d.get("gemm_eff"), attn_eff=d.get("attn_eff"))
