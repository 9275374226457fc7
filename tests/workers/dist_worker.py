"""Worker processes for the multi-process tests (imported by spawned children, so it lives in a module)."""

import datetime
import os
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from reference import attention


# The ranks start from a fork server that has imported torch, hexiseq and the workers once for the whole test run:
# a rank forked from it starts in milliseconds, where a spawned one spends about 3 s of CPU importing torch, which
# on 2 cores was most of the multi-process tests' time. Each rank is still a fresh process, forked from a server
# that has run no torch op and made no process group. HEXISEQ_TEST_START_METHOD=spawn starts them from scratch.
# What ranks import later is preloaded too when many of them would each import it on their own: torch._dynamo
# (which a torch optimizer's constructor imports: about 2 s of CPU per rank that makes one), transformers' model
# classes (modeling_utils: about 2 s per rank that builds a Hugging Face model) and its Trainer, once in the server
# (about 5 s of CPU) instead of in every rank. A module that cannot be imported here is skipped.
START_METHOD = os.environ.get("HEXISEQ_TEST_START_METHOD", "forkserver")
if START_METHOD not in ("forkserver", "spawn"):
    raise ValueError(f"HEXISEQ_TEST_START_METHOD must be forkserver or spawn, got {START_METHOD!r}")
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.nn.functional", "hexiseq", "hexiseq.nn",
           "reference", "dist_worker", "transformers", "torch._dynamo", "transformers.models.llama.modeling_llama",
           "hexiseq.trainer"]


def _context():
    import torch.multiprocessing as mp

    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first spawn of the run
    return ctx


def _rank(fn, *args):
    """A rank's start: torch's intra-op threads cut to the rank's share of the cores (the ranks of a test share
    them: 4 ranks of 2 threads each on 2 cores spend much of their time waiting on each other's threads), then fn."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args[1]))
    return fn(*args)


def spawn(fn, world, args, tmp_path, timeout_s=120):
    """Run fn(rank, world, init, *args, results) in `world` new processes that rendezvous through a file store;
    return {rank: what it put on the queue, less the rank}. Never hangs: after `timeout_s` the stragglers are
    terminated and the caller's assertion names the ranks that did not report."""
    ctx = _context()
    results = ctx.SimpleQueue()
    init = f"file://{tmp_path}/store-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_rank, args=(fn, r, world, init, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < world and time.monotonic() < deadline:
        if not results.empty():
            r = results.get()
            out[r[0]] = r[1:]
        elif all(not p.is_alive() for r, p in enumerate(procs) if r not in out) and results.empty():
            break  # the ranks that have not reported are dead (an abort): no need to wait out the deadline
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
    dead = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode is not None}
    assert len(out) == world, (f"only ranks {sorted(out)} reported within {timeout_s} s (exit codes of the others: "
                               f"{dead}): {out}")
    return out


def scenarios(report):
    """run(name, fn) for a rank's sequence of contract scenarios: report[name] = (outcome, detail, seconds), the
    outcome "ok" with fn()'s result ("" when it returns None) as the detail, or the exception's class name and
    message. Every rank runs the same names in the same order, so a scenario that leaves the ranks out of step shows
    in the ones after it."""
    def run(name, fn):
        t0 = time.monotonic()
        try:
            value = fn()
            report[name] = ("ok", "" if value is None else value, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001  (the tests assert on the class)
            report[name] = (type(e).__name__, str(e), time.monotonic() - t0)
    return run


def _rel(a, b):
    """Largest error relative to the largest reference value, floored at 1: a rank whose only query sits at
    position 0 has an exactly zero dq (a softmax over one key), where a plain relative error is undefined;
    the inputs are O(1), so 1 is the natural scale there."""
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def check_plan(rank, world, init, plan_json, dtype_name, head_dim, batch, results, kernels="", slices="",
               expected=None):
    """Run HexiSeq attention forward and backward on this rank's shard; report the relative errors of the
    output and of dq, dk, dv against the float64 single-process reference (same seed on every rank; `expected`:
    reference(plan_json, head_dim, batch), computed once by the test, instead of on this rank).
    kernels="torch" runs the PyTorch block kernels (the path CUDA tensors take) instead of the C ones."""
    try:
        import os

        os.environ["HEXISEQ_RUNTIME_KERNELS"] = kernels
        os.environ["HEXISEQ_A2A_SLICES"] = slices
        import hexiseq
        from hexiseq.nn import HexiSeqAttention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        dtype = getattr(torch, dtype_name)
        attn = HexiSeqAttention(plan, causal=plan.causal)
        errs, dtype_ok = _errors(plan, rank, attn, dtype, head_dim, batch, expected=expected)
        results.put((rank, "ok", errs, dtype_ok))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def _inputs(plan, head_dim, batch, seed):
    """q, k, v and the output's gradient over the whole sequence, float64, the same on every rank for a seed."""
    m = plan.model
    g = torch.Generator().manual_seed(seed)
    S = plan.seq_len
    q = torch.randn(batch, S, m.heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, S, m.kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, S, m.kv_heads, head_dim, generator=g, dtype=torch.float64)
    go = torch.randn(batch, S, m.heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, go


def _reference(plan, q, k, v, go, head_dim, q_doc=None):
    """The float64 single-process forward and backward over the whole sequence: (out, dq, dk, dv)."""
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = attention(qr, kr, vr, causal=plan.causal, scale=head_dim ** -0.5, q_doc=q_doc)
    ref.backward(go)
    return ref.detach(), qr.grad, kr.grad, vr.grad


def reference(plan_json, head_dim, batch, seed=1234):
    """What check_plan's ranks compare with, as NumPy arrays: computed once in the test, it spares every rank the
    same float64 attention over the whole sequence (the scheduler's 1,031-token plan: about 3 s of a core, on each
    of its 6 ranks)."""
    import hexiseq

    plan = hexiseq.Plan.from_json(plan_json)
    return tuple(t.numpy() for t in _reference(plan, *_inputs(plan, head_dim, batch, seed), head_dim))


def _errors(plan, rank, attn, dtype, head_dim, batch, documents=None, seed=1234, expected=None):
    """HexiSeq attention forward and backward on this rank's shard against the float64 single-process reference
    (same seed on every rank; `expected`: reference()'s, given), with the document mask of `documents` (one list,
    or one per batch row) on both sides: ([relative errors of out, dq, dk, dv], whether the results are in
    `dtype`)."""
    from hexiseq.ops import document_starts

    q, k, v, go = _inputs(plan, head_dim, batch, seed)
    q_doc = None
    if documents is not None:
        per_row = isinstance(documents[0], (list, tuple))
        q_doc = torch.as_tensor(np.stack([document_starts(r) for r in documents]) if per_row
                                else document_starts(documents))
    if expected is None:
        ref, dq, dk, dv = _reference(plan, q, k, v, go, head_dim, q_doc)
    else:
        assert documents is None, "a reference given is one without documents"
        ref, dq, dk, dv = (torch.from_numpy(x) for x in expected)
        assert ref.shape == q.shape, (ref.shape, q.shape)
    ql, kl, vl = (plan.shard(t, 1, rank).to(dtype).requires_grad_() for t in (q, k, v))
    o = attn(ql, kl, vl) if documents is None else attn(ql, kl, vl, documents=documents)
    o.backward(plan.shard(go, 1, rank).to(dtype))
    errs = [_rel(o, plan.shard(ref, 1, rank)), _rel(ql.grad, plan.shard(dq, 1, rank)),
            _rel(kl.grad, plan.shard(dk, 1, rank)), _rel(vl.grad, plan.shard(dv, 1, rank))]
    return errs, o.dtype == dtype and ql.grad.dtype == dtype


def check_documents(rank, world, init, runs, results):
    """Packed documents: for each (plan, cases) of `runs` in turn (plans of `world` devices), in one process group,
    every case (name, documents, batch, kernels, slices) with a context built under its HEXISEQ_RUNTIME_KERNELS and
    a2a_slices, float64 against the reference with the same document mask.
    Reports (rank, "ok", [{name: [errors of out, dq, dk, dv]} per run], None)."""
    try:
        import os

        import hexiseq
        from hexiseq.nn import HexiSeqAttention

        torch.set_num_threads(1)  # several processes share the machine's cores
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        report = []
        for plan_json, cases in runs:
            plan = hexiseq.Plan.from_json(plan_json)
            report.append({})
            for name, documents, batch, kernels, slices in cases:
                os.environ["HEXISEQ_RUNTIME_KERNELS"] = kernels
                attn = HexiSeqAttention(plan, a2a_slices=slices)
                report[-1][name] = _errors(plan, rank, attn, torch.float64, 8, batch, documents,
                                           seed=len(report[-1]))[0]
                attn.context.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def check_variants(rank, world, init, plan_json, cases, results):
    """Attention variants on one plan: for each case (name, window, softcap, sinks, documents, kernels), a layer
    through hexiseq_attn_func with that window, soft-capping and sink logits (a leaf [heads] tensor, its gradient
    summed over the ranks as a sequence-parallel model's parameters are), float64 against the one-process
    reference with the same variant. Reports (rank, "ok", {name: [errors of out, dq, dk, dv, dsinks]}, None)."""
    try:
        import os

        import hexiseq
        from hexiseq.nn import HexiSeqContext, hexiseq_attn_func
        from hexiseq.ops import document_starts

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        m, S, d = plan.model, plan.seq_len, 8
        report = {}
        for name, window, softcap, with_sinks, documents, kernels in cases:
            os.environ["HEXISEQ_RUNTIME_KERNELS"] = kernels
            context = HexiSeqContext(plan, causal=plan.causal)
            g = torch.Generator().manual_seed(len(report))
            q, k, v, go = (torch.randn(2, S, n, d, generator=g, dtype=torch.float64) * (2.0 if i < 2 else 1.0)
                           for i, n in enumerate((m.heads, m.kv_heads, m.kv_heads, m.heads)))
            sinks = torch.randn(m.heads, generator=g, dtype=torch.float64) if with_sinks else None
            q_doc = None if documents is None else torch.as_tensor(document_starts(documents))
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            sr = None if sinks is None else sinks.clone().requires_grad_()
            ref, _ = attention(qr, kr, vr, causal=plan.causal, scale=d ** -0.5, q_doc=q_doc, window=window,
                               softcap=softcap, sinks=sr)
            ref.backward(go)
            ql, kl, vl = (plan.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
            sl = None if sinks is None else sinks.clone().requires_grad_()
            o = hexiseq_attn_func(ql, kl, vl, context, documents, window=window, softcap=softcap, sinks=sl)
            o.backward(plan.shard(go, 1, rank))
            errs = [_rel(o, plan.shard(ref.detach(), 1, rank)), _rel(ql.grad, plan.shard(qr.grad, 1, rank)),
                    _rel(kl.grad, plan.shard(kr.grad, 1, rank)), _rel(vl.grad, plan.shard(vr.grad, 1, rank))]
            if sinks is not None:
                total = sl.grad.clone()
                dist.all_reduce(total)
                errs.append(_rel(total, sr.grad))
            report[name] = errs
            context.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def check_plan_in_replicas(rank, world, init, plan_json, results, mesh=False):
    """Two data-parallel replicas of two ranks each ({0, 1} and {2, 3}), each running the same 2-device plan
    inside its own process group, with different data per replica; errors against the reference. mesh: the groups
    are the "cp" dimension of a (dp 2, cp 2) torch DeviceMesh, handed over as the mesh itself; the whole 2-D mesh is
    first refused (the message reported after the errors)."""
    try:
        import hexiseq
        from hexiseq.nn import HexiSeqAttention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        refused = None
        if mesh:
            from torch.distributed.device_mesh import init_device_mesh

            whole = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            try:
                HexiSeqAttention(hexiseq.Plan.from_json(plan_json), group=whole)
            except hexiseq.InvalidArgumentError as e:
                refused = str(e)
            mine = whole["cp"]
            local = mine.get_local_rank()
        else:
            replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            mine = replicas[rank // 2]
            local = dist.get_rank(mine)
        plan = hexiseq.Plan.from_json(plan_json)
        m = plan.model
        g = torch.Generator().manual_seed(100 + rank // 2)  # each replica its own data
        S, d = plan.seq_len, 8
        q = torch.randn(1, S, m.heads, d, generator=g, dtype=torch.float64)
        k = torch.randn(1, S, m.kv_heads, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, S, m.kv_heads, d, generator=g, dtype=torch.float64)
        go = torch.randn(1, S, m.heads, d, generator=g, dtype=torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = attention(qr, kr, vr, causal=plan.causal, scale=d ** -0.5)
        ref.backward(go)
        attn = HexiSeqAttention(plan, group=mine)
        ql, kl, vl = (plan.shard(t, 1, local).requires_grad_() for t in (q, k, v))
        o = attn(ql, kl, vl)
        o.backward(plan.shard(go, 1, local))
        errs = [_rel(o, plan.shard(ref.detach(), 1, local)), _rel(ql.grad, plan.shard(qr.grad, 1, local)),
                _rel(kl.grad, plan.shard(kr.grad, 1, local)), _rel(vl.grad, plan.shard(vr.grad, 1, local))]
        results.put((rank, "ok", errs, refused))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def check_nonfinite(rank, world, init, plan_json, kernels, results):
    """A NaN in one entry of q, then of k, of the full sequence (query position 40, head 1; key position 20, kv
    head 0; component 3) through this rank's shard, forward and backward, against the float64 single-process
    reference: reports per poison [(name, NaN entries here, reference's, whether they agree)] for out, dq, dk, dv.
    out must be NaN exactly where the reference is; a gradient may be NaN only where the reference is, and must be
    NaN in every row the reference makes NaN in every component (the rest is 0 x NaN, which depends on the
    tiling: see tests/test_attention_ops.py)."""
    try:
        import os

        os.environ["HEXISEQ_RUNTIME_KERNELS"] = kernels
        import hexiseq
        from hexiseq.nn import HexiSeqAttention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        plan = hexiseq.Plan.from_json(plan_json)
        m, S, D = plan.model, plan.seq_len, 8
        attn = HexiSeqAttention(plan, causal=plan.causal)
        report = {}
        for poison in ("q", "k"):
            g = torch.Generator().manual_seed(99)
            q = torch.randn(1, S, m.heads, D, generator=g, dtype=torch.float64)
            k, v = (torch.randn(1, S, m.kv_heads, D, generator=g, dtype=torch.float64) for _ in range(2))
            go = torch.randn(1, S, m.heads, D, generator=g, dtype=torch.float64)
            (q if poison == "q" else k)[0, 40 if poison == "q" else 20, 1 if poison == "q" else 0, 3] = float("nan")
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref, _ = attention(qr, kr, vr, causal=plan.causal, scale=D ** -0.5)
            ref.backward(go)
            ql, kl, vl = (plan.shard(t, 1, rank).requires_grad_() for t in (q, k, v))
            o = attn(ql, kl, vl)
            o.backward(plan.shard(go, 1, rank))
            rows = []
            for name, got, want in (("out", o, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                                    ("dv", vl.grad, vr.grad)):
                want = plan.shard(want.detach(), 1, rank)
                bad, ref_bad = torch.isnan(got.detach()), torch.isnan(want)
                if name == "out":
                    ok = torch.equal(bad, ref_bad)
                else:
                    must = ref_bad.all(-1, keepdim=True).expand_as(ref_bad)
                    ok = bool(bad[must].all()) and not bool((bad & ~ref_bad).any())
                fin = ~ref_bad & ~bad
                err = (got.detach() - want).abs()[fin].max().item() if fin.any() else 0.0
                rows.append((name, int(bad.sum()), int(ref_bad.sum()), ok and err <= 1e-10))
            report[poison] = rows
        attn.context.close()
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def check_plan_against(rank, world, init, plan_json, dtype_name, head_dim, batch, expected, results):
    """check_plan against the reference the test computed (reference(plan_json, head_dim, batch))."""
    check_plan(rank, world, init, plan_json, dtype_name, head_dim, batch, results, expected=expected)


def check_plan_torch(rank, world, init, plan_json, dtype_name, head_dim, batch, results):
    """check_plan with the PyTorch block kernels instead of the C ones."""
    check_plan(rank, world, init, plan_json, dtype_name, head_dim, batch, results, kernels="torch")


def check_plan_sliced(rank, world, init, plan_json, dtype_name, head_dim, batch, slices, results):
    """check_plan with the layer pipelined in `slices` slices of kv heads."""
    check_plan(rank, world, init, plan_json, dtype_name, head_dim, batch, results, slices=str(slices))


def check_mismatch(rank, world, init, plan_jsons, results):
    """Build the attention module with a per-rank plan; report what each rank raised."""
    try:
        import hexiseq
        from hexiseq.nn import HexiSeqAttention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        plan = hexiseq.Plan.from_json(plan_jsons[rank])
        try:
            HexiSeqAttention(plan)
            results.put((rank, "no error", None, None))
        except hexiseq.HexiseqError as e:
            results.put((rank, "raised", str(e), None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))


def contract_scenarios(rank, world, init, plan_json, results):
    """Run scenarios in which ranks disagree or one rank's input is bad, one after another in the same process
    group; report, per scenario, what this rank raised (class name and message) or "ok". That the later
    scenarios run at all shows that a failure leaves the ranks in step."""
    try:
        import hexiseq
        from hexiseq.runtime.comm import group_timeout
        from hexiseq.nn import HexiSeqAttention

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        plan = hexiseq.Plan.from_json(plan_json)
        m = plan.model
        tokens = int(plan.devices.tokens[plan._slot(rank)])

        def inputs(batch=1, d=8, dtype=torch.float64, grad=True, tokens=tokens):
            g = torch.Generator().manual_seed(rank)
            q = torch.randn(batch, tokens, m.heads, d, generator=g, dtype=dtype)
            k = torch.randn(batch, tokens, m.kv_heads, d, generator=g, dtype=dtype)
            v = torch.randn(batch, tokens, m.kv_heads, d, generator=g, dtype=dtype)
            return [t.requires_grad_(grad) for t in (q, k, v)]

        def step(attn, documents=None, **kw):
            q, k, v = inputs(**kw)
            o = attn(q, k, v) if documents is None else attn(q, k, v, documents=documents)
            if o.requires_grad:
                o.sum().backward()

        report = {}

        scenario = scenarios(report)

        attn = HexiSeqAttention(plan)
        scenario("good", lambda: step(attn))
        scenario("batch", lambda: step(attn, batch=2 if rank == 1 else 1))
        scenario("head_dim", lambda: step(attn, d=4 if rank == 2 else 8))
        scenario("dtype", lambda: step(attn, dtype=torch.float32 if rank == 0 else torch.float64))
        scenario("bad_input", lambda: step(attn, tokens=tokens + 1 if rank == world - 1 else tokens))
        scenario("requires_grad", lambda: step(attn, grad=rank != 1))

        def skipped_backward():
            q, k, v = inputs()
            o = attn(q, k, v)
            if rank == 0:  # rank 0 forgets the backward and goes on to the next forward
                attn(*inputs())
            else:
                o.sum().backward()

        scenario("phase", skipped_backward)
        # packed documents of the plan's 45 tokens: agreed on by digest, validated on every rank
        scenario("documents_good", lambda: step(attn, documents=[10, 1, 34]))
        scenario("documents", lambda: step(attn, documents=[11, 34] if rank == 1 else [10, 35]))
        scenario("documents_none", lambda: step(attn, documents=None if rank == 2 else [45]))
        scenario("documents_sum", lambda: step(attn, documents=[10, 30] if rank == 2 else [10, 35]))
        scenario("documents_type", lambda: step(attn, documents=[10.5, 35]))
        scenario("documents_zero", lambda: step(attn, documents=[0, 45] if rank == 0 else [45]))
        scenario("documents_rows", lambda: step(attn, documents=[[10, 35], [45]]))

        def noncausal():
            other = HexiSeqAttention(plan, causal=False)
            try:
                step(other, documents=[45])
            finally:
                other.context.close()

        scenario("documents_noncausal", noncausal)
        scenario("good_after", lambda: step(attn))
        report["hp_timeout"] = (str(group_timeout(attn.context.comm.hp_group))
                                if attn.context.comm.hp_group is not None else None, "", 0.0)
        attn.context.close()
        scenario("causal", lambda: HexiSeqAttention(plan, causal=rank != 1).context.close())
        scenario("softmax_scale", lambda: HexiSeqAttention(plan, softmax_scale=0.5 if rank == 2 else None)
                 .context.close())
        results.put((rank, "ok", report, None))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), None))
