"""Plans: a layout of the general form (HP groups, sequence and head shares, ring order) with its predicted
cost; the strategies that produce them; scoring a layout the caller writes down."""

import dataclasses
import enum
import functools
import hashlib
import json
import os
import time
from typing import Dict, List, Optional, Union

import numpy as np

from .. import _core, geometry
from ..schedule import PassLayout, Schedule
from .._validate import boolean, document_lengths, integer, integers, load_json, number, parse_tokens
from .cluster import Cluster
from ..errors import InternalError, InvalidArgumentError, LayoutError, MemoryFitError, UnsupportedError
from .model import Model, Sharding, Training, memory_features_names
from . import floor, text

__all__ = ["Strategy", "Layout", "Plan", "DeviceTable", "plan_layout", "evaluate", "compare"]


PLAN_FORMAT_VERSION = 1  # of the JSON to_json writes; from_json reads this version only


class Strategy(str, enum.Enum):
    """How the sequence and the heads are split."""

    AUTO = "auto"        # the best of every strategy below (the scheduler's plan unless a baseline ties)
    HEXISEQ = "hexiseq"  # the asymmetric hierarchical scheduler
    RING = "ring"        # pure context parallelism
    ULYSSES = "ulysses"  # pure head parallelism (needs heads divisible by the device count)
    USP = "usp"          # uniform CP x HP mesh, every valid factorisation


_CORE_STRATEGY = {s: _core.STRATEGIES[s.value] for s in Strategy if s is not Strategy.AUTO}  # the core's values
BASELINES = (Strategy.RING, Strategy.ULYSSES, Strategy.USP)
ALL_STRATEGIES = (Strategy.HEXISEQ,) + BASELINES
_CHUNKING_NAME = {value: name for name, value in _core.CHUNKINGS.items()}


def _documents(documents, seq_len, causal):
    """Checked document lengths (or None): they add up to seq_len and need causal attention."""
    documents = document_lengths(documents, seq_len)
    if documents is not None and not causal:
        raise InvalidArgumentError("documents need causal attention (the document mask is causal), got causal=False")
    return documents


def strategy_of(value) -> Strategy:
    try:
        return Strategy(value.value if isinstance(value, Strategy) else str(value).lower())
    except ValueError:
        raise InvalidArgumentError(f"strategy must be one of {[s.value for s in Strategy]}, got {value!r}") from None


def _layout_bounds(name):
    """(lo, hi) no entry of layout array `name` can leave, from the core's limits; the core checks the rest (shares
    that add up, heads that tile, devices of the cluster)."""
    devices = _core.int_range("devices")[1]
    tokens = _core.int_range("seq_len")[1]
    heads = _core.int_range("model.heads")[1]
    return {"group_size": (1, devices), "group_seq": (1, tokens), "device": (0, devices - 1), "tokens": (0, tokens),
            "head_lo": (0, heads), "head_count": (0, heads)}[name]


class Layout:
    """What a plan describes, as flat arrays (see csrc/common/hexiseq.h, hexiseq_layout).

    Groups are in ring order; per-device arrays list the members of group 0, then group 1, ...; inside a
    group the order is the rank order, and head ranges tile [0, heads) in it.

    group_size[g], group_seq[g]: members and token positions of group g.
    device[r], tokens[r], head_lo[r], head_count[r]: the device at slot r, its token-parallel share, and
    its query-head range [head_lo, head_lo + head_count).
    chunking: where a group's positions lie. "zigzag" (a front chunk and its mirrored back chunk, which
    balances one causal document) or "contiguous" (one range per group in ring order, which the planner may
    choose for packed documents)."""

    _ARRAYS = (("group_size", np.int32), ("group_seq", np.int64), ("device", np.int32), ("tokens", np.int64),
               ("head_lo", np.int32), ("head_count", np.int32))
    CHUNKINGS = tuple(sorted(_core.CHUNKINGS, key=_core.CHUNKINGS.get))  # names in the core's value order

    def __init__(self, group_size, group_seq, device, tokens, head_lo, head_count, chunking="zigzag"):
        if isinstance(chunking, (int, np.integer)) and not isinstance(chunking, bool):
            chunking = _CHUNKING_NAME.get(int(chunking), chunking)  # the core's value, as the core hands it back
        if chunking not in self.CHUNKINGS:
            raise LayoutError(f"layout.chunking must be one of {list(self.CHUNKINGS)}, got {chunking!r}")
        self.chunking = chunking
        values = dict(group_size=group_size, group_seq=group_seq, device=device, tokens=tokens, head_lo=head_lo,
                      head_count=head_count)
        for name, dtype in self._ARRAYS:
            try:  # every entry an integer in the core's outer bounds: no float truncated, no value wrapped
                ints = integers(values[name], f"layout.{name}", *_layout_bounds(name))
            except InvalidArgumentError as e:
                raise LayoutError(str(e)) from None
            arr = np.array(ints, dtype=dtype)
            arr.setflags(write=False)
            setattr(self, name, arr)
        if len(self.group_seq) != len(self.group_size):
            raise LayoutError(f"layout has {len(self.group_size)} groups but {len(self.group_seq)} group_seq entries")
        n = len(self.device)
        for name in ("tokens", "head_lo", "head_count"):
            if len(getattr(self, name)) != n:
                raise LayoutError(f"layout.{name} has {len(getattr(self, name))} entries for {n} devices")
        if self.group_size.sum() != n:
            raise LayoutError(f"group sizes add up to {int(self.group_size.sum())} devices, the layout lists {n}")

    @classmethod
    def _of_core(cls, chunking, **arrays) -> "Layout":
        """The layout of arrays the core made, and checked: read-only copies, without the entry-by-entry checks of
        user input (at 1,024 devices they were most of a per-step plan's time)."""
        out = cls.__new__(cls)
        out.chunking = _CHUNKING_NAME[int(chunking)] if not isinstance(chunking, str) else chunking
        for name, dtype in cls._ARRAYS:
            arr = np.array(arrays[name], dtype=dtype)
            arr.setflags(write=False)
            setattr(out, name, arr)
        return out

    @classmethod
    def from_groups(cls, groups: List[dict], chunking="zigzag") -> "Layout":
        """From a list of groups in ring order, each {"devices": [...], "seq": S_g, "tokens": [...],
        "heads": [counts...]} or with "head_ranges": [[lo, hi), ...] instead of "heads"."""
        if not isinstance(groups, (list, tuple)) or not groups:
            raise LayoutError(f"layout groups must be a non-empty list, got {groups!r}")
        gs, gq, dev, tok, lo, cnt = [], [], [], [], [], []
        for g, grp in enumerate(groups):
            where = f"groups[{g}]"
            if not isinstance(grp, dict):
                raise LayoutError(f"{where} must be a mapping with devices, seq, tokens, heads")
            for key in ("devices", "seq", "tokens"):
                if key not in grp:
                    raise LayoutError(f"{where}.{key} is required")
            try:
                devices = integers(grp["devices"], f"{where}.devices", *_layout_bounds("device"))
                tokens = integers(grp["tokens"], f"{where}.tokens", *_layout_bounds("tokens"))
                if len(tokens) != len(devices):
                    raise LayoutError(f"{where}.tokens has {len(tokens)} entries for {len(devices)} devices")
                if "head_ranges" in grp:
                    ranges = grp["head_ranges"]
                    if isinstance(ranges, (str, bytes, dict)) or not isinstance(ranges, (list, tuple)):
                        raise LayoutError(f"{where}.head_ranges must be one [lo, hi) pair per device, got {ranges!r}")
                    ranges = [integers(r, f"{where}.head_ranges[{i}]", *_layout_bounds("head_lo"))
                              for i, r in enumerate(ranges)]
                    if len(ranges) != len(devices) or any(len(r) != 2 for r in ranges):
                        raise LayoutError(f"{where}.head_ranges must be one [lo, hi) pair per device")
                    lows = [r[0] for r in ranges]
                    counts = [r[1] - r[0] for r in ranges]
                elif "heads" in grp:
                    counts = integers(grp["heads"], f"{where}.heads", *_layout_bounds("head_count"))
                    if len(counts) != len(devices):
                        raise LayoutError(f"{where}.heads has {len(counts)} entries for {len(devices)} devices")
                    lows = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])] if counts else []
                else:
                    raise LayoutError(f"{where} needs heads (counts) or head_ranges")
                seq = integer(grp["seq"], f"{where}.seq", *_layout_bounds("group_seq"))
            except LayoutError:
                raise
            except InvalidArgumentError as e:
                raise LayoutError(str(e)) from None
            gs.append(len(devices))
            gq.append(seq)
            dev += devices
            tok += tokens
            lo += lows
            cnt += counts
        return cls(gs, gq, dev, tok, lo, cnt, chunking)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        if isinstance(d, dict) and "groups" in d:
            return cls.from_groups(d["groups"], d.get("chunking", "zigzag"))
        if isinstance(d, dict) and all(name in d for name, _ in cls._ARRAYS):
            return cls(*(d[name] for name, _ in cls._ARRAYS), d.get("chunking", "zigzag"))
        raise LayoutError("a layout is {'groups': [...]} or a dict of the arrays "
                          + ", ".join(name for name, _ in cls._ARRAYS))

    def groups(self) -> List[dict]:
        """The layout as a list of groups in ring order (the from_groups format, with head_ranges)."""
        out, r = [], 0
        for g, size in enumerate(self.group_size.tolist()):
            sl = slice(r, r + size)
            out.append({
                "devices": self.device[sl].tolist(),
                "seq": int(self.group_seq[g]),
                "tokens": self.tokens[sl].tolist(),
                "head_ranges": [[int(a), int(a + c)] for a, c in zip(self.head_lo[sl], self.head_count[sl])],
            })
            r += size
        return out

    def to_dict(self) -> dict:
        # zigzag is left out, so plans written before chunking existed keep their fingerprints
        return {"groups": self.groups(), **({"chunking": self.chunking} if self.chunking != "zigzag" else {})}

    def _as_core(self) -> dict:
        return {**{name: getattr(self, name) for name, _ in self._ARRAYS},
                "chunking": _core.CHUNKINGS[self.chunking]}

    def __eq__(self, other):
        return isinstance(other, Layout) and self.chunking == other.chunking and all(
            np.array_equal(getattr(self, n), getattr(other, n)) for n, _ in self._ARRAYS)

    def __repr__(self):
        chunks = "" if self.chunking == "zigzag" else f", chunking={self.chunking!r}"
        return f"Layout(groups={self.group_size.tolist()}, group_seq={self.group_seq.tolist()}{chunks})"


class DeviceTable:
    """Per-device columns of a plan, NumPy arrays in layout order (groups in ring order, ranks inside).

    Columns: device, node, gpu, group, rank, tokens, head_lo, head_count, kv_lo, kv_count, first_lo,
    first_count (the kv heads the device first-holds: it sends them around the ring for its group), gemm_s,
    layer_gemm_s, mem_bound_s (the memory-bound work beside the matmuls: norms, residual adds, rotary, the MLP's
    activation, the loss, the optimizer step; priced at the device's memory bandwidth), layer_mem_bound_s, attn_s, a2a_s, ring_exposed_s, runtime_s (the runtime's work around the kernels, priced from a
    calibrated runtime_*_ns curves, else 0), busy_s, mem_states_gib, mem_act_gib, mem_attn_gib,
    mem_ring_gib, mem_total_gib, mem_cap_gib, state_share (the fraction of the sharded model states the device
    holds), ring_send_bytes, ring_recv_bytes, a2a_send_bytes, a2a_recv_bytes, a2a_grad_send_bytes,
    a2a_grad_recv_bytes, features (the memory features the device uses, names joined by '+', "" for none: see
    Training.memory_features), offload_s (copies of offloaded checkpoints the compute does not hide), tiling_s (what
    the tiled MLP and loss add), mem_host_gib (host memory of its offloaded checkpoints), host_cap_gib (host memory
    it may use). offload_s and tiling_s are part of the token-parallel phase and of busy_s.
    Index by name (`table["tokens"]`) or attribute (`table.tokens`). layer_gemm_s is the token-parallel compute
    of one layer, forward + backward, one sequence (no recompute, no output head): what a measured single
    layer's matmuls compare with; layer_mem_bound_s the same layer's memory-bound work. The byte columns are the traffic the times charge: ring K/V bytes per token of a
    block sent to the next group and received from the previous one, and one layer's all-to-all bytes for one
    sequence, forward (Q, K, V in and O out) and backward (dO in, dQ and the first-held kv heads' dK, dV out);
    hexiseq.runtime.topology counts the same from what the runtime sends."""

    def __init__(self, columns: Dict[str, np.ndarray]):
        self._columns = columns

    @property
    def columns(self) -> List[str]:
        return list(self._columns)

    def __getitem__(self, name):
        return self._columns[name]

    def __getattr__(self, name):
        try:
            return self.__dict__["_columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __len__(self):
        return len(self._columns["device"])

    def __iter__(self):
        return iter(self._columns)

    def rows(self) -> List[dict]:
        return [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in self._columns.items()}
                for i in range(len(self))]


class Plan:
    """A layout of a cluster for a model and sequence length, with its predicted cost.

    Build one with `hexiseq.plan(...)` (a strategy picks the layout) or `hexiseq.evaluate(...)` (you
    write the layout). Times are for one training step: every layer, forward and backward.

    stopped_early: True when the planner's time limit (`plan(..., time_limit_s=...)`) ended the search:
    the layout is the best found by then, valid but perhaps not the one a full search would return.
    documents: the lengths of the documents packed in each sequence the plan was balanced and priced for (a
    read-only int64 array), or None for one causal document per sequence. The runtime takes the documents of
    each batch per call; a plan made for other documents still runs them exactly, only less balanced."""

    def __init__(self, cluster: Cluster, model: Model, training: Training, seq_len: int, causal: bool,
                 strategy: str, layout: Layout, stopped_early: bool = False, documents=None):
        documents = _documents(documents, seq_len, causal)
        self.documents = documents
        self.cluster = cluster
        self.model = model
        self.training = training
        self.seq_len = seq_len
        self.causal = causal
        self.strategy = strategy
        self.layout = layout
        self.stopped_early = bool(stopped_early)
        per, cost = _core.evaluate(*cluster._core_args(), model._as_core(), training._as_core(), seq_len,
                                   causal, layout._as_core(), documents)
        if training.state_shares == "auto":  # even shares when they fit, else by memory when that fits
            training = self.training = dataclasses.replace(training, state_shares="even")
            if not cost["fits"]:
                by_memory = dataclasses.replace(training, state_shares="memory")
                per_m, cost_m = _core.evaluate(*cluster._core_args(), model._as_core(), by_memory._as_core(),
                                               seq_len, causal, layout._as_core(), documents)
                if cost_m["fits"]:
                    self.training, per, cost = by_memory, per_m, cost_m
        self._cost = cost
        group = np.repeat(np.arange(len(layout.group_size), dtype=np.int32), layout.group_size)
        rank = np.concatenate([np.arange(s, dtype=np.int32) for s in layout.group_size.tolist()])
        columns = {
            "device": layout.device,
            "node": cluster.device_nodes[layout.device],
            "gpu": cluster.device_gpus[layout.device],
            "group": group,
            "rank": rank,
            "tokens": layout.tokens,
            "head_lo": layout.head_lo,
            "head_count": layout.head_count,
            "kv_lo": per.pop("kv_lo"),
            "kv_count": per.pop("kv_count"),
            "first_lo": per.pop("first_lo"),
            "first_count": per.pop("first_count"),
        }
        features = per.pop("features")
        columns.update(per)
        columns["features"] = np.array(["+".join(memory_features_names(int(f))) for f in features])
        for v in columns.values():
            v.setflags(write=False)
        self.devices = DeviceTable(columns)

    # ------------------------------------------------------------------ figures

    # Figures and step-level fields are non-data descriptors (cached properties): a plan of several groups
    # (hexiseq.planner.BatchPlan, a Plan too) holds its own as plain fields.

    @functools.cached_property
    def step_time_s(self) -> float:
        """Predicted time of one training step (all layers, forward and backward), seconds."""
        return self._cost["step_time_s"]

    @property
    def tokens_per_s(self) -> float:
        return self._cost["tokens_per_s"]

    @functools.cached_property
    def lower_bound_s(self) -> float:
        """Total work over the total effective rate of the cluster: no layout can be faster."""
        return self._cost["lower_bound_s"]

    @property
    def gap_to_bound(self) -> float:
        """step_time_s / lower_bound_s (1.0 is ideal)."""
        return self.step_time_s / self.lower_bound_s

    @property
    def compute_floor_s(self) -> float:
        """The step's model FLOPs at the devices' catalog matmul and attention rates, nothing else paid
        (hexiseq.planner.floor): no plan of any parallelism is below it; step_time_s / compute_floor_s is how far
        this one is from the hardware."""
        docs = None if self.documents is None else [self.documents.tolist()] * self.training.sequences
        return floor.compute_floor_s(self.cluster, self.model, self.seq_len, self.training.sequences, self.causal,
                                     docs)

    @property
    def phases(self) -> dict:
        """The step time's terms: gemm_phase_s + a2a_phase_s + ring_phase_s + grad_exposed_s, each phase's
        slowest device, and grad_sync_s, the whole time of the gradient (and parameter) collectives of which
        grad_exposed_s is what compute does not hide."""
        keys = ("gemm_phase_s", "a2a_phase_s", "ring_phase_s", "grad_exposed_s", "grad_sync_s", "gemm_bottleneck",
                "a2a_bottleneck", "ring_bottleneck")
        return {k: self._cost[k] for k in keys}

    @property
    def fits(self) -> bool:
        return self._cost["fits"]

    def memory_features(self, device: int) -> dict:
        """What device `device` (its rank) runs to fit its memory, as the cost model chose it: {"offload": bool
        (activation checkpoints to host memory), "mlp_tiles": int, "loss_tiles": int} (1: untiled; else tiles of
        about hexiseq's tile size, ceil(tokens / TILE_TOKENS)). hexiseq.hf.patch_model applies it."""
        t = self.devices
        ok = not isinstance(device, bool) and isinstance(device, (int, np.integer))
        rows = np.flatnonzero(t.device == int(device)) if ok else []
        if len(rows) != 1:
            raise InvalidArgumentError(f"device must be one of the plan's devices 0..{len(t) - 1}, got {device!r}")
        i = int(rows[0])
        names = t.features[i].split("+") if t.features[i] else []
        tiles = max(1, -(-int(t.tokens[i]) // _core.TILE_TOKENS))
        return {"offload": "offload" in names, "mlp_tiles": tiles if "tile_mlp" in names else 1,
                "loss_tiles": tiles if "tile_loss" in names else 1}

    @property
    def state_shares(self) -> np.ndarray:
        """The fraction of the sharded model states each device holds, indexed by device id (= rank): 1/N each
        under even shares; under shares by memory (training.state_shares "memory") what
        `hexiseq.shard_states(module, plan)` gives each rank."""
        out = np.empty(self.cluster.num_devices)
        out[self.devices.device] = self.devices.state_share
        out.setflags(write=False)
        return out

    @property
    def num_groups(self) -> int:
        """The layout's HP groups (the ring's members), not the step's groups of devices (`groups`)."""
        return len(self.layout.group_size)

    # ------------------------------------------------------------------ the step: groups x passes

    @functools.cached_property
    def groups(self) -> tuple:
        """The step's groups of devices (cluster device ids): one group of every device, whose pass runs this
        plan's layout. A plan of several groups lists each group's devices (hexiseq.planner.BatchPlan)."""
        return (tuple(range(self.cluster.num_devices)),)

    @functools.cached_property
    def passes(self) -> tuple:
        """The sequences of each group's passes: one pass of the one sequence (index 0)."""
        return (((0,),),)

    @functools.cached_property
    def lengths(self) -> tuple:
        """Each sequence's tokens: (seq_len,)."""
        return (self.seq_len,)

    @functools.cached_property
    def assignment(self) -> tuple:
        """The group of each sequence: (0,)."""
        return (0,)

    @functools.cached_property
    def group_time_s(self) -> tuple:
        """Each group's predicted time: (step_time_s,)."""
        return (self.step_time_s,)

    @functools.cached_property
    def sync_s(self) -> float:
        """The gradient synchronisation across groups: 0.0 with one group (the sync inside the group is
        phases["grad_sync_s"], part of step_time_s)."""
        return 0.0

    def sequences_of(self, g) -> List[int]:
        """The sequences group g runs, in batch order."""
        self.plan_for(g)
        return [0]

    def passes_of(self, g) -> List[List[int]]:
        """The sequences group g runs in each of its passes."""
        self.plan_for(g)
        return [[0]]

    def plan_for(self, g, p=0) -> "Plan":
        """The plan of one layout group g runs its pass p with: this plan itself (g = 0, p = 0)."""
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g != 0:
            raise InvalidArgumentError(f"g must be a group of the plan, in [0, 1), got {g!r}")
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)) or p != 0:
            raise InvalidArgumentError(f"group 0 makes 1 pass(es), got pass {p!r}")
        return self

    def one_layout(self, where: str = "this call") -> "Plan":
        """The plan of the step's one layout, for the doors that run one (hexiseq.nn.HexiSeqAttention,
        hexiseq.hf.patch_model, HexiSeqTrainer, measure): this plan itself; a plan of several groups or passes
        raises InvalidArgumentError naming `where` and the door that runs it."""
        return self

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything the plan's execution depends on; ranks compare it before running. Hashed once."""
        canon = json.dumps(self._identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @functools.cached_property
    def pass_layout(self) -> PassLayout:
        """The plan as the runtime runs it (hexiseq.schedule.PassLayout): its layout, the kv heads each device reads
        and first-holds, the head counts, the sequence length and the fingerprint, as plain data."""
        t = self.devices
        return PassLayout(self.cluster.num_devices, self.seq_len, self.model.heads, self.model.kv_heads, self.layout,
                          t.kv_lo, t.kv_count, t.first_lo, t.first_count, self.fingerprint, self.cluster.calibration)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The plan as a step of the one schedule type (hexiseq.schedule.Schedule): one group of every device, one
        pass of one sequence (its documents those the plan was balanced for)."""
        n = self.cluster.num_devices
        documents = None if self.documents is None else tuple(int(x) for x in self.documents)
        job = repr((self.cluster.to_dict(), self.model.to_dict()))
        return Schedule(n, self.causal, (tuple(range(n)),), (((0,),),), (self.seq_len,), (documents,),
                        ((self.pass_layout,),), job, self.fingerprint)

    def group_positions(self, group: int) -> np.ndarray:
        """Absolute token positions owned by a group, in the order its members' shares are laid out:
        the front chunk then, under zigzag chunking, the mirrored back chunk."""
        return np.concatenate([np.arange(p0, p0 + n) for p0, n in self.group_chunks(group)] or [np.arange(0)])

    def group_chunks(self, group: int):
        """The group's positions as contiguous chunks: [(first position, length), ...] in layout order, as the
        core lays them out (hexiseq.geometry.chunks)."""
        group = self._group(group)
        every = self.__dict__.get("_chunks")
        if every is None:
            every = self.__dict__["_chunks"] = geometry.chunks(self.layout)
        return list(every[group])

    def _group(self, group) -> int:
        """A group index in [0, num_groups): no negative indexing from the end."""
        g = len(self.layout.group_seq)
        if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)) or not 0 <= group < g:
            raise InvalidArgumentError(f"group must be in [0, {g}), got {group!r}")
        return int(group)

    def rebalanced(self, documents=None, seq_len=None, heads: bool = False) -> "Plan":
        """This plan's structure (groups, members, head ranges, ring order) with the sequence split (S_g, token
        shares, chunking) optimised again for another batch: `documents` (lengths in sequence order, or None for
        one causal document) and, if given, another `seq_len`. It costs a few cost-model evaluations instead of a
        search (milliseconds at 128 devices), so it can run every step; the all-to-all groups and the ring stay
        the same. The result is never predicted slower than this plan's own split under the new batch.
        heads=True also hands each group's heads out again over its members by their attention rates (for a plan
        whose cluster's rates have changed: hexiseq.rebalance); the all-to-all groups and the ring still stay.

        Raises InvalidArgumentError for a seq_len out of bounds (fewer tokens than the plan has groups, or past
        2^30), and MemoryFitError, as plan() does, when the re-balanced plan does not fit in memory."""
        seq_len = self.seq_len if seq_len is None else parse_tokens(seq_len)
        if seq_len < self.num_groups:  # every group of the structure holds at least one token
            raise InvalidArgumentError(f"seq_len must be >= {self.num_groups} to rebalance this plan (one token for "
                                       f"each of its {self.num_groups} groups), got {seq_len}")
        documents = _documents(documents, seq_len, self.causal)
        arrays = _core.rebalance(*self.cluster._core_args(), self.model._as_core(), self.training._as_core(),
                                 seq_len, self.causal, self.layout._as_core(), documents, bool(heads))
        out = Plan(self.cluster, self.model, self.training, seq_len, self.causal, self.strategy, Layout._of_core(**arrays),
                   documents=documents)
        if not out.fits:
            short = int(out._cost["short_device"])
            cap = float(out.devices.mem_cap_gib[out._slot(short)])
            reason = MemoryFitError(f"{self.strategy} rebalanced to seq_len {seq_len}: the layout does not fit in "
                                    f"memory; device {short} ({self.cluster.device_gpus[short]}, {cap:.1f} GiB) is "
                                    f"short by {out._cost['short_gib']:.2f} GiB")
            # what would fit, as plan() says it: planned by this plan's strategy (every one for a custom layout)
            strategies = [s for s in ALL_STRATEGIES if s.value == self.strategy] or list(ALL_STRATEGIES)
            raise no_fit_error(self.cluster, self.model, self.training, seq_len, self.causal,
                               {self.strategy: reason}, strategies)
        return out

    def _slot(self, rank: int) -> int:
        """Layout slot of a rank (rank = cluster device id)."""
        return geometry.slot(self.layout, rank, self.cluster.num_devices)

    def group_of(self, rank: int) -> int:
        """The HP group (index in ring order) of a rank."""
        return int(self.devices.group[self._slot(rank)])

    def device_row(self, rank: int) -> dict:
        """A rank's row of `devices` (rank r is cluster device r) as a dict of plain values, every column of
        DeviceTable: its tokens, its query heads (head_lo, head_count), its group and its place in it ("rank": the
        member index inside the group, not r), its predicted times and memory. `plan.device_row(r)["tokens"]` is
        the length of its shard (`len(plan.positions(r))`); 0 for a rank the plan parks."""
        slot = self._slot(rank)
        return {name: (col[slot].item() if hasattr(col[slot], "item") else col[slot])
                for name, col in ((name, self.devices[name]) for name in self.devices.columns)}

    def positions(self, rank: int) -> np.ndarray:
        """Absolute positions of the tokens a rank holds for token-parallel work (e.g. for rotary
        embeddings), in the order of its shard. Rank r is cluster device r. A rank the plan parks (no tokens)
        gets an empty array."""
        return geometry.positions(self.layout, rank, self.cluster.num_devices)

    def shard(self, x, dim: int, rank: int):
        """The rank's shard of a full-sequence tensor or array `x` along `dim` (its tokens, in order).

        A rank the plan parks (no tokens) gets an empty shard (0 along `dim`), and so it does from every sharding
        call (hexiseq.hf.shard_inputs, a batch pass's shard and inputs); it still runs its layers on it, since they
        take part in the collectives: hexiseq.nn's attention takes an empty shard, and a model patched by
        hexiseq.hf.patch_model runs it as one placeholder token and returns outputs of 0 tokens."""
        return geometry.take(x, self.positions(rank), dim, self.seq_len)

    def unshard(self, shards, dim: int):
        """Reassemble the full sequence from every rank's shard (a list indexed by rank)."""
        return geometry.unshard(self.layout, shards, dim, self.cluster.num_devices)

    # ------------------------------------------------------------------ text (planner/text.py)

    def explain(self) -> str:
        """A readable breakdown of the predicted step time, term by term."""
        one = None  # with packed documents, the same layout priced as one causal document, for comparison
        if self.documents is not None:
            one = Plan(self.cluster, self.model, self.training, self.seq_len, self.causal, self.strategy, self.layout)
        return text.explain(self, one_document=one)

    def table(self, max_rows: int = 64) -> str:
        """The per-device table as aligned text."""
        return text.table(self, max_rows)

    def __repr__(self):
        return (f"Plan(strategy={self.strategy!r}, groups={self.layout.group_size.tolist()}, "
                f"step_time_s={self.step_time_s:.4g}, tokens_per_s={self.tokens_per_s:.4g})")

    # ------------------------------------------------------------------ serialisation

    def _identity(self) -> dict:
        return {
            "cluster": self.cluster.to_dict(),
            "model": self.model.to_dict(),
            "training": self.training.to_dict(),
            "seq_len": self.seq_len,
            "causal": self.causal,
            "layout": self.layout.to_dict(),
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        """JSON of everything needed to rebuild the plan, plus its predictions (for reading, not trusted
        on load: `from_json` recomputes them)."""
        doc = {"format": "hexiseq-plan", "format_version": PLAN_FORMAT_VERSION, "hexiseq_version": _core.VERSION,
               "strategy": self.strategy, **self._identity(), "fingerprint": self.fingerprint,
               # what the plan was balanced for; not part of the fingerprint: execution takes documents per call
               **({"documents": self.documents.tolist()} if self.documents is not None else {}),
               # how the search ended, not what runs: outside the fingerprint; written only when true, so the files
               # of complete searches are what they were (and files without it read as a complete search)
               **({"stopped_early": True} if self.stopped_early else {}),
               "predicted": {k: self._cost[k] for k in ("step_time_s", "tokens_per_s", "lower_bound_s",
                                                         "gemm_phase_s", "a2a_phase_s", "ring_phase_s",
                                                         "grad_sync_s", "grad_exposed_s")}}
        try:
            return json.dumps(doc, indent=indent, allow_nan=False)  # strict JSON: no bare NaN or Infinity
        except ValueError as e:  # a prediction the cost model should never give
            raise InternalError(f"plan has a non-finite figure, cannot be written as JSON: {e}") from None

    @classmethod
    def reads(cls, doc: dict) -> bool:
        """Whether a to_json document (format checked) is a plan of this subclass's shape, which from_doc reads."""
        return False

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        doc = load_json(text, "plan")
        if not isinstance(doc, dict) or doc.get("format") != "hexiseq-plan":
            raise InvalidArgumentError("not a plan: missing format 'hexiseq-plan'")
        version = doc.get("format_version")
        if version != PLAN_FORMAT_VERSION or isinstance(version, bool):
            raise InvalidArgumentError(f"plan format_version is {version!r}; this hexiseq ({_core.VERSION}) reads "
                                       f"format_version {PLAN_FORMAT_VERSION}")
        for kind in cls.__subclasses__():  # a plan of another shape (several groups: hexiseq.planner.BatchPlan)
            if kind.reads(doc):
                return kind.from_doc(doc)
        missing = [k for k in ("cluster", "model", "training", "seq_len", "causal", "strategy", "layout") if k not in doc]
        if missing:
            raise InvalidArgumentError(f"not a plan: missing field(s) {missing}")
        if not isinstance(doc["causal"], bool):
            raise InvalidArgumentError(f"plan causal must be true or false, got {doc['causal']!r}")
        if not isinstance(doc["strategy"], str):
            raise InvalidArgumentError(f"plan strategy must be a string, got {doc['strategy']!r}")
        stopped_early = doc.get("stopped_early", False)
        if not isinstance(stopped_early, bool):
            raise InvalidArgumentError(f"plan stopped_early must be true or false, got {stopped_early!r}")
        training = doc["training"]
        p = cls(Cluster.from_dict(doc["cluster"]), Model.from_dict(doc["model"]), Training.from_dict(training),
                parse_tokens(doc["seq_len"], "seq_len"), doc["causal"], doc["strategy"], Layout.from_dict(doc["layout"]),
                stopped_early=stopped_early, documents=doc.get("documents"))
        if "fingerprint" in doc and doc["fingerprint"] != p.fingerprint:
            raise InvalidArgumentError(f"plan fingerprint mismatch: file says {doc['fingerprint']}, "
                                       f"contents hash to {p.fingerprint}")
        return p


def resolve_inputs(cluster, model, training, seq_len):
    if isinstance(cluster, dict):
        cluster = Cluster.from_dict(cluster)
    elif isinstance(cluster, (str, os.PathLike)):
        cluster = Cluster.from_file(cluster)
    if not isinstance(cluster, Cluster):
        raise InvalidArgumentError(f"cluster must be a Cluster, a dict or a file path, got {cluster!r}")
    if isinstance(model, (str, os.PathLike)):
        model = Model.from_name_or_path(model)
    elif isinstance(model, dict):
        model = Model.from_dict(model)
    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a Model, a preset name, a dict or the path of a Hugging Face "
                                   f"config.json, got {model!r}")
    if training is None:
        training = Training()
    elif isinstance(training, dict):
        training = Training.setting(training)
    if not isinstance(training, Training):
        raise InvalidArgumentError(f"training must be a Training or a dict, got {training!r}")
    seq_len = parse_tokens(seq_len)
    return cluster, model, training, seq_len


def evaluate(cluster, *, model="gpt-7b", seq_len=131072, layout, training=None, causal=True,
             strategy="custom", documents=None) -> Plan:
    """Score a layout the caller writes down (a Layout, or a dict as in Layout.from_dict) and return its Plan.
    documents: as in plan(), the lengths of the documents packed in each sequence, to price the layout under.

    An invalid layout (shares that don't add up, overlapping or missing heads, a device twice or missing)
    raises LayoutError naming the field."""
    cluster, model, training, seq_len = resolve_inputs(cluster, model, training, seq_len)
    if not isinstance(strategy, str):
        raise InvalidArgumentError(f"strategy must be a name (a string), got {strategy!r}")
    if not isinstance(layout, Layout):
        layout = Layout.from_dict(layout)
    return Plan(cluster, model, training, seq_len, boolean(causal, "causal"), strategy, layout, documents=documents)


def plan_one(cluster, model, training, seq_len, causal, strategy: Strategy, time_limit_s=None,
              documents=None) -> Plan:
    if training.state_shares == "auto":
        # Even shares run under FSDP or ZeRO as they are; shares by memory need hexiseq.shard_states and pad
        # their collectives to the largest share, so they are the fallback when even shares do not fit.
        try:
            return plan_one(cluster, model, dataclasses.replace(training, state_shares="even"), seq_len, causal,
                             strategy, time_limit_s, documents)
        except MemoryFitError:
            return plan_one(cluster, model, dataclasses.replace(training, state_shares="memory"), seq_len, causal,
                             strategy, time_limit_s, documents)
    arrays, info = _core.plan_strategy(*cluster._core_args(), model._as_core(), training._as_core(), seq_len, causal,
                                       _CORE_STRATEGY[strategy], time_limit_s or 0.0, documents)
    plan = Plan(cluster, model, training, seq_len, causal, strategy.value, Layout._of_core(**arrays),
                stopped_early=info["stopped_early"], documents=documents)
    plan._search = info  # what the search did: evaluations, elapsed_s (for benchmarks)
    return plan


def compare(cluster, *, model="gpt-7b", seq_len=131072, training=None, causal=True,
            documents=None, time_limit_s=None) -> Dict[str, Union[Plan, Exception]]:
    """Every strategy's best plan, or the error that says why it has none, keyed by strategy name
    (the scheduler first, then the baselines). documents: as in plan(). time_limit_s: None (every search to the
    end) or seconds shared by the strategies, as plan()'s "auto" shares them."""
    cluster, model, training, seq_len = resolve_inputs(cluster, model, training, seq_len)
    causal = boolean(causal, "causal")
    documents = _documents(documents, seq_len, causal)
    out = {}
    time_limit_s = number(time_limit_s, "time_limit_s", positive=True, optional=True)
    if time_limit_s is not None:
        return _compare_within(cluster, model, training, seq_len, causal, time_limit_s, documents)
    for s in ALL_STRATEGIES:
        try:
            out[s.value] = plan_one(cluster, model, training, seq_len, causal, s, documents=documents)
        except (UnsupportedError, MemoryFitError) as e:
            out[s.value] = e
    return out


def _compare_within(cluster, model, training, seq_len, causal, time_limit_s,
                    documents=None) -> Dict[str, Union[Plan, Exception]]:
    """compare() on checked inputs, every strategy within what is left of `time_limit_s` seconds (past the
    deadline each still completes a first plan that fits)."""
    deadline, results = time.monotonic() + time_limit_s, {}
    for s in ALL_STRATEGIES:
        left = max(deadline - time.monotonic(), 1e-6)
        try:
            results[s.value] = plan_one(cluster, model, training, seq_len, causal, s, left, documents)
        except (UnsupportedError, MemoryFitError) as e:
            results[s.value] = e
    return results


def memory_tokens_bound(cluster, model, training):
    """The longest sequence any layout over `cluster` could hold in memory under `training` (None: no limit): a
    necessary condition, not a sufficient one (csrc's hexiseq_memory_tokens_bound). A length past it fits no plan,
    so a search for the longest that fits needs no planning there. Under state shares "auto", the larger of its
    two settings' bounds (planning tries both)."""
    settings = (("even", "memory") if training.state_shares == "auto" else (training.state_shares,))
    bounds = [_core.memory_tokens_bound(*cluster._core_args(), model._as_core(),
                                        dataclasses.replace(training, state_shares=x)._as_core()) for x in settings]
    return None if None in bounds else max(bounds)


def _tokens_text(n: int) -> str:
    return f"{n // 1048576}m" if n % 1048576 == 0 else f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _memory_advice(cluster, model, training, seq_len, causal, strategies, error) -> MemoryFitError:
    """`error` (a MemoryFitError, or the text of several) with what would fit: the model states per device, and
    the longest sequence that fits with these training settings and with checkpointing, searched by planning
    (multiples of 1024 tokens, about 2 x log2(seq_len / 1024) planner calls, none for lengths past the memory bound,
    which no layout holds)."""
    n = cluster.num_devices
    # the states under auto: those of its fallback, shares by memory, which fit wherever even shares do
    states_training = (dataclasses.replace(training, state_shares="memory") if training.state_shares == "auto"
                       else training)
    ring = Layout.from_groups([{"devices": [d], "seq": 1, "tokens": [1], "heads": [model.heads]} for d in range(n)])
    probe = Plan(cluster, model, states_training, n, causal, "probe", ring)  # one token each: the states, in effect
    states = [round(float(x), 2) for x in probe.devices["mem_states_gib"]]
    caps = probe.devices["mem_cap_gib"]
    states_fit = bool(np.all(np.asarray(states) + training.reserved_gib <= caps))

    def fits(length, tr):
        if bound[tr] is not None and length > bound[tr]:
            return False  # no layout holds it: no planning (the bisection's points stay those it always had)
        for s in strategies:
            try:
                plan_one(cluster, model, tr, length, causal, s, FIT_PROBE_S)
                return True
            except (UnsupportedError, MemoryFitError):
                pass
        return False

    def longest(tr):
        if not states_fit:
            return 0
        if tr is not training and fits(seq_len, tr):  # checkpointing may fit the length asked for
            return seq_len
        # in units of 1024 tokens: lo fits (0 trivially), hi does not (seq_len does not, nor anything longer)
        lo, hi = 0, -(-seq_len // 1024)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid * 1024, tr) else (lo, mid)
        return lo * 1024

    with_checkpointing = dataclasses.replace(training, checkpointing=True)
    bound = {tr: memory_tokens_bound(cluster, model, tr) for tr in (training, with_checkpointing)}
    best = longest(training)
    with_ckpt = best if training.checkpointing else longest(with_checkpointing)
    if not states_fit:
        short = int(np.argmax(np.asarray(states) + training.reserved_gib - caps))
        where = f"device {short} ({probe.devices['gpu'][short]}, {caps[short]:.1f} GiB)"
        if states_training.state_shares == "memory":
            took = (f"{states[short]:.1f} GiB on {where} under {training.sharding.value} sharding shared by memory "
                    f"(+{training.reserved_gib:g} GiB reserved), more than it holds")
        else:
            took = (f"{states[short]:.1f} GiB per device under {training.sharding.value} sharding "
                    f"(+{training.reserved_gib:g} GiB reserved), more than {where} holds")
        advice = (f"the model states alone take {took}: no sequence fits; "
                  + ("use more devices, or devices with more memory" if training.sharding is Sharding.FULL
                     else "shard more (full sharding), use more devices, or devices with more memory"))
    else:
        if training.checkpointing or not with_ckpt:
            ckpt = ""
        elif with_ckpt == seq_len:
            ckpt = f" (with activation checkpointing, {_tokens_text(seq_len)} fits: --checkpointing)"
        else:
            ckpt = f" ({_tokens_text(with_ckpt)} with activation checkpointing)"
        features = {"auto": " with the memory features where a device needs them (offloaded checkpoints, tiled MLP "
                            "and loss)", "none": ""}.get(training.memory_features,
                                                        f" with {training.memory_features} where a device needs them")
        fits_text = (f"the longest sequence that fits is {_tokens_text(best)} tokens{features}" if best
                     else "no sequence of 1024 tokens or more fits")
        advice = f"{fits_text}{ckpt}; model states take " + (
            f"{min(states):.1f}-{max(states):.1f} GiB per device (shared by memory)"
            if states_training.state_shares == "memory"
            else f"{max(states):.1f} GiB per device")
    return MemoryFitError(f"{error}; {advice}", states_gib=states, states_fit=states_fit, longest_seq_len=best,
                          longest_seq_len_checkpointing=with_ckpt)


# A time limit that stops a search at its first plan that fits memory, for asking whether a length fits: the
# scheduler's clock (csrc/scheduler/budget.c) stops a search only once it holds a plan that fits, so whether one
# is found is the full search's answer; only the search for the fastest is cut.
FIT_PROBE_S = 1e-6


def plan_layout(cluster, *, model="gpt-7b", seq_len=131072, strategy="auto", training=None, causal=True,
                time_limit_s=None, documents=None) -> Plan:
    """The best plan of one layout over every device for `strategy` (hexiseq.plan with batch=False); the arguments
    and errors are hexiseq.plan's."""
    strategy = strategy_of(strategy)
    time_limit_s = number(time_limit_s, "time_limit_s", positive=True, optional=True)
    cluster, model, training, seq_len = resolve_inputs(cluster, model, training, seq_len)
    causal = boolean(causal, "causal")
    documents = _documents(documents, seq_len, causal)
    if strategy is not Strategy.AUTO:
        try:
            return plan_one(cluster, model, training, seq_len, causal, strategy, time_limit_s, documents)
        except MemoryFitError as e:
            raise no_fit_error(cluster, model, training, seq_len, causal, {strategy.value: e}) from None
    if time_limit_s is None:
        results = compare(cluster, model=model, seq_len=seq_len, training=training, causal=causal,
                          documents=documents)
    else:
        results = _compare_within(cluster, model, training, seq_len, causal, time_limit_s, documents)
    plans = [p for p in results.values() if isinstance(p, Plan)]
    if plans:
        best = min(plans, key=lambda p: p.step_time_s)  # ties keep the earlier: the scheduler's plan
        best.stopped_early = any(p.stopped_early for p in plans)  # the comparison itself was cut short
        return best
    raise no_fit_error(cluster, model, training, seq_len, causal, results)


def no_fit_error(cluster, model, training, seq_len, causal, results, strategies=None) -> Exception:
    """The error for strategies without a plan (results: strategy name -> its error, as from compare()):
    MemoryFitError with what would fit when memory is what failed, else UnsupportedError; every strategy's reason
    is in the message. strategies: those that work out what would fit (by default the ones named in results)."""
    reasons = "; ".join(str(e) for e in results.values())  # each names its strategy
    if not any(isinstance(e, MemoryFitError) for e in results.values()):
        return UnsupportedError(f"no strategy has a valid layout: {reasons}")
    if strategies is None:
        strategies = [Strategy(name) for name in results]
    return _memory_advice(cluster, model, training, seq_len, bool(causal), strategies,
                          f"no plan fits: {reasons}" if len(results) == 1 else f"no strategy has a plan that fits: {reasons}")
