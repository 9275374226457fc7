"""Measuring a plan: run its layer with the runtime and put the measured time of each phase next to the cost
model's prediction.

`measure(plan)` is a collective: every rank of the plan's process group calls it. It runs `HexiSeqAttention`
forward and backward on random inputs of the plan's shapes (layer="attention"), or a whole Llama-style layer
around it (layer="llama": RMSNorm, q/k/v and output projections, SwiGLU or GELU MLP, residuals), and times:

- per rank, the phases the cost model predicts: attention kernels (block kernels and merges), all-to-all (the
  collective calls, which include waiting for the group's slowest member), ring communication not hidden behind
  the kernels (waits on ring transfers), waiting at the per-call checks for the other ranks (sync), and the
  rest (packing and bookkeeping around the kernels, which a calibrated cluster's runtime curves predict;
  token-parallel matmuls for a whole layer);
- the step: from a common barrier to the last rank's end of backward, the median over `iters` runs.

The prediction is the plan's layout scored for one layer of one sequence without recompute (the plan's step
divided as the cost model charges it); the gradient collectives of a training step are not part of one layer.
"""

import json
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

from .. import geometry
from .._validate import document_lengths
from ..errors import InvalidArgumentError
from ..planner.model import Training
from ..planner.plan import Plan, evaluate
from .harness import (agree_arguments, collective_group, device_barrier, llama_layer, load_torch, model_dtype,
                      torch_dtype)

__all__ = ["measure", "Measurement"]

_PHASES = ("attn", "a2a", "ring", "sync", "rest")


@dataclass
class Measurement:
    """What `measure` found. Times are seconds of one layer, forward + backward, one sequence.

    step_s: measured (median over iterations of the slowest rank's time from a common start);
    predicted_step_s: the cost model's figure for the same work;
    ranks: per rank {"rank", "gpu", "tokens", "heads", "total_s", "measured": {phase: s}, "predicted": {phase: s}}
    with phases attn, a2a, ring (exposed ring communication), sync (waiting at the per-call checks for the other
    ranks to reach the call: a rank ahead of a slower one waits there; predicted 0, since the model charges that
    time to the slower rank's phases) and rest (the runtime's packing and bookkeeping
    around the kernels, predicted from the cluster's calibrated runtime curves, else 0; plus the token-parallel
    compute for a whole layer)."""

    strategy: str
    layer: str
    dtype: str
    iters: int
    step_s: float
    predicted_step_s: float
    ranks: List[dict] = field(default_factory=list)
    step_samples_s: List[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Measured over predicted step time (1.0: the model is exact; above 1: the model is optimistic)."""
        return self.step_s / self.predicted_step_s if self.predicted_step_s > 0 else math.inf

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "layer": self.layer, "dtype": self.dtype, "iters": self.iters,
                "step_s": self.step_s, "predicted_step_s": self.predicted_step_s, "ratio": self.ratio,
                "step_samples_s": self.step_samples_s, "ranks": self.ranks}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """Per rank, each phase measured / predicted (ms), and the step with its ratio."""
        def ms(x):
            return f"{x * 1e3:9.2f}"

        head = (f"{'rank':>4} {'gpu':<10} {'tokens':>7} {'heads':>5}  " +
                "  ".join(f"{p + ' meas':>9} {p + ' pred':>9}" for p in _PHASES) + f"  {'total':>9}")
        lines = [f"one {self.layer} layer, forward + backward, {self.dtype}, {self.strategy} plan; ms, median of "
                 f"{self.iters} runs (measured) next to the cost model (predicted)", head]
        for r in self.ranks:
            cells = "  ".join(f"{ms(r['measured'][p])} {ms(r['predicted'][p])}" for p in _PHASES)
            lines.append(f"{r['rank']:>4} {r['gpu'][:10]:<10} {r['tokens']:>7} {r['heads']:>5}  {cells}  "
                         f"{ms(r['total_s'])}")
        lines.append(f"step: measured {self.step_s * 1e3:.2f} ms, predicted {self.predicted_step_s * 1e3:.2f} ms, "
                     f"measured/predicted {self.ratio:.3f}")
        lines.append("a2a measured = waiting for all-to-alls, including for the group's slowest member (the runtime "
                     "pipelines them over slices of kv heads, so part travels behind attention; the model "
                     "predicts them unhidden); ring = ring communication not hidden behind the kernels; sync = "
                     "waiting at the call checks for slower ranks; rest = the runtime's work around the kernels "
                     "(predicted from calibrated runtime curves, else 0) plus the token-parallel compute of a "
                     "whole layer")
        return "\n".join(lines)


def predicted_layer(plan: Plan, layer: str = "attention", documents=None):
    """The cost model's per-device phase times for one layer, forward + backward, one sequence, no recompute
    (seconds; dicts keyed like Measurement.ranks[...]["predicted"], in device order) and the layer's step, under
    `documents` (packed document lengths, or None for one causal document)."""
    t = plan.training
    one = Training(sequences=1, checkpointing=False, sharding=t.sharding, reserved_gib=t.reserved_gib,
                   state_shares=t.state_shares, memory_features="none")  # what the timed layer runs
    p = evaluate(plan.cluster, model=plan.model, seq_len=plan.seq_len, layout=plan.layout, training=one,
                 causal=plan.causal, documents=documents)
    L = plan.model.layers
    dev = p.devices
    out, gemm, runtime = {}, {}, {}
    for i in range(len(dev)):
        d = int(dev["device"][i])
        # a llama layer's token-parallel part: its matmuls and its memory-bound work (norms, residuals, rotary, the
        # MLP's activation)
        gemm[d] = float(dev["layer_gemm_s"][i] + dev["layer_mem_bound_s"][i]) if layer == "llama" else 0.0
        runtime[d] = float(dev["runtime_s"][i]) / L  # the runtime's work around the kernels (0 uncalibrated)
        out[d] = {"attn": float(dev["attn_s"][i]) / L, "a2a": float(dev["a2a_s"][i]) / L,
                  "ring": float(dev["ring_exposed_s"][i]) / L, "sync": 0.0, "rest": gemm[d] + runtime[d]}
    group = {}
    for i in range(len(dev)):
        g = int(dev["group"][i])
        group[g] = max(group.get(g, 0.0), out[int(dev["device"][i])]["a2a"])
    # the phases as the cost model sums them: the slowest group's all-to-all, the slowest device's attention with
    # its exposed ring and runtime work, and (whole layer) the slowest device's matmuls
    step = max(group.values()) + max(v["attn"] + v["ring"] + runtime[d] for d, v in out.items())
    if layer == "llama":
        step += max(gemm.values())
    return out, step


def unlike_calibration(plan: Plan, dt) -> str:
    """Words for how this measurement differs from what the plan's cluster was calibrated with (dtype, head dim,
    attention heads), or "" (also without a calibration record)."""
    cal = plan.cluster.calibration or {}
    m = plan.model
    said = []
    dtype = str(dt).replace("torch.", "")
    if cal.get("dtype") and cal["dtype"] != dtype:
        said.append(f"in {dtype} on a cluster calibrated in {cal['dtype']}")
    if cal.get("head_dim") and cal["head_dim"] != m.head_dim:
        said.append(f"head_dim {m.head_dim} against the calibration's {cal['head_dim']}")
    if cal.get("attn_heads") and (cal["attn_heads"], cal.get("attn_kv_heads", cal["attn_heads"])) != \
            (m.heads, m.kv_heads):
        said.append(f"{m.heads}/{m.kv_heads} heads against the calibration's {cal['attn_heads']}/"
                    f"{cal.get('attn_kv_heads', cal['attn_heads'])}")
    return ", ".join(said)


def dtype_for(plan: Plan, dtype):
    """The dtype to measure in: the one given, else the one the plan's cluster was calibrated in when it has the
    model's dtype_bytes, else the model's own (calibrate's default)."""
    torch, _ = load_torch()

    cpu = torch.device("cpu")
    if dtype is None:
        if plan.model.dtype_bytes not in (2, 4, 8):
            raise InvalidArgumentError(f"the plan's model has dtype_bytes={plan.model.dtype_bytes}: pass dtype=")
        name, calibrated = (plan.cluster.calibration or {}).get("dtype"), None
        if isinstance(name, str):
            try:
                calibrated = torch_dtype(name, cpu)
            except InvalidArgumentError:  # a dtype this version does not name
                pass
        if calibrated is not None and calibrated.itemsize == plan.model.dtype_bytes:
            return calibrated
        return model_dtype(plan.model, cpu)
    dt = torch_dtype(dtype, cpu)
    if dt.itemsize != plan.model.dtype_bytes:
        raise InvalidArgumentError(
            f"dtype {str(dt).replace('torch.', '')} has {dt.itemsize} bytes per element but the plan's model has "
            f"dtype_bytes={plan.model.dtype_bytes}: plan with a model of dtype_bytes={dt.itemsize} so the "
            "prediction moves the same bytes")
    return dt


def measure(plan: Plan, group=None, *, iters: int = 5, warmup: int = 2, dtype=None, layer: str = "attention",
            seed: int = 0, documents="plan") -> Measurement:
    """Run the plan's layer forward and backward `warmup + iters` times on every rank of `group` (default: the
    world; rank r is cluster device r) and return the Measurement (equal on every rank). Every rank passes the
    same arguments; they are compared before anything runs: an invalid one on any rank raises
    InvalidArgumentError, different ones RankMismatchError naming the argument and each rank's value, on every
    rank alike.

    layer: "attention" (HexiSeqAttention alone) or "llama" (a whole Llama-style layer around it).
    dtype: the inputs' dtype; default the one the plan's cluster was calibrated in (its calibration record) when
    it has model.dtype_bytes bytes, else the one of model.dtype_bytes (2: bf16, 4: fp32, 8: fp64), as calibrate
    defaults to. It must have model.dtype_bytes bytes, so that the prediction moves the bytes the run moves.
    documents: the packed documents every call runs with and the prediction is priced under: "plan" (default:
    the ones the plan was made for, `plan.documents`, None for one causal document), None, or a list of lengths
    adding up to plan.seq_len (to run a plan on a batch it was not made for)."""
    torch, dist = load_torch()
    from ..runtime.nn import HexiSeqAttention

    error, dt = None, None
    try:  # every local check first: a rank whose arguments fail still meets the others in the agreement below
        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"plan must be a hexiseq.Plan, got {type(plan).__name__}")
        plan = plan.one_layout("measure")
        if layer not in ("attention", "llama"):
            raise InvalidArgumentError(f"layer must be 'attention' or 'llama', got {layer!r}")
        if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
            raise InvalidArgumentError(f"iters must be an int >= 1 and warmup an int >= 0, got iters={iters!r}, "
                                       f"warmup={warmup!r}")
        if not isinstance(seed, int):
            raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
        dt = dtype_for(plan, dtype)
        if isinstance(documents, str) and documents == "plan":
            documents = plan.documents
        documents = None if documents is None else document_lengths(documents, plan.seq_len).tolist()
    except Exception as e:  # noqa: BLE001  (whatever it is, the other ranks must learn of it, not hang)
        error = e
    group = collective_group(group, error, "measure plan.json")
    # every argument, before the context (whose own check would name only the plan's fingerprint) and before any
    # run (ranks running different iterations, layers or documents would meet in different collectives)
    agree_arguments(group, error, [
        ("plan", plan.fingerprint if error is None else None), ("iters", iters), ("warmup", warmup),
        ("dtype", str(dt)), ("layer", layer), ("seed", seed), ("documents", documents)])
    rank = dist.get_rank(group)
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    unlike = unlike_calibration(plan, dt)
    if unlike and rank == 0:
        warnings.warn(f"hexiseq: measuring {unlike}: the prediction uses rates measured for the other, and can be "
                      "off by that difference (calibrate with the model and dtype you measure)", UserWarning,
                      stacklevel=2)
    attn = HexiSeqAttention(plan, group=group, causal=plan.causal)  # checks the plan and the world size
    ctx = attn.context
    ctx.sync_timing = cuda
    m = plan.model
    s = geometry.tokens(plan.layout, rank, plan.cluster.num_devices)
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    if layer == "llama":
        block = llama_layer(m, lambda q, k, v: attn(q, k, v, documents=documents), device, dt, seed)
        x = torch.randn(1, s, m.hidden, generator=g, device=device, dtype=dt).requires_grad_()
        dy = torch.randn(1, s, m.hidden, generator=g, device=device, dtype=dt)

        def run():
            block(x).backward(dy)
    else:
        q = torch.randn(1, s, m.heads, m.head_dim, generator=g, device=device, dtype=dt).requires_grad_()
        k = torch.randn(1, s, m.kv_heads, m.head_dim, generator=g, device=device, dtype=dt).requires_grad_()
        v = torch.randn(1, s, m.kv_heads, m.head_dim, generator=g, device=device, dtype=dt).requires_grad_()
        do = torch.randn(1, s, m.heads, m.head_dim, generator=g, device=device, dtype=dt)

        def run():
            attn(q, k, v, documents=documents).backward(do)

    def barrier():
        device_barrier(group, device)

    samples = []
    try:
        for i in range(warmup + iters):
            barrier()
            ctx.reset_timers()
            t0 = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize(device)
            total = time.perf_counter() - t0
            if i >= warmup:
                samples.append((total, dict(ctx.phase_s)))
    finally:
        barrier()
        ctx.close()  # release the plan's HP subgroup: a measurement leaves no process group behind
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, samples, group=group)
    pred, pred_step = predicted_layer(plan, layer, documents)
    steps = [max(every[r][i][0] for r in range(len(every))) for i in range(iters)]
    ranks = []
    for r, rs in enumerate(every):
        slot = geometry.slot(plan.layout, r, plan.cluster.num_devices)
        meas = {"attn": statistics.median(x[1]["attn"] for x in rs),
                "a2a": statistics.median(x[1]["a2a"] for x in rs),
                "ring": statistics.median(x[1]["ring_wait"] for x in rs),
                "sync": statistics.median(x[1]["sync"] for x in rs)}
        total = statistics.median(x[0] for x in rs)
        meas["rest"] = max(0.0, total - meas["attn"] - meas["a2a"] - meas["ring"] - meas["sync"])
        ranks.append({"rank": r, "gpu": str(plan.devices["gpu"][slot]), "tokens": int(plan.devices.tokens[slot]),
                      "heads": int(plan.devices.head_count[slot]), "total_s": total, "measured": meas,
                      "predicted": pred[r]})
    return Measurement(strategy=plan.strategy, layer=layer, dtype=str(dt).replace("torch.", ""), iters=iters,
                       step_s=statistics.median(steps), predicted_step_s=pred_step, ranks=ranks,
                       step_samples_s=steps)
