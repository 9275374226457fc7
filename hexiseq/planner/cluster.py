"""Cluster descriptions: nodes of GPUs, the links inside and between them, and what was measured on them."""

import copy
import dataclasses
import datetime
import math
import numbers
import os
import warnings
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import numpy as np

from .. import _core
from .._validate import MAX_NESTING, core_integer, load_json, nesting, number, read_text
from ..errors import ArgumentTypeError, InvalidArgumentError, UnknownGPUError

__all__ = ["Node", "DeviceRates", "Cluster", "gpu_catalog"]

MAX_CURVE_POINTS = 16  # the core's HEXISEQ_MAX_CURVE


def gpu_catalog():
    """The built-in GPU catalog: a list of dicts (name, aliases, peak_tflops, memory_gib, hbm_gbps, gemm_eff,
    attn_eff, source, attn_kernel, host_gbps: the host link per direction); `aliases` are the short names that also
    mean the model (e.g. "H100" for H100-SXM)."""
    return _core.gpu_catalog()


@dataclass(frozen=True)
class Node:
    """`count` GPUs of one model behind a switch of `intra_gbps` GB/s per device and direction.

    The optional fields override the catalog for this node (e.g. with measured rates). `host`: the name of the machine
    the node is (hexiseq calibrate writes it); a job restarted on fewer machines finds its devices by it
    (hexiseq.elastic.survivors). host_memory_gib: the machine's memory that offloaded activation checkpoints may
    use, shared evenly by the node's devices (default: twice the node's device memory)."""

    gpu: str
    count: int
    intra_gbps: float
    memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None
    gemm_eff: Optional[float] = None
    attn_eff: Optional[float] = None
    host: Optional[str] = None
    host_memory_gib: Optional[float] = None

    def _as_core(self):
        def opt(x):
            return 0.0 if x is None else x

        return (self.gpu, self.count, self.intra_gbps, opt(self.memory_gib), opt(self.peak_tflops),
                opt(self.gemm_eff), opt(self.attn_eff), opt(self.host_memory_gib))


_NODE_KEYS = {"gpu", "count", "intra_gbps", "memory_gib", "peak_tflops", "gemm_eff", "attn_eff", "host",
              "host_memory_gib"}

Curve = Tuple[Tuple[float, float], ...]
_CURVES = ("gemm_tflops", "attn_tflops", "attn_causal_tflops", "attn_document_tflops", "runtime_ns",
           "runtime_a2a_ns", "runtime_ring_ns")


@dataclass(frozen=True)
class DeviceRates:
    """What was measured on one device; every field is optional.

    memory_gib: the device's memory (replaces the node's).
    gemm_tflops: [(rows, TFLOP/s), ...] for the token-parallel matmuls, the rate counted as forward FLOPs
        times 3 (forward + backward at 2 forwards) over the forward + backward seconds.
    attn_tflops: [(n, TFLOP/s), ...] for a full (unmasked) n x n attention block, counted as
        4 * n * n * head_dim * heads * 3.5 over the forward + backward seconds.
    attn_causal_tflops: the same for a causal n x n block, counting its n (n + 1) / 2 visible pairs.
    attn_document_tflops: [(n, TFLOP/s), ...] for documents of n tokens packed in one long causal block under the
        document mask, counting their visible pairs; under documents shorter than a block the cost model prices
        the pairs at this rate (packed short documents run slower per pair than a lone block of their length).
    runtime_ns: [(elements, ns per element), ...]: the runtime's work outside the attention kernels and the
        collectives (the group's tensors and accumulators, bookkeeping), one attention layer forward + backward,
        timed on one-device layers of elements = tokens * (heads + 2 kv_heads) * head_dim.
    runtime_a2a_ns: the same for what a member of a larger group hands to and takes from the all-to-all, per
        element of its own tokens * (heads + 2 kv_heads) * head_dim (packing, unpacking, the collective's copies).
    runtime_ring_ns: the same for a member of a ring of several groups, per element of the other groups' K, V
        blocks it receives for its kv heads, (seq_len - S_g) * 2 kv * head_dim (assembly, gradient accumulators).
    mem_bound_gbps: the rate of the memory-bound work beside the matmuls (norms, residual adds, rotary,
        activations, the loss, the optimizer step), GB of the bytes the cost model counts for it per second
        (hexiseq.calibrate times a layer's norms, residual adds, rotary and activation); default: the catalog's
        memory bandwidth times 0.75.
    host_gbps: the host link's rate, GB/s per direction, of pinned asynchronous copies (what offloaded checkpoints
        travel at); default: the catalog's PCIe rate times 0.8.
    Sizes strictly increase; the cost model interpolates linearly in log(size) and clamps outside. A curve
    replaces the catalog's (or the node's) rates for that kind of work on that device."""

    memory_gib: Optional[float] = None
    gemm_tflops: Optional[Curve] = None
    attn_tflops: Optional[Curve] = None
    attn_causal_tflops: Optional[Curve] = None
    attn_document_tflops: Optional[Curve] = None
    runtime_ns: Optional[Curve] = None
    runtime_a2a_ns: Optional[Curve] = None
    runtime_ring_ns: Optional[Curve] = None
    mem_bound_gbps: Optional[float] = None
    host_gbps: Optional[float] = None

    @classmethod
    def from_dict(cls, d, where="device") -> "DeviceRates":
        if isinstance(d, DeviceRates):
            d = d.to_dict()
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"{where} must be a mapping with memory_gib, gemm_tflops, attn_tflops, "
                                       f"attn_causal_tflops, attn_document_tflops, runtime_ns, runtime_a2a_ns, runtime_ring_ns, "
                                       f"mem_bound_gbps, host_gbps, or null, got {d!r}")
        unknown = set(d) - {"memory_gib", "mem_bound_gbps", "host_gbps", *_CURVES}
        if unknown:
            raise InvalidArgumentError(f"{where}: unknown field(s) {sorted(unknown)}; "
                                       f"expected {sorted({'memory_gib', 'mem_bound_gbps', 'host_gbps', *_CURVES})}")
        curves = {k: _curve(d.get(k), f"{where}.{k}") for k in _CURVES}
        return cls(memory_gib=number(d.get("memory_gib"), f"{where}.memory_gib", positive=True, optional=True),
                   mem_bound_gbps=number(d.get("mem_bound_gbps"), f"{where}.mem_bound_gbps", positive=True,
                                         optional=True),
                   host_gbps=number(d.get("host_gbps"), f"{where}.host_gbps", positive=True, optional=True),
                   **curves)

    def to_dict(self) -> dict:
        out = {}
        if self.memory_gib is not None:
            out["memory_gib"] = self.memory_gib
        for k in _CURVES:
            if getattr(self, k) is not None:
                out[k] = [list(p) for p in getattr(self, k)]
        if self.mem_bound_gbps is not None:
            out["mem_bound_gbps"] = self.mem_bound_gbps
        if self.host_gbps is not None:
            out["host_gbps"] = self.host_gbps
        return out

    @property
    def measured(self) -> bool:
        """Whether any rate (a curve or the memory-bound rate) is given."""
        return (any(getattr(self, k) is not None for k in _CURVES) or self.mem_bound_gbps is not None
                or self.host_gbps is not None)

    def _as_core(self):
        return (0.0 if self.memory_gib is None else self.memory_gib,
                *(getattr(self, k) for k in _CURVES), 0.0 if self.mem_bound_gbps is None else self.mem_bound_gbps,
                0.0 if self.host_gbps is None else self.host_gbps)


def _curve(value, where) -> Optional[Curve]:
    """A curve as a tuple of (size, tflops) float pairs; None or an empty list mean none. The core checks
    that sizes increase and that every number is positive and names the point."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise InvalidArgumentError(f"{where} must be a list of [size, tflops] pairs, got {value!r}")
    if len(value) > MAX_CURVE_POINTS:
        raise InvalidArgumentError(f"{where} has {len(value)} points, at most {MAX_CURVE_POINTS}")
    points = []
    for k, pair in enumerate(value):
        if isinstance(pair, (str, bytes, dict)) or not isinstance(pair, (list, tuple, np.ndarray)) or len(pair) != 2:
            raise InvalidArgumentError(f"{where}[{k}] must be a [size, tflops] pair, got {pair!r}")
        points.append((number(pair[0], f"{where}[{k}] size"), number(pair[1], f"{where}[{k}] tflops")))
    return tuple(points) or None


def _plain(value, where):
    """A YAML- and JSON-safe copy of `value` (str, int, float, bool, None, lists, dicts with str keys). Dates and
    times (what YAML makes of an unquoted 2025-06-01) become their ISO text."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        if not math.isfinite(f):
            raise InvalidArgumentError(f"{where} must be a finite number, got {value!r}")
        return f
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"{where} keys must be strings, got {k!r}")
            out[k] = _plain(v, f"{where}.{k}")
        return out
    raise InvalidArgumentError(f"{where} must hold only strings, numbers, booleans, lists and mappings, "
                               f"got {value!r}")


class Cluster:
    """A heterogeneous cluster. Devices are numbered node by node, in the order the nodes are listed.

    Bandwidths are GB/s (1e9 bytes/s) per device and direction. `bandwidth_gbps`, when given, is a full
    device-by-device matrix that replaces the node-derived links (its diagonal is ignored).
    `latency_us`: the fixed cost of one message, microseconds: one number for every pair or a full matrix
    (diagonal ignored); default 10 us inside a node, 20 us between nodes.
    `devices`: None or one entry per device, each None or a DeviceRates (or its dict) of measured rates.
    `calibration`: None or a plain mapping carried along unchanged (what was measured, how, when).

    A GPU model outside the catalog is accepted when every device of its node is fully described: memory
    (the node's memory_gib or each device's) and rates (the node's peak_tflops, gemm_eff and attn_eff, or
    gemm and attn curves on each device)."""

    def __init__(self, nodes: List[Node], inter_node_gbps: float = 25.0, bandwidth_gbps=None, latency_us=None,
                 devices=None, calibration=None):
        if not isinstance(nodes, (list, tuple)) or not nodes:
            raise InvalidArgumentError(f"nodes must be a non-empty list, got {nodes!r}")
        most = _core.int_range("devices")[1]  # every node holds a device at least: the core's limit on devices
        if len(nodes) > most:
            raise InvalidArgumentError(f"nodes must list at most {most} nodes (the core's limit on devices), "
                                       f"got {len(nodes)}")
        checked = []
        for i, node in enumerate(nodes):
            if isinstance(node, dict):
                node = _node_from_dict(node, f"nodes[{i}]")
            if not isinstance(node, Node):
                raise InvalidArgumentError(f"nodes[{i}] must be a Node or a dict, got {node!r}")
            if not isinstance(node.gpu, str):
                raise InvalidArgumentError(f"nodes[{i}].gpu must be a GPU model name, got {node.gpu!r}")
            if "\0" in node.gpu:  # C strings end at a NUL: the core would read another name
                raise InvalidArgumentError(f"nodes[{i}].gpu must not contain a NUL character, got {node.gpu!r}")
            node = Node(
                gpu=node.gpu,
                count=core_integer(node.count, f"nodes[{i}].count", "nodes.count"),
                intra_gbps=number(node.intra_gbps, f"nodes[{i}].intra_gbps"),
                memory_gib=number(node.memory_gib, f"nodes[{i}].memory_gib", positive=True, optional=True),
                peak_tflops=number(node.peak_tflops, f"nodes[{i}].peak_tflops", positive=True, optional=True),
                gemm_eff=number(node.gemm_eff, f"nodes[{i}].gemm_eff", positive=True, optional=True),
                attn_eff=number(node.attn_eff, f"nodes[{i}].attn_eff", positive=True, optional=True),
                host=node.host,
                host_memory_gib=number(node.host_memory_gib, f"nodes[{i}].host_memory_gib", positive=True,
                                       optional=True),
            )
            if node.host is not None and (not isinstance(node.host, str) or not node.host.strip()):
                raise InvalidArgumentError(f"nodes[{i}].host must be a machine's name (a non-empty string), got "
                                           f"{node.host!r}")
            checked.append(node)
        self.nodes = tuple(checked)
        self.inter_node_gbps = number(inter_node_gbps, "inter_node_gbps")
        n = sum(node.count for node in checked)
        if bandwidth_gbps is not None:
            try:
                bandwidth_gbps = np.array(bandwidth_gbps, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):
                raise InvalidArgumentError("bandwidth_gbps must be a square matrix of numbers") from None
            if bandwidth_gbps.shape != (n, n):
                raise InvalidArgumentError(f"bandwidth_gbps must be a {n} x {n} matrix (one row per device), "
                                           f"got shape {bandwidth_gbps.shape}")
            for d in range(n):  # unused by the cost model, but written with the description: strict JSON has no NaN
                if not math.isfinite(bandwidth_gbps[d, d]):
                    raise InvalidArgumentError(f"bandwidth_gbps[{d}][{d}] must be a finite number (the diagonal is not "
                                               f"used: write 0), got {float(bandwidth_gbps[d, d])!r}")
            bandwidth_gbps.setflags(write=False)
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_us = _latency(latency_us, n)
        self.devices = _devices(devices, n)
        self._calibration = None if calibration is None else _plain(nesting(calibration, "calibration"), "calibration")
        if self._calibration is not None and not isinstance(self._calibration, dict):
            raise InvalidArgumentError(f"calibration must be a mapping, got {calibration!r}")
        # The core validates every value (counts, bandwidths, latencies, curves, GPU models) and names the field.
        self.num_devices = _core.check_cluster(*self._core_args())
        # Canonical GPU names (aliases like "A100" resolved); models outside the catalog keep their name.
        self.nodes = tuple(Node(**{**asdict(n), "gpu": _canonical_gpu(n.gpu)}) for n in self.nodes)
        _warn_implausible(self)

    @property
    def calibration(self) -> Optional[dict]:
        """The calibration record given at construction (a copy), or None."""
        return copy.deepcopy(self._calibration)

    # ------------------------------------------------------------------ construction

    @classmethod
    def example(cls) -> "Cluster":
        """One node of 8 H100-SXM (NVLink 450 GB/s) and one of 8 A100-80G (NVLink 300 GB/s), 25 GB/s between."""
        return cls([Node("H100-SXM", 8, 450.0), Node("A100-80G", 8, 300.0)], inter_node_gbps=25.0)

    @classmethod
    def from_dict(cls, spec: dict) -> "Cluster":
        if not isinstance(spec, dict):
            hint = (f" ({spec!r} looks like a file: use Cluster.from_file)" if isinstance(spec, (str, os.PathLike))
                    else "")
            raise InvalidArgumentError(f"a cluster description must be a mapping, got {type(spec).__name__}{hint}")
        unknown = set(spec) - set(_CLUSTER_KEYS)
        if unknown:
            raise InvalidArgumentError(f"unknown cluster field(s) {sorted(unknown)}; "
                                       f"expected {', '.join(_CLUSTER_KEYS)}")
        if "nodes" not in spec:
            raise InvalidArgumentError("cluster description needs a 'nodes' list")
        nodes = spec["nodes"]
        if not isinstance(nodes, list):
            raise InvalidArgumentError(f"nodes must be a list, got {nodes!r}")
        inter = spec.get("inter_node_gbps", 25.0 if len(nodes) > 1 else 1.0)
        if len(nodes) > 1 and "inter_node_gbps" not in spec and spec.get("bandwidth_gbps") is None:
            raise InvalidArgumentError("inter_node_gbps is required for a cluster of several nodes")
        return cls([_node_from_dict(n, f"nodes[{i}]") for i, n in enumerate(nodes)], inter,
                   spec.get("bandwidth_gbps"), latency_us=spec.get("latency_us"), devices=spec.get("devices"),
                   calibration=spec.get("calibration"))

    @classmethod
    def from_file(cls, path) -> "Cluster":
        """Read a YAML (.yaml, .yml) or JSON file in the format of `from_dict`."""
        try:
            path = os.fsdecode(path)  # str, bytes or os.PathLike, as open() takes them
        except TypeError:
            raise ArgumentTypeError(f"path must be a file path (str, bytes or os.PathLike), got "
                                    f"{type(path).__name__} {path!r}") from None
        text = read_text(path, "cluster file")
        if path.endswith(".json"):
            spec = load_json(text, f"cluster file {path!r}")
        else:
            import yaml

            try:
                spec = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise InvalidArgumentError(_yaml_error(path, e)) from None
            except RecursionError:
                raise InvalidArgumentError(f"cluster file {path!r} is nested too deeply (at most {MAX_NESTING} "
                                           f"levels)") from None
            nesting(spec, f"cluster file {path!r}")
        return cls.from_dict(spec)

    def to_dict(self) -> dict:
        nodes = []
        for n in self.nodes:
            d = {"gpu": n.gpu, "count": n.count, "intra_gbps": n.intra_gbps}
            for k in ("memory_gib", "peak_tflops", "gemm_eff", "attn_eff", "host", "host_memory_gib"):
                if getattr(n, k) is not None:
                    d[k] = getattr(n, k)
            nodes.append(d)
        out = {"nodes": nodes, "inter_node_gbps": self.inter_node_gbps}
        if self.bandwidth_gbps is not None:
            out["bandwidth_gbps"] = self.bandwidth_gbps.tolist()
        if self.latency_us is not None:
            out["latency_us"] = self.latency_us if isinstance(self.latency_us, float) else self.latency_us.tolist()
        if self.devices is not None:
            out["devices"] = [None if d is None else d.to_dict() for d in self.devices]
        if self._calibration is not None:
            out["calibration"] = copy.deepcopy(self._calibration)
        return out

    def to_yaml(self, path=None) -> str:
        """The description as YAML (the from_dict format), written to `path` when one is given. Floats are
        written as Python's repr, so `Cluster.from_file(path)` gives back an equal cluster exactly."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)
        if path is not None:
            path = os.fspath(path)
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError as e:
                raise InvalidArgumentError(f"cannot write cluster file {path!r}: {e.strerror}") from None
        return text

    def subset(self, devices) -> "Cluster":
        """The cluster of the given devices alone (a list of distinct device indices), renumbered 0.. in the order of
        their indices: each node keeps the devices it had among them (same model, links and overrides), a bandwidth
        or latency matrix keeps their rows and columns, measured rates stay with their device. What a group of a
        batch plan runs on."""
        return self._pick(device_set(devices, self.num_devices, "devices"))

    def _pick(self, chosen) -> "Cluster":
        """The cluster of the devices `chosen` (distinct indices) in that order; each node's devices must be
        consecutive in it."""
        node_of = self.device_nodes
        nodes, seen = [], set()
        for d in chosen:
            if nodes and nodes[-1][0] == node_of[d]:
                nodes[-1][1] += 1
            elif node_of[d] in seen:
                raise InvalidArgumentError(f"the devices of node {int(node_of[d])} must be consecutive in the order "
                                           f"given, got {list(chosen)!r}")
            else:
                nodes.append([node_of[d], 1])
                seen.add(node_of[d])
        idx = np.array(chosen)
        lat = self.latency_us
        with warnings.catch_warnings():  # this cluster's own figures were warned about once, when it was made
            warnings.simplefilter("ignore", UserWarning)
            return Cluster([dataclasses.replace(self.nodes[i], count=c) for i, c in nodes], self.inter_node_gbps,
                           bandwidth_gbps=None if self.bandwidth_gbps is None else self.bandwidth_gbps[np.ix_(idx, idx)],
                           latency_us=lat if lat is None or isinstance(lat, float) else lat[np.ix_(idx, idx)],
                           devices=None if self.devices is None else [self.devices[d] for d in chosen])

    def without(self, devices) -> "Cluster":
        """This cluster less the given devices (indices as its plans number them): what a job restarted on the
        survivors of a lost device or node plans on (then hexiseq.checkpoint.load_states re-shards the last
        checkpoint to the new plan's shares). The survivors keep their order, nodes, links and measured rates, as
        in subset(); the calibration record stays, its per-device block_backends cut the same way, and its
        dropped_devices lists each drop's devices (in the numbering of the cluster they were dropped from)."""
        lost = set(device_set(devices, self.num_devices, "devices"))
        kept = [d for d in range(self.num_devices) if d not in lost]
        if not kept:
            raise InvalidArgumentError(f"devices {sorted(lost)} are every device of the cluster: none would be left")
        return self.for_ranks(kept)

    def for_ranks(self, devices) -> "Cluster":
        """The cluster of the given devices in the order given: device r of the result is devices[r] of this one,
        what a restarted job whose rank r runs on that device plans on (plans number devices as the ranks). Each
        node's devices must be consecutive in the list (torchrun numbers a machine's processes consecutively). As
        in without(): links and measured rates go with their devices, the calibration's per-device block_backends
        follow them, and the devices left out (if any) are added to its dropped_devices."""
        if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
            raise InvalidArgumentError(f"devices must be a list of device indices, got {devices!r}")
        order = list(devices)
        if len(device_set(order, self.num_devices, "devices")) != len(order):
            raise InvalidArgumentError(f"devices must hold distinct device indices, got {order!r}")
        order = [int(d) for d in order]
        out = self._pick(order)
        cal = self.calibration
        if cal is None:
            return out
        backends = cal.get("block_backends")
        if isinstance(backends, list) and len(backends) == self.num_devices:
            cal["block_backends"] = [backends[d] for d in order]
        lost = sorted(set(range(self.num_devices)) - set(order))
        if lost:  # one list per drop, each in the numbering of the cluster it was dropped from
            cal["dropped_devices"] = list(cal.get("dropped_devices") or []) + [lost]
        out._calibration = _plain(cal, "calibration")
        return out

    def host_devices(self) -> dict:
        """{host: its devices in order} of the nodes that name their host (hexiseq calibrate writes the names)."""
        out, start = {}, 0
        for n in self.nodes:
            if n.host is not None:
                out.setdefault(n.host, []).extend(range(start, start + n.count))
            start += n.count
        return out

    # ------------------------------------------------------------------ queries

    def _core_nodes(self):
        return [n._as_core() for n in self.nodes]

    def _core_args(self):
        """The cluster as the core's functions take it: nodes, inter_node_gbps, bandwidth, latency, devices."""
        lat = self.latency_us
        if isinstance(lat, float):
            n = sum(node.count for node in self.nodes)
            lat = np.full((n, n), lat)
        devices = None if self.devices is None else [None if d is None else d._as_core() for d in self.devices]
        return self._core_nodes(), self.inter_node_gbps, self.bandwidth_gbps, lat, devices

    @property
    def device_gpus(self) -> np.ndarray:
        """GPU model name of every device, in device order."""
        return np.array([n.gpu for n in self.nodes for _ in range(n.count)])

    @property
    def device_nodes(self) -> np.ndarray:
        """Node index of every device, in device order."""
        return np.repeat(np.arange(len(self.nodes), dtype=np.int32), [n.count for n in self.nodes])

    @property
    def measured(self) -> bool:
        """Whether any device carries measured rate curves."""
        return self.devices is not None and any(d is not None and d.measured for d in self.devices)

    def describe(self) -> str:
        """"16 devices (8x H100-SXM, 8x A100-80G)": node by node up to 8 nodes; past that, the devices of each model
        summed ("8192 devices in 1024 nodes: 1368x H100-SXM, ..."), so that a large cluster's header stays a line."""
        if len(self.nodes) <= 8:
            parts = [f"{n.count}x {n.gpu}" for n in self.nodes]
            text = f"{self.num_devices} devices ({', '.join(parts)})"
        else:
            totals = {}
            for n in self.nodes:
                totals[n.gpu] = totals.get(n.gpu, 0) + n.count
            text = (f"{self.num_devices} devices in {len(self.nodes)} nodes ("
                    f"{', '.join(f'{c}x {g}' for g, c in totals.items())})")
        if self.measured:
            k = sum(1 for d in self.devices if d is not None and d.measured)
            text += f", measured rates on {k} of them" if k < self.num_devices else ", measured rates"
        return text

    def __eq__(self, other):
        return isinstance(other, Cluster) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"Cluster({self.describe()}, inter_node_gbps={self.inter_node_gbps})"


def _yaml_error(path, e) -> str:
    """One line for a YAML syntax error: the file, the line and column (1-based) where the parser stopped, what it
    expected, and where the construct it was reading began."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    began = (f" ({context} at line {start.line + 1}, column {start.column + 1})"
             if context and start is not None else "")
    return f"{path}:{where}: not valid YAML: {what}{began}"


# Links faster than this (GB/s per device and direction) are taken for Gbit/s written as GB/s: NVLink 5 gives 900.
_MOST_GBPS = 2000.0


def device_set(devices, n, where):
    """`devices` as a sorted tuple of distinct device indices in [0, n), at least one; InvalidArgumentError naming
    `where` and the value otherwise."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise InvalidArgumentError(f"{where} must be a list of device indices, got {devices!r}")
    try:
        chosen = tuple(sorted(int(d) for d in devices))
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{where} must be a list of device indices, got {devices!r}") from None
    if not chosen or len(set(chosen)) != len(chosen) or chosen[0] < 0 or chosen[-1] >= n:
        raise InvalidArgumentError(f"{where} must hold distinct device indices in [0, {n}), at least one, "
                                   f"got {list(devices)!r}")
    return chosen


def _warn_implausible(cluster):
    """Warn (never refuse: a figure may be right for hardware the catalog does not know) about values that look like
    a unit slip, naming the field, the value and the catalog's figure: links past 2,000 GB/s (Gbit/s?), memory past
    3x the catalog's for its GPU (MiB?), peak past 3x the catalog's."""
    catalog = {g["name"]: g for g in gpu_catalog()}

    def warn(text):
        warnings.warn("hexiseq: " + text, UserWarning, stacklevel=4)

    if cluster.inter_node_gbps > _MOST_GBPS:
        warn(f"inter_node_gbps = {cluster.inter_node_gbps:g} GB/s is past any link built (NVLink 5: 900 GB/s); "
             f"bandwidths are GB/s (bytes), is it Gbit/s ({cluster.inter_node_gbps / 8:g} GB/s)?")
    for i, n in enumerate(cluster.nodes):
        if n.intra_gbps > _MOST_GBPS:
            warn(f"nodes[{i}].intra_gbps = {n.intra_gbps:g} GB/s is past any link built (NVLink 5: 900 GB/s); "
                 f"bandwidths are GB/s (bytes), is it Gbit/s ({n.intra_gbps / 8:g} GB/s)?")
        entry = catalog.get(n.gpu)
        if entry is None:
            continue
        if n.memory_gib is not None and n.memory_gib > 3 * entry["memory_gib"]:
            warn(f"nodes[{i}].memory_gib = {n.memory_gib:g} is {n.memory_gib / entry['memory_gib']:.0f}x the "
                 f"catalog's {entry['memory_gib']:g} GiB for {n.gpu}; memory is GiB, is it MiB "
                 f"({n.memory_gib / 1024:g} GiB)?")
        if n.peak_tflops is not None and n.peak_tflops > 3 * entry["peak_tflops"]:
            warn(f"nodes[{i}].peak_tflops = {n.peak_tflops:g} is {n.peak_tflops / entry['peak_tflops']:.0f}x the "
                 f"catalog's {entry['peak_tflops']:g} TFLOP/s for {n.gpu} (dense bf16)")


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
                gemm_eff=d.get("gemm_eff"), attn_eff=d.get("attn_eff"), host=d.get("host"),
                host_memory_gib=d.get("host_memory_gib"))


_CLUSTER_KEYS = ("nodes", "inter_node_gbps", "bandwidth_gbps", "latency_us", "devices", "calibration")


def _canonical_gpu(name: str) -> str:
    try:
        return _core.gpu_find(name)
    except UnknownGPUError:  # a fully described model outside the catalog (the core checked it)
        return name


def _latency(value, n):
    """None, one float for every pair, or a read-only n x n matrix with a zero diagonal."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = number(value, "latency_us")
        if v < 0:
            raise InvalidArgumentError(f"latency_us must be >= 0, got {value!r}")
        return v
    if isinstance(value, (str, bytes, bool, dict)):
        raise InvalidArgumentError(f"latency_us must be a number or a {n} x {n} matrix of numbers, got {value!r}")
    try:
        m = np.array(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(f"latency_us must be a number or a {n} x {n} matrix of numbers, "
                                   f"got {value!r}") from None
    if m.shape != (n, n):
        raise InvalidArgumentError(f"latency_us must be a {n} x {n} matrix (one row per device), got shape {m.shape}")
    for a in range(n):
        for b in range(n):
            if a != b and not (math.isfinite(m[a, b]) and m[a, b] >= 0):
                raise InvalidArgumentError(f"latency_us[{a}][{b}] must be a finite number >= 0, got {m[a, b]!r}")
    np.fill_diagonal(m, 0.0)
    m.setflags(write=False)
    return m


def _devices(value, n):
    """None, or a tuple of n entries, each None or a DeviceRates; all-empty descriptions become None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"devices must be a list with one entry per device, got {value!r}")
    if len(value) != n:
        raise InvalidArgumentError(f"devices must have one entry per device ({n}), got {len(value)}")
    out = []
    for i, d in enumerate(value):
        if d is not None:
            d = DeviceRates.from_dict(d, f"devices[{i}]")
            if d == DeviceRates():
                d = None
        out.append(d)
    return None if all(d is None for d in out) else tuple(out)
