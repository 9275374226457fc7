"""Execute a HexiSeq plan in PyTorch: attention over torch.distributed (NCCL on GPUs, Gloo on CPU).

Each rank holds its token shard (`plan.shard(x, dim, rank)`; rank r is cluster device r). A layer runs:

1. all-to-all inside the HP group (uneven split sizes): "my tokens, all heads" -> "all of the group's tokens,
   my head range" for Q and "..., the kv heads my query heads use" for K and V;
2. ring attention across groups: at step k the group's queries attend the K/V block of the group k places
   back in the ring, while the next block arrives by batched asynchronous P2P from the previous group's
   devices that hold the same kv heads (a sub-ring per head range); partial results are merged with their
   log-sum-exp;
3. the reverse all-to-all of the output.

Backward runs the same pattern in reverse: dO goes through the all-to-all, the ring moves K/V blocks again
and carries their dK/dV accumulators along (a kv head held by two devices of a group has its pieces summed
by its first holder), the accumulators arrive home after one extra hop, and dQ, dK, dV go back through the
reverse all-to-all.

The attention of one block pair runs in the C kernels (`hexiseq.ops`) for CPU tensors, and in torch's fused
flash attention op for CUDA tensors (measured faster than hexiseq's CUDA kernels; see _use_c_kernels).
"""

import atexit
import math
import os
import time
import warnings
import weakref
from typing import Optional

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover
    raise ImportError("hexiseq.nn needs PyTorch (pip install torch)") from e

from . import ops
from .errors import HexiseqError, InvalidArgumentError
from .topology import Topology

__all__ = ["HexiSeqAttention", "HexiSeqContext", "hexiseq_attn_func", "gather_sequence"]


# ---------------------------------------------------------------------------------------------- kernels

_warned_fallback = False


# The PyTorch block path materialises scores one [B, H, tile, tile] piece at a time: a block of any length then
# fits in memory (the whole block at once would take B * H * Sq * Sk floats, 8 GiB for 16K x 16K x 8 heads),
# at the price of merging the pieces' (out, lse) like ring steps. Small blocks are one piece.
_TORCH_TILE = 1024


def _tiles(n, tile):
    return [(s, min(tile, n - s)) for s in range(0, n, tile)]


def _block_forward_torch(q, k, v, causal, q_pos0, k_pos0, scale, tile=None):
    """PyTorch path for one block pair: (out [B, Sq, H, d], lse [B, H, Sq] fp32/fp64). Same contract as
    hexiseq.ops.attention_forward: K/V heads already expanded to H or in GQA ratio. torch's fused flash op where
    it applies (see _flash_causal); else tiled matmuls (tile: force those, with this tile size)."""
    is_causal = _flash_causal(q, k, causal, q_pos0, k_pos0) if tile is None else None
    if is_causal is not None:
        return _flash_forward(q, k, v, is_causal, scale)
    if q.device.type == "cuda":
        _warn_once(f"no fused attention for this block pair ({q.dtype}, head dim {q.shape[3]}); using tiled "
                   "matmuls (correct, slow)")
    tile = tile or _TORCH_TILE
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    outs, lses = [], []
    for qs, qn in _tiles(Sq, tile):
        o_acc = torch.zeros(B, qn, H, d, dtype=acc, device=q.device)
        l_acc = torch.full((B, H, qn), float("-inf"), dtype=acc, device=q.device)
        for ks, kn in _tiles(k.shape[1], tile):
            if causal and k_pos0 + ks > q_pos0 + qs + qn - 1:
                break  # this key piece and the later ones are after every query of the piece
            o_p, l_p = _tile_forward_torch(q[:, qs:qs + qn], k[:, ks:ks + kn], v[:, ks:ks + kn], causal,
                                           q_pos0 + qs, k_pos0 + ks, scale)
            _merge(o_acc, l_acc, o_p, l_p, False)
        outs.append(o_acc)
        lses.append(l_acc)
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 2)


def _block_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale, tile=None):
    """PyTorch backward of one block pair with the final (o, lse): (dq, dk, dv) in q's dtype from torch's flash op
    where it applies (see _flash_causal), else in fp32/fp64 from tiled matmuls."""
    is_causal = _flash_causal(q, k, causal, q_pos0, k_pos0) if tile is None else None
    if is_causal is not None:
        return _flash_backward(q, k, v, o, lse, do, is_causal, scale)
    tile = tile or _TORCH_TILE
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for qs, qn in _tiles(q.shape[1], tile):
        for ks, kn in _tiles(k.shape[1], tile):
            if causal and k_pos0 + ks > q_pos0 + qs + qn - 1:
                break
            dq_p, dk_p, dv_p = _tile_backward_torch(
                q[:, qs:qs + qn], k[:, ks:ks + kn], v[:, ks:ks + kn], o[:, qs:qs + qn], lse[:, :, qs:qs + qn],
                do[:, qs:qs + qn], causal, q_pos0 + qs, k_pos0 + ks, scale)
            dq[:, qs:qs + qn] += dq_p
            dk[:, ks:ks + kn] += dk_p
            dv[:, ks:ks + kn] += dv_p
    return dq, dk, dv


def _tile_forward_torch(q, k, v, causal, q_pos0, k_pos0, scale):
    """One piece of _block_forward_torch, scores materialised: (out in fp32/fp64, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    Hk = k.shape[2]
    rep = H // Hk
    qf = q.to(acc).permute(0, 2, 1, 3)                                  # [B, H, Sq, d]
    kf = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)   # [B, H, Sk, d]
    vf = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale                 # [B, H, Sq, Sk]
    if causal:
        qp = torch.arange(Sq, device=q.device) + q_pos0
        kp = torch.arange(k.shape[1], device=q.device) + k_pos0
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                    # [B, H, Sq]
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.matmul(p, vf).permute(0, 2, 1, 3)
    return o, lse


def _tile_backward_torch(q, k, v, o, lse, do, causal, q_pos0, k_pos0, scale):
    """One piece of _block_backward_torch, scores materialised, with the block's final (o, lse)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Sq, H, d = q.shape
    Hk = k.shape[2]
    rep = H // Hk
    qf = q.to(acc).permute(0, 2, 1, 3)
    kf = k.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    vf = v.to(acc).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    dof = do.to(acc).permute(0, 2, 1, 3)
    of = o.to(acc).permute(0, 2, 1, 3)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        qp = torch.arange(Sq, device=q.device) + q_pos0
        kp = torch.arange(k.shape[1], device=q.device) + k_pos0
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    l = lse.to(acc)[..., None]
    p = torch.exp(s - l.masked_fill(torch.isinf(l), 0.0))
    p = torch.nan_to_num(p, nan=0.0).masked_fill(torch.isinf(l), 0.0)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    D = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - D)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    # fold expanded kv heads back
    dk = dk.reshape(B, Hk, rep, -1, d).sum(2)
    dv = dv.reshape(B, Hk, rep, -1, d).sum(2)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


_RUNTIME_KERNELS = ("hexiseq", "torch")


def _use_c_kernels(t):
    """Which implementation runs the block pairs of one ring pass (decided once per pass): True for hexiseq.ops
    (the C kernels for CPU tensors, the CUDA kernels for bf16/fp16 CUDA tensors), False for the PyTorch path
    (_block_forward_torch: torch's fused flash attention for the full and diagonal block pairs of bf16/fp16 CUDA
    tensors, tiled matmuls otherwise).

    Default: hexiseq.ops on CPU; the PyTorch path for CUDA tensors, because on an H100 torch's flash kernels ran
    0.99-1.18x (forward) and 1.32-1.56x (backward) the speed of hexiseq's CUDA kernels on the same inputs
    (benchmarks/results/cuda_attention.md; a one-rank layer: benchmarks/results/runtime_gpu.md), and the ring
    only produces full and diagonal block pairs.
    HEXISEQ_RUNTIME_KERNELS=hexiseq or =torch forces one (the tests run both)."""
    forced = os.environ.get("HEXISEQ_RUNTIME_KERNELS", "")
    if forced and forced not in _RUNTIME_KERNELS:
        raise InvalidArgumentError(f"HEXISEQ_RUNTIME_KERNELS={forced!r}: expected one of {', '.join(_RUNTIME_KERNELS)} "
                                   "or unset")
    if t.device.type == "cpu":
        return forced != "torch"
    if forced == "hexiseq":
        if t.device.type == "cuda" and t.dtype in (torch.bfloat16, torch.float16) and ops._cuda_built():
            return True
        _warn_once(f"HEXISEQ_RUNTIME_KERNELS=hexiseq: hexiseq has no kernel for {t.dtype} on {t.device.type} "
                   f"(CUDA kernels: bf16/fp16{'' if ops._cuda_built() else ', and this build has none'}); using the "
                   "PyTorch block attention")
    return False


def _warn_once(message):
    global _warned_fallback
    if not _warned_fallback:
        warnings.warn("hexiseq: " + message, RuntimeWarning, stacklevel=3)
        _warned_fallback = True


# torch's fused flash attention op, where it computes a block pair exactly: it returns the LSE the ring merges
# with and its backward takes the ring's final (out, LSE), so one block pair is one call each way.
_flash_capable = {}


def _flash_causal(q, k, causal, q_pos0, k_pos0):
    """is_causal for torch's flash op when it computes this block pair exactly, else None. Exact cases: CUDA,
    bf16/fp16, head dim a multiple of 8 up to 256, and either every key visible to every query (not causal, or
    all keys at or before the first query) or the causal square on the diagonal (same positions, same length:
    flash's mask is then key j <= query i, ours)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    Sq, Sk, d = q.shape[1], k.shape[1], q.shape[3]
    if d % 8 or d > 256 or Sq == 0 or Sk == 0 or not torch.backends.cuda.flash_sdp_enabled():
        return None
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if dev not in _flash_capable:
        _flash_capable[dev] = (torch.cuda.get_device_capability(dev) >= (8, 0)
                               and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward"))
    if not _flash_capable[dev]:
        return None
    if not causal or k_pos0 + Sk - 1 <= q_pos0:
        return False
    if q_pos0 == k_pos0 and Sq == Sk:
        return True
    return None


def _flash_forward(q, k, v, is_causal, scale):
    """(out [B, Sq, H, d], lse [B, H, Sq] fp32) through torch's flash op ([B, H, S, d] views; GQA native)."""
    r = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           0.0, is_causal, False, scale=scale)
    return r[0].transpose(1, 2), r[1]


def _flash_backward(q, k, v, o, lse, do, is_causal, scale):
    """(dq, dk, dv) in q's dtype through torch's flash backward with the ring's final (o, lse). Without dropout
    the op reads no random state: the seed and offset tensors are placeholders."""
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, o, do))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse.to(torch.float32).contiguous(), None, None, q.shape[1], k.shape[1], 0.0, is_causal,
        seed, offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- topology

_live_contexts = weakref.WeakSet()


@atexit.register
def _close_contexts():
    for context in list(_live_contexts):
        context.close()


class HexiSeqContext:
    """Everything one rank needs to execute a plan: its group, the members' shares, the ring routes, the
    process groups. Build it once (collective: every rank of `group` must call it with its plan) and reuse
    it for every layer; `HexiSeqAttention` does that for you.

    At construction every rank compares the plan's fingerprint with the others' and raises HexiseqError on
    a mismatch (on every rank) instead of hanging later."""

    def __init__(self, plan, group=None, causal: bool = True, softmax_scale: Optional[float] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise HexiseqError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
        self.plan = plan
        self.group = group if group is not None else dist.group.WORLD
        self.causal = bool(causal)
        self.scale = softmax_scale
        # Seconds this rank spent per phase since the last reset_timers(): "attn" (block kernels and merges),
        # "a2a" (the all-to-all calls), "ring_wait" (waiting for ring transfers and shared-head reductions the
        # kernels did not hide). hexiseq.measure reads them; with sync_timing set, CUDA work is synchronised at
        # every phase boundary so the clock sees the device, not the launches (slower: for measurement only).
        self.phase_s = {"attn": 0.0, "a2a": 0.0, "ring_wait": 0.0}
        self.sync_timing = False
        _live_contexts.add(self)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._check_fingerprint()
        self.topology = Topology(plan, self.causal)  # who holds what, who sends what to whom (no processes)
        topo = self.topology
        self.heads, self.kv_heads, self.per_kv = topo.heads, topo.kv_heads, topo.per_kv
        self.n_groups, self.groups, self.S, self.chunks = topo.n_groups, topo.groups, topo.S, topo.chunks
        self.g = topo.group_of(self.rank)
        self.me = topo.member(self.rank)
        # global ranks (for P2P) of every plan device
        self._global = [self._global_rank(r) for r in range(self.world)]
        # HP subgroups: every rank of `group` creates every HP group, in ring order. On the world, plainly: every
        # rank takes part in every creation, so the group names (a counter all ranks advance together) agree. On
        # a smaller group (another data-parallel replica with its own plan, say), with local synchronisation, so
        # ranks outside `group` need not take part. torch names a locally synchronised group by its ranks and by
        # how many groups the creating process holds, which differs between the members of an earlier partial
        # subgroup and the others: on the world that made a later all-ranks subgroup hang in its rendezvous.
        self.hp_group = None
        self.hp_order = [0]
        local = self.group is not dist.group.WORLD
        for g in range(self.n_groups):
            ranks = [self._global[mb.rank] for mb in self.groups[g]]
            pg = dist.new_group(ranks=ranks, use_local_synchronization=local) if len(ranks) > 1 else None
            if g == self.g and pg is not None:
                self.hp_group = pg
                # all_to_all_single orders its splits by rank inside the subgroup, not by our member order
                pos = [dist.get_group_rank(pg, r) for r in ranks]
                self.hp_order = sorted(range(len(ranks)), key=lambda i: pos[i])

    @property
    def kernel_s(self):
        """Seconds spent inside attention kernels on this rank since the last reset (phase_s["attn"])."""
        return self.phase_s["attn"]

    @kernel_s.setter
    def kernel_s(self, value):
        self.phase_s["attn"] = float(value)

    def reset_timers(self):
        for key in self.phase_s:
            self.phase_s[key] = 0.0

    def _clock(self, device=None):
        if self.sync_timing and device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _wait(self, reqs, device):
        """Wait for posted P2P requests; the time counts as exposed ring communication."""
        t0 = self._clock(device)
        for r in reqs:
            r.wait()
        self.phase_s["ring_wait"] += self._clock(device) - t0

    def close(self):
        """Release this context's HP subgroup. Call it before torch.distributed.destroy_process_group(); an exit
        hook does it otherwise. A Gloo process group that is still referenced when the interpreter finalises is
        torn down by the garbage collector with its threads running, which can abort the process."""
        pg, self.hp_group = self.hp_group, None
        if pg is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError):
                pass  # already destroyed with the whole world

    def _global_rank(self, r):
        if self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def _device(self):
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_fingerprint(self):
        fp = int(self.plan.fingerprint, 16)
        fp = fp - (1 << 64) if fp >= (1 << 63) else fp
        mine = torch.tensor([fp, self.plan.cluster.num_devices, self.world], dtype=torch.int64, device=self._device())
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        every = [t.tolist() for t in every]
        if any(e[0] != every[0][0] for e in every):
            fps = ", ".join(f"rank {r}: {(e[0] % (1 << 64)):016x}" for r, e in enumerate(every))
            raise HexiseqError(f"ranks disagree about the plan (fingerprints {fps}); every rank must use the same plan")
        if every[0][1] != self.world:
            raise HexiseqError(f"the plan places {every[0][1]} devices but the process group has {self.world} ranks")

    # ------------------------------------------------------------------------------------------ helpers

    def _scale(self, d):
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def _kv_index(self, mb, device):
        """Local kv index of each of the member's query heads (for expanding K/V to its heads)."""
        h = torch.arange(mb.head_lo, mb.head_lo + mb.heads, device=device)
        return h // self.per_kv - mb.kv_lo

    def _aligned(self, mb):
        return mb.head_lo % self.per_kv == 0 and mb.heads % self.per_kv == 0

    def _a2a(self, send_parts, counts, unit, dtype, device):
        """Uneven all-to-all inside the HP group: send_parts[j] (flat) to member j; returns the received
        flat parts. Members are in rank order; a member's own part stays local. counts: the topology's (sent,
        received) elements per member, in `unit`s (batch x head_dim): the parts must be exactly what it says
        (what the cost model charges, tests/test_topology.py), and it sizes what arrives."""
        if [p.numel() for p in send_parts] != [unit * n for n, _ in counts]:
            raise HexiseqError("internal: the all-to-all sends differ from the plan's topology")
        recv_numels = [unit * n for _, n in counts]
        members = self.groups[self.g]
        if len(members) == 1:
            return [send_parts[0]]
        order = self.hp_order
        send_parts = [send_parts[i].reshape(-1) for i in order]
        recv_numels = [recv_numels[i] for i in order]
        send = torch.cat(send_parts)
        recv = torch.empty(sum(recv_numels), dtype=dtype, device=device)
        t0 = self._clock(device)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_numels,
                               input_split_sizes=[p.numel() for p in send_parts], group=self.hp_group)
        self.phase_s["a2a"] += self._clock(device) - t0
        got = torch.split(recv, recv_numels)
        out = [None] * len(order)
        for j, i in enumerate(order):
            out[i] = got[j]
        return out

    # ------------------------------------------------------------------------------------------ transfers

    # Message kinds, as P2P tags: K/V blocks, dK/dV accumulators, shared-kv-head reductions. Between one pair of
    # ranks a K/V block and an accumulator can have the same shape; posting order alone keeps them apart, so the
    # tags make a future reordering on one side fail to match (Gloo matches by tag) instead of swapping them.
    # NCCL ignores tags and matches in posting order, which both sides keep.
    TAG_KV, TAG_ACC, TAG_REDUCE = 1, 2, 3

    def _exchange(self, sends, recvs, send_tensor_of, recv_shape_of, dtype, device, tag):
        """Post a batch of asynchronous sends and receives; returns (requests, received tensors)."""
        ops_ = []
        keep = []
        for peer, lo, n in sends:
            t = send_tensor_of(lo, n).contiguous()
            if t.numel():
                keep.append(t)
                ops_.append(dist.P2POp(dist.isend, t, self._global[peer], tag=tag))
        out = []
        for peer, lo, n in recvs:
            t = torch.empty(recv_shape_of(lo, n), dtype=dtype, device=device)
            out.append((lo, n, t))
            if t.numel():
                ops_.append(dist.P2POp(dist.irecv, t, self._global[peer], tag=tag))
        reqs = dist.batch_isend_irecv(ops_) if ops_ else []
        return reqs, out, keep

    # ------------------------------------------------------------------------------------------ forward

    def forward(self, q, k, v):
        """q [B, s_r, A, d], k/v [B, s_r, A_kv, d] -> o [B, s_r, A, d]; plus what backward needs."""
        self._check_inputs(q, k, v)
        B, _, _, d = q.shape
        dev, dt = q.device, q.dtype
        members, me = self.groups[self.g], self.me
        # 1. all-to-all in: my tokens of member j's heads
        parts = []
        for mb in members:
            parts.append(torch.cat([q[:, :, mb.head_lo:mb.head_lo + mb.heads].reshape(-1),
                                    k[:, :, mb.kv_lo:mb.kv_lo + mb.kv_n].reshape(-1),
                                    v[:, :, mb.kv_lo:mb.kv_lo + mb.kv_n].reshape(-1)]))
        got = self._a2a(parts, self.topology.a2a_in(self.rank), B * d, dt, dev)
        qs, ks, vs = [], [], []
        for mb, flat in zip(members, got):
            nq, nk = B * mb.tokens * me.heads * d, B * mb.tokens * me.kv_n * d
            qs.append(flat[:nq].view(B, mb.tokens, me.heads, d))
            ks.append(flat[nq:nq + nk].view(B, mb.tokens, me.kv_n, d))
            vs.append(flat[nq + nk:nq + 2 * nk].view(B, mb.tokens, me.kv_n, d))
        Qg, Kg, Vg = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)   # [B, S_g, h|kv, d]
        # 2. ring
        Og, lses = self._ring_forward(Qg, Kg, Vg)
        # 3. all-to-all out: my heads of member j's tokens
        parts = [Og[:, mb.tok_lo:mb.tok_lo + mb.tokens].reshape(-1) for mb in members]
        got = self._a2a(parts, self.topology.a2a_out(self.rank), B * d, dt, dev)
        o = torch.empty(B, me.tokens, self.heads, d, dtype=dt, device=dev)
        for mb, flat in zip(members, got):
            o[:, :, mb.head_lo:mb.head_lo + mb.heads] = flat.view(B, me.tokens, mb.heads, d)
        return o, (Qg, Kg, Vg, Og, lses)

    def _check_inputs(self, q, k, v):
        for name, t, heads in (("q", q, self.heads), ("k", k, self.kv_heads), ("v", v, self.kv_heads)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InvalidArgumentError(f"{name} must be a 4-D tensor [batch, tokens, heads, head_dim]")
            if t.shape[1] != self.me.tokens or t.shape[2] != heads:
                raise InvalidArgumentError(
                    f"{name} must be [batch, {self.me.tokens}, {heads}, head_dim] on rank {self.rank} under this plan, "
                    f"got {list(t.shape)}")
        if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise InvalidArgumentError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not agree")
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            raise InvalidArgumentError("q, k and v must share dtype and device")

    def _heads_view(self, K):
        """K/V of my kv range as the kernel wants them for my query heads: GQA ratio when aligned,
        else expanded to one kv head per query head."""
        if self._aligned(self.me):
            return K
        return K.index_select(2, self._kv_index(self.me, K.device))

    def _ring_forward(self, Qg, Kg, Vg):
        me, G = self.me, self.n_groups
        B, Sg, h, d = Qg.shape
        dev, dt = Qg.device, Qg.dtype
        if h == 0:
            return Qg.new_zeros(B, Sg, 0, d), []
        scale = self._scale(d)
        acc_dt = torch.float64 if dt == torch.float64 else torch.float32
        use_c = _use_c_kernels(Qg)
        merge_c = use_c or (dev.type == "cuda" and ops._cuda_built())  # one kernel instead of eight torch ops
        chunks = self.chunks[self.g]
        O = [torch.zeros(B, n, h, d, dtype=acc_dt, device=dev) for _, n in chunks]
        L = [torch.full((B, h, n), float("-inf"), dtype=acc_dt, device=dev) for _, n in chunks]
        qoff = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
        cur = torch.stack([Kg, Vg])                       # [2, B, S_src, kv, d], the own block first
        sends, recvs = self.topology.ring_routes(self.rank, "kv")
        for step in range(G):
            src = (self.g - step) % G
            pending = None
            if step < G - 1:
                nxt_src = (self.g - step - 1) % G
                pending = self._exchange(
                    sends, recvs, lambda lo, n, c=cur: c[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
                    lambda lo, n, S=self.S[nxt_src]: (2, B, S, n, d), dt, dev, self.TAG_KV)
            Kb, Vb = self._heads_view(cur[0]), self._heads_view(cur[1])
            for qo, qp0, qn, ko, kp0, kn in self.topology.block_pairs(self.g, src):
                qc, kc, vc = Qg[:, qo:qo + qn], Kb[:, ko:ko + kn], Vb[:, ko:ko + kn]
                t0 = self._clock(dev)
                if use_c:
                    o_p, l_p = ops.attention_forward(qc, kc, vc, causal=self.causal, q_pos0=qp0, k_pos0=kp0, scale=scale)
                else:
                    o_p, l_p = _block_forward_torch(qc, kc, vc, self.causal, qp0, kp0, scale)
                i = qoff.index(qo)
                _merge(O[i], L[i], o_p.to(acc_dt), l_p.to(acc_dt), merge_c)
                self.phase_s["attn"] += self._clock(dev) - t0
            if pending is not None:
                reqs, got, _keep = pending
                self._wait(reqs, dev)
                cur = torch.empty(2, B, self.S[nxt_src], me.kv_n, d, dtype=dt, device=dev)
                for lo, n, t in got:
                    cur[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] = t
        return torch.cat(O, 1).to(dt), L

    # ------------------------------------------------------------------------------------------ backward

    def backward(self, do, Qg, Kg, Vg, Og, lses):
        B, _, _, d = do.shape
        dev, dt = do.device, do.dtype
        members, me = self.groups[self.g], self.me
        do = do.contiguous()
        # 1. dO through the all-to-all (the q pattern)
        parts = [do[:, :, mb.head_lo:mb.head_lo + mb.heads].reshape(-1) for mb in members]
        reverse_out = [(n_in, n_out) for n_out, n_in in self.topology.a2a_out(self.rank)]  # O's pattern, reversed
        got = self._a2a(parts, reverse_out, B * d, dt, dev)
        dOg = torch.cat([flat.view(B, mb.tokens, me.heads, d) for mb, flat in zip(members, got)], 1)
        # 2. ring backward
        dQg, dKg, dVg = self._ring_backward(Qg, Kg, Vg, Og, lses, dOg)
        # 3. reverse all-to-all: dQ of member j's tokens for my heads, dK/dV for the kv heads I first-hold
        parts = []
        for mb in members:
            sl = slice(mb.tok_lo, mb.tok_lo + mb.tokens)
            f = slice(me.first_lo - me.kv_lo, me.first_lo - me.kv_lo + me.first_n)
            parts.append(torch.cat([dQg[:, sl].reshape(-1), dKg[:, sl, f].reshape(-1), dVg[:, sl, f].reshape(-1)]))
        got = self._a2a(parts, self.topology.a2a_grads(self.rank), B * d, dt, dev)
        dq = torch.empty(B, me.tokens, self.heads, d, dtype=dt, device=dev)
        dk = torch.zeros(B, me.tokens, self.kv_heads, d, dtype=dt, device=dev)
        dv = torch.zeros_like(dk)
        for mb, flat in zip(members, got):
            nq, nk = B * me.tokens * mb.heads * d, B * me.tokens * mb.first_n * d
            dq[:, :, mb.head_lo:mb.head_lo + mb.heads] = flat[:nq].view(B, me.tokens, mb.heads, d)
            dk[:, :, mb.first_lo:mb.first_lo + mb.first_n] = flat[nq:nq + nk].view(B, me.tokens, mb.first_n, d)
            dv[:, :, mb.first_lo:mb.first_lo + mb.first_n] = flat[nq + nk:].view(B, me.tokens, mb.first_n, d)
        return dq, dk, dv

    def _ring_backward(self, Qg, Kg, Vg, Og, lses, dOg):
        me, G = self.me, self.n_groups
        B, Sg, h, d = Qg.shape
        dev, dt = Qg.device, Qg.dtype
        kv = me.kv_n
        if h == 0:
            return Qg.new_zeros(B, Sg, 0, d), Kg.new_zeros(B, Sg, 0, d), Vg.new_zeros(B, Sg, 0, d)
        scale = self._scale(d)
        acc_dt = torch.float64 if dt == torch.float64 else torch.float32
        use_c = _use_c_kernels(Qg)
        chunks = self.chunks[self.g]
        qoff = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
        dQ = torch.zeros(B, Sg, h, d, dtype=acc_dt, device=dev)
        aligned = self._aligned(me)
        kv_idx = None if aligned else self._kv_index(me, dev)
        co_holders = self.topology.co_holders(self.rank)
        kv_sends, kv_recvs = self.topology.ring_routes(self.rank, "kv")
        acc_sends, acc_recvs = self.topology.ring_routes(self.rank, "acc")
        cur = torch.stack([Kg, Vg])
        f = slice(me.first_lo - me.kv_lo, me.first_lo - me.kv_lo + me.first_n)

        def assemble(pending, S):
            """Wait for a posted accumulator exchange; the received dK/dV of my first-held heads [2, B, S, ., d]."""
            reqs, got, _keep = pending
            self._wait(reqs, dev)
            acc = torch.zeros(2, B, S, me.first_n, d, dtype=acc_dt, device=dev)
            for lo, n, t in got:
                acc[:, :, :, lo - me.first_lo:lo - me.first_lo + n] = t
            return acc

        # Both transfers of a step overlap the step's kernels: the next K/V block is posted before them, and the
        # accumulator a step hands on is waited for only at the end of the next step (or after the loop).
        acc_pending = None
        for step in range(G):
            src = (self.g - step) % G
            Ssrc = self.S[src]
            nxt_src = (self.g - step - 1) % G
            kv_pending = None
            if step < G - 1:
                kv_pending = self._exchange(
                    kv_sends, kv_recvs, lambda lo, n, c=cur: c[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
                    lambda lo, n, S=self.S[nxt_src]: (2, B, S, n, d), dt, dev, self.TAG_KV)
            # my contributions to dK/dV of this block, for my whole kv range
            contrib = torch.zeros(2, B, Ssrc, h if not aligned else kv, d, dtype=acc_dt, device=dev)
            Kb = cur[0] if aligned else cur[0].index_select(2, kv_idx)
            Vb = cur[1] if aligned else cur[1].index_select(2, kv_idx)
            for qo, qp0, qn, ko, kp0, kn in self.topology.block_pairs(self.g, src):
                i = qoff.index(qo)
                qc, oc, doc, lc = Qg[:, qo:qo + qn], Og[:, qo:qo + qn], dOg[:, qo:qo + qn], lses[i]
                kc, vc = Kb[:, ko:ko + kn], Vb[:, ko:ko + kn]
                t0 = self._clock(dev)
                if use_c and acc_dt == dt:
                    ops.attention_backward(qc, kc, vc, oc, lc.to(acc_dt), doc, causal=self.causal, q_pos0=qp0,
                                           k_pos0=kp0, scale=scale, dq=dQ[:, qo:qo + qn],
                                           dk=contrib[0, :, ko:ko + kn], dv=contrib[1, :, ko:ko + kn],
                                           accumulate=True)
                elif use_c:
                    dq_p, dk_p, dv_p = ops.attention_backward(qc, kc, vc, oc, lc.to(torch.float32), doc,
                                                              causal=self.causal, q_pos0=qp0, k_pos0=kp0, scale=scale)
                    dQ[:, qo:qo + qn] += dq_p.to(acc_dt)
                    contrib[0, :, ko:ko + kn] += dk_p.to(acc_dt)
                    contrib[1, :, ko:ko + kn] += dv_p.to(acc_dt)
                else:
                    dq_p, dk_p, dv_p = _block_backward_torch(qc, kc, vc, oc, lc, doc, self.causal, qp0, kp0, scale)
                    dQ[:, qo:qo + qn] += dq_p.to(acc_dt)
                    contrib[0, :, ko:ko + kn] += dk_p.to(acc_dt)
                    contrib[1, :, ko:ko + kn] += dv_p.to(acc_dt)
                self.phase_s["attn"] += self._clock(dev) - t0
            if not aligned:  # fold per-query-head pieces back onto my kv heads
                folded = torch.zeros(2, B, Ssrc, kv, d, dtype=acc_dt, device=dev)
                folded.index_add_(3, kv_idx, contrib)
                contrib = folded
            # kv heads shared with another member: non-first holders hand their piece to the first holder
            contrib = self._reduce_shared(contrib, co_holders, B, Ssrc, d, acc_dt, dev)
            # the block's accumulator (posted by the previous group during the previous step), plus my part
            if acc_pending is None:
                acc = contrib[:, :, :, f].clone()
            else:
                acc = assemble(acc_pending, Ssrc) + contrib[:, :, :, f]
            if G == 1:
                break
            # hand it on (after the last step this hop takes it home); receive the next block's accumulator
            acc_pending = self._exchange(
                acc_sends, acc_recvs, lambda lo, n, a=acc: a[:, :, :, lo - me.first_lo:lo - me.first_lo + n],
                lambda lo, n, S=self.S[nxt_src]: (2, B, S, n, d), acc_dt, dev, self.TAG_ACC)
            if kv_pending is not None:
                self._wait(kv_pending[0], dev)
                cur = torch.empty(2, B, self.S[nxt_src], kv, d, dtype=dt, device=dev)
                for lo, n, t in kv_pending[1]:
                    cur[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] = t
        if G > 1:  # the last hop brought my own group's block home
            acc = assemble(acc_pending, Sg)
        # acc now holds the full dK/dV of my own group's block for the kv heads I first-hold
        dK = torch.zeros(B, Sg, kv, d, dtype=dt, device=dev)
        dV = torch.zeros_like(dK)
        dK[:, :, f] = acc[0].to(dt)
        dV[:, :, f] = acc[1].to(dt)
        return dQ.to(dt), dK, dV

    def _reduce_shared(self, contrib, co, B, S, d, acc_dt, dev):
        send, recv = co
        if not send and not recv:
            return contrib
        me = self.me
        reqs, got, _keep = self._exchange(
            send, recv, lambda lo, n: contrib[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n],
            lambda lo, n: (2, B, S, n, d), acc_dt, dev, self.TAG_REDUCE)
        self._wait(reqs, dev)
        for lo, n, t in got:
            contrib[:, :, :, lo - me.kv_lo:lo - me.kv_lo + n] += t
        return contrib


def _merge(o_acc, lse_acc, o_part, lse_part, use_c):
    """Fold (o_part, lse_part) into the accumulator in place: hexiseq.ops.merge_ on the kernel path, else torch."""
    if use_c:
        ops.merge_(o_acc, lse_acc, o_part, lse_part)
        return
    new = torch.logaddexp(lse_acc, lse_part)
    finite = torch.isfinite(new)
    wa = torch.where(finite, torch.exp(lse_acc - new), torch.zeros_like(new))
    wp = torch.where(finite, torch.exp(lse_part - new), torch.zeros_like(new))
    o_acc.mul_(wa.transpose(1, 2)[..., None]).add_(o_part * wp.transpose(1, 2)[..., None])
    lse_acc.copy_(new)


# ---------------------------------------------------------------------------------------------- autograd

class _HexiSeqAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, context):
        o, saved = context.forward(q, k, v)
        Qg, Kg, Vg, Og, lses = saved
        ctx.context = context
        ctx.n_lse = len(lses)
        ctx.save_for_backward(Qg, Kg, Vg, Og, *lses)
        return o

    @staticmethod
    def backward(ctx, do):
        Qg, Kg, Vg, Og, *lses = ctx.saved_tensors
        dq, dk, dv = ctx.context.backward(do, Qg, Kg, Vg, Og, list(lses))
        return dq, dk, dv, None


def hexiseq_attn_func(q, k, v, context: HexiSeqContext):
    """Attention of this rank's token shard under a plan, with autograd.

    q: [batch, s_r, heads, head_dim]; k, v: [batch, s_r, kv_heads, head_dim], where s_r is this rank's token
    count in the plan (`plan.devices.tokens` of its slot; shard with `plan.shard(x, 1, rank)`).
    Returns the output [batch, s_r, heads, head_dim] for the same tokens. Every rank of the context's group
    must call it (it communicates)."""
    return _HexiSeqAttentionFn.apply(q, k, v, context)


class HexiSeqAttention(torch.nn.Module):
    """Drop-in attention for a model whose sequence is sharded by a HexiSeq plan.

    plan: a hexiseq.Plan whose devices are the ranks of `group` (rank r = cluster device r).
    group: the process group (default: the world). causal: causal masking by absolute positions.
    softmax_scale: default 1/sqrt(head_dim).
    Construction is collective: every rank checks the plan's fingerprint against the others'."""

    def __init__(self, plan, group=None, causal: bool = True, softmax_scale: Optional[float] = None):
        super().__init__()
        self.context = HexiSeqContext(plan, group=group, causal=causal, softmax_scale=softmax_scale)

    def forward(self, q, k, v):
        return hexiseq_attn_func(q, k, v, self.context)


def gather_sequence(x, plan, dim: int = 1, group=None):
    """All-gather every rank's shard of `x` along `dim` and return the full sequence in position order."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    sizes = [int(plan.devices.tokens[plan._slot(r)]) for r in range(world)]
    biggest = max(sizes)
    pad = list(x.shape)
    pad[dim] = biggest - x.shape[dim]
    xp = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
    bufs = [torch.empty_like(xp) for _ in range(world)]
    dist.all_gather(bufs, xp.contiguous(), group=group)
    shards = [b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)]
    return plan.unshard(shards, dim)
