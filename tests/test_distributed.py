"""Plans executed across processes on Gloo, checked against single-process attention over the full sequence.

Tolerances (relative to the largest reference value, floored at 1 — see dist_worker._rel): 1e-10 in float64 — the distributed result sums the
same products in a different order (blocks, merges), an error of a few ulps times the number of merge steps;
1e-5 in float32 — single-precision accumulation over sequences of ~100 keys (~1e-6 observed)."""

import functools
import time

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402

import dist_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def spawn(fn, world, args, tmp_path, timeout_s=120):
    return dist_worker.spawn(fn, world, args, tmp_path, timeout_s)


from dist_plans import CASES, cluster, layout_plan, tiny_model  # noqa: E402  (shared with test_topology)


# bfloat16: inputs, outputs and gradients are rounded to 8 significant bits (relative 2^-8 = 3.9e-3 each,
# ~7e-3 observed at worst); 2e-2 allows the input and output roundings plus fp32 accumulation, and still
# catches any real error (a missing block or a wrong mask shows up at 1e-1 or more).
RUNS = [(case, "float64", 1e-10) for case in sorted(CASES)] + [
    (case, "float32", 1e-5) for case in ("asymmetric", "gqa4-three-groups", "ring-mqa-noncausal")] + [
    (case, "bfloat16", 2e-2) for case in ("asymmetric", "gqa4-three-groups", "one-rank", "one-group-gqa")]


@functools.lru_cache(maxsize=None)
def reference(case, head_dim, batch):
    """The float64 reference of a case's plan, computed once for every dtype it runs in and handed to its ranks."""
    return dist_worker.reference(CASES[case]().to_json(), head_dim, batch)


@pytest.mark.parametrize("case,dtype,tol", RUNS)
def test_plan_matches_single_process(case, dtype, tol, tmp_path):
    plan = CASES[case]()
    world = plan.cluster.num_devices
    seq_len = plan.seq_len
    head_dim = 8 if seq_len < 1000 else 4  # the plan's model may say otherwise: execution takes any head_dim
    out = spawn(dist_worker.check_plan_against, world,
                (plan.to_json(), dtype, head_dim, 2, reference(case, head_dim, 2)), tmp_path)
    for rank, (status, errs, dtype_ok) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {errs}"
        assert dtype_ok, f"rank {rank}: output or gradient not in {dtype}"
        names = ("out", "dq", "dk", "dv")
        for name, e in zip(names, errs):
            assert e <= tol, f"{case} {dtype} rank {rank}: {name} relative error {e:.3g} > {tol}"


@pytest.mark.parametrize("case", ["asymmetric", "gqa4-three-groups"])
def test_torch_block_kernels_path(case, tmp_path):
    """The PyTorch block kernels and merge (the path CUDA tensors take until the CUDA kernels are built),
    forced on CPU, against the same float64 reference. Tolerance 1e-8, not the C path's 1e-10: once in about
    twenty runs on a loaded machine this path's output was off by 5e-10 (never reproduced in isolation, where
    it is 1e-15); it is recorded as an open question. A logic error here shows up at 1e-3 or more."""
    plan = CASES[case]()
    out = spawn(dist_worker.check_plan_torch, plan.cluster.num_devices, (plan.to_json(), "float64", 8, 2), tmp_path)
    for rank, (status, errs, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {errs}"
        for name, e in zip(("out", "dq", "dk", "dv"), errs):
            assert e <= 1e-8, f"{case} torch kernels rank {rank}: {name} relative error {e:.3g}"


@pytest.mark.parametrize("kernels", ["", "torch"])
def test_nan_reaches_the_outputs_it_reaches_on_one_device(kernels, tmp_path):
    """A NaN in q or k through the runtime (uneven groups, a rank with one token, a rank with no heads; the C
    kernels and merge, and the PyTorch block path): out is NaN exactly where the float64 single-process reference
    is, the gradients' NaN rows are the reference's, and every other entry is within 1e-10. Before, the merge
    dropped a block whose LSE the kernels had turned into -inf, and rows seeing a NaN key came out finite."""
    plan = CASES["asymmetric"]()
    out = spawn(dist_worker.check_nonfinite, plan.cluster.num_devices, (plan.to_json(), kernels), tmp_path)
    seen = {"q": 0, "k": 0}
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        for poison, rows in report.items():
            for name, here, ref, ok in rows:
                assert ok, f"NaN in {poison}, rank {rank}: {name} has {here} NaN entries, the reference {ref}"
                seen[poison] += here
    assert seen["q"] > 0 and seen["k"] > 0, "the poison must reach some rank's outputs"


@pytest.mark.parametrize("case,slices", [("asymmetric", 3), ("gqa4-three-groups", 2), ("one-group-gqa", 4)])
def test_sliced_layer_is_exact(case, slices, tmp_path):
    """The layer pipelined in slices of kv heads (a2a_slices) computes the same attention: float64 within 1e-10
    of the single-process reference, forward and backward, on plans with shared kv heads, parked heads and
    unequal groups."""
    plan = CASES[case]()
    out = spawn(dist_worker.check_plan_sliced, plan.cluster.num_devices, (plan.to_json(), "float64", 8, 2, slices),
                tmp_path)
    for rank, (status, errs, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {errs}"
        for name, e in zip(("out", "dq", "dk", "dv"), errs):
            assert e <= 1e-10, f"{case} {slices} slices rank {rank}: {name} relative error {e:.3g}"


def test_plan_inside_a_process_group_of_each_replica(tmp_path):
    """Data parallelism over sequence-parallel replicas: world 4 = 2 replicas of the same 2-device plan, each
    in its own process group (rank r of the group is device r of the plan)."""
    plan = layout_plan((2,), tiny_model(6, 2), 45, [
        {"devices": [0, 1], "seq": 45, "tokens": [30, 15], "heads": [4, 2]}])  # one HP group: a subgroup per replica
    out = spawn(dist_worker.check_plan_in_replicas, 4, (plan.to_json(),), tmp_path, timeout_s=60)
    for rank, (status, errs, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {errs}"
        assert max(errs) <= 1e-10, f"rank {rank}: errors {errs}"


def test_plan_runs_on_a_dimension_of_a_device_mesh(tmp_path):
    """The process group can be a dimension of the job's torch DeviceMesh (the "cp" dimension of a (dp, cp) mesh,
    as torchtitan builds them), passed as the mesh itself: the same replicas as above, exact to 1e-10; the whole
    2-D mesh is refused on every rank, naming its dimensions."""
    plan = layout_plan((2,), tiny_model(6, 2), 45, [
        {"devices": [0, 1], "seq": 45, "tokens": [30, 15], "heads": [4, 2]}])
    out = spawn(functools.partial(dist_worker.check_plan_in_replicas, mesh=True), 4, (plan.to_json(),), tmp_path,
                timeout_s=60)
    for rank, (status, errs, refused) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {errs}"
        assert max(errs) <= 1e-10, f"rank {rank}: errors {errs}"
        assert refused is not None and "one-dimensional DeviceMesh" in refused and "['dp', 'cp']" in refused, refused


def test_fingerprint_mismatch_raises_on_every_rank(tmp_path):
    c = cluster(1, 1, 1)
    m = tiny_model(6, 2)
    good = hexiseq.plan(c, model=m, seq_len=90, strategy="ring")
    other = hexiseq.plan(c, model=m, seq_len=91, strategy="ring")
    t0 = time.monotonic()
    out = spawn(dist_worker.check_mismatch, 3, ([good.to_json(), good.to_json(), other.to_json()],), tmp_path,
                timeout_s=60)
    elapsed = time.monotonic() - t0
    for rank, (status, msg, _) in sorted(out.items()):
        assert status == "raised", f"rank {rank}: {status} {msg}"
        assert "disagree" in msg and good.fingerprint in msg and other.fingerprint in msg
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_shard_unshard_positions_roundtrip():
    plan = CASES["gqa4-three-groups"]()
    x = torch.arange(plan.seq_len * 3, dtype=torch.float64).reshape(1, plan.seq_len, 3)
    shards = [plan.shard(x, 1, r) for r in range(plan.cluster.num_devices)]
    assert [s.shape[1] for s in shards] == [int(plan.devices.tokens[plan._slot(r)]) for r in range(5)]
    assert torch.equal(plan.unshard(shards, 1), x)
    for r in range(5):
        assert torch.equal(shards[r][0, :, 0] / 3, torch.as_tensor(plan.positions(r), dtype=torch.float64))
    allpos = sorted(p for r in range(5) for p in plan.positions(r).tolist())
    assert allpos == list(range(plan.seq_len))


def _short_documents(total, pattern=(3, 1, 4, 1, 5, 9, 2, 6)):
    """Many short documents (lengths cycling through `pattern`, the last one cut) summing to `total`."""
    out, i = [], 0
    while sum(out) < total:
        out.append(min(pattern[i % len(pattern)], total - sum(out)))
        i += 1
    return out


def _documents_at_chunk_ends(plan):
    """Documents that start at the last position of every chunk of every group: a query chunk then sees exactly one
    key of the chunk before it in position order, so a ring step that skipped a block one key too eagerly fails."""
    ends = sorted({0} | {p0 + n - 1 for g in range(plan.num_groups) for p0, n in plan.group_chunks(g)})
    return [b - a for a, b in zip(ends, ends[1:] + [plan.seq_len]) if b > a]


def document_cases(plan):
    """(name, documents, batch, kernels, slices): documents that cross the groups' chunk boundaries with a document
    of one token first, documents starting one key before each chunk, many short ones, a single one (plain
    causal), one list per batch row; on the C kernels, the PyTorch block path and a layer pipelined in two
    slices."""
    S = plan.seq_len
    crossing, edges = [1, 20, S - 40, 19], _documents_at_chunk_ends(plan)
    rows = [crossing, _short_documents(S, (7, 2, 11))]
    return [("crossing", crossing, 2, "", None), ("edges", edges, 1, "", None),
            ("short", _short_documents(S), 1, "", None), ("one", [S], 2, "", None), ("rows", rows, 2, "", None),
            ("crossing-torch", crossing, 2, "torch", None), ("edges-torch", edges, 1, "torch", None),
            ("rows-torch", rows, 2, "torch", None), ("short-torch", _short_documents(S), 1, "torch", None),
            ("crossing-sliced", crossing, 2, "", 2)]


def contiguous_for_documents(plan):
    """The plan's groups in contiguous chunks (every back chunk empty), priced for the crossing documents: what
    the planner may choose for packed documents."""
    layout = dict(plan.layout.to_dict(), chunking="contiguous")
    S = plan.seq_len
    return hexiseq.evaluate(plan.cluster, model=plan.model, seq_len=S, layout=layout,
                            documents=[1, 20, S - 40, 19])


@pytest.mark.parametrize("case", ["asymmetric", "gqa4-three-groups", "one-group-gqa"])
def test_documents_match_single_process(case, tmp_path):
    """Packed documents: forward and backward in float64 within 1e-10 of the one-process reference with the same
    document mask, on unequal groups, unequal and unaligned head shares, a kv head split between two ranks, a
    one-token rank and GQA, for every case of document_cases, on the plan made without documents (a documents call
    runs on any plan, only less balanced) and then on its layout in contiguous chunks made for documents, in one
    spawn. The PyTorch path is held to the 1e-8 of test_torch_block_kernels_path."""
    plan = CASES[case]()
    contiguous = contiguous_for_documents(plan)
    assert [len(contiguous.group_chunks(g)) for g in range(contiguous.num_groups)] == [1] * contiguous.num_groups
    runs = [(plan.to_json(), document_cases(plan)),
            (contiguous.to_json(), [c for c in document_cases(contiguous) if c[0] in ("crossing", "edges-torch")])]
    t0 = time.monotonic()
    out = spawn(dist_worker.check_documents, plan.cluster.num_devices, (runs,), tmp_path)
    elapsed = time.monotonic() - t0
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        for (_, cases), (chunks, per_case) in zip(runs, zip(("zigzag", "contiguous"), report)):
            assert sorted(per_case) == sorted(c[0] for c in cases)
            for name, errs in per_case.items():
                tol = 1e-8 if "torch" in name else 1e-10
                for what, e in zip(("out", "dq", "dk", "dv"), errs):
                    assert e <= tol, (f"{case} {chunks} documents {name} rank {rank}: {what} relative error {e:.3g} "
                                      f"> {tol}")
    assert elapsed < 100, f"took {elapsed:.1f} s"


# (name, window, softcap, sinks, documents, kernels): windows narrower than a rank's shard (most ring block pairs
# skipped), wider than one (pairs partly visible), one key; soft-capping; sinks; all together with documents; the
# PyTorch block path
def _window_at_chunk_edge(plan):
    """A left window that exactly reaches the last key of one chunk from the first query of a later chunk: a ring
    step that skipped a block pair one key too eagerly (or kept one too many) shows."""
    chunks = sorted((p0, n) for g in range(plan.num_groups) for p0, n in plan.group_chunks(g) if n)
    (a0, an), (b0, _) = chunks[0], chunks[min(2, len(chunks) - 1)]
    return b0 - (a0 + an - 1)


def _variant_cases(plan):
    S = plan.seq_len
    causal = plan.causal
    cases = [("window-edge", (_window_at_chunk_edge(plan), 0 if causal else -1), None, False, None, ""),("window-5", (5, 0 if causal else 5), None, False, None, ""),
             ("window-40", (40, -1), None, False, None, ""),
             ("window-0", (0, 0), None, False, None, ""),
             ("softcap", None, 1.5, False, None, ""),
             ("sinks", None, None, True, None, ""),
             ("window-softcap-sinks", (17, -1), 3.0, True, None, ""),
             ("window-softcap-sinks-torch", (17, -1), 3.0, True, None, "torch")]
    if causal:
        cases.append(("window-documents", (25, 0), 2.0, True, [1, 20, S - 40, 19], ""))
    else:
        cases.append(("window-right-only", (-1, 9), None, False, None, ""))
    return cases


def _contiguous(plan):
    return hexiseq.evaluate(plan.cluster, model=plan.model, seq_len=plan.seq_len,
                            layout=dict(plan.layout.to_dict(), chunking="contiguous"))


@pytest.mark.parametrize("case", ["asymmetric", "gqa4-three-groups", "ring-mqa-noncausal",
                                  "gqa4-three-groups-contiguous"])
def test_attention_variants_match_single_process(case, tmp_path):
    """Sliding windows, soft-capping and sink logits across uneven plans (head parallelism with a one-token rank and
    unequal head shares, three ring groups with a kv head split between two ranks, a non-causal MQA ring, and the
    three groups in contiguous chunks, where a 5-token window cuts the ring to 2 of its 3 steps and the
    accumulators go home directly): forward, backward and the sinks' gradient in float64 within 1e-10 of one
    process (1e-8 on the PyTorch path)."""
    plan = _contiguous(CASES[case[:-len("-contiguous")]]()) if case.endswith("-contiguous") else CASES[case]()
    if case.endswith("-contiguous"):
        from hexiseq.runtime.topology import Topology
        from hexiseq.runtime.variants import variant
        assert Topology(plan, True).ring_steps(True, variant((5, 0))) == 2 < plan.num_groups
    cases = _variant_cases(plan)
    out = spawn(dist_worker.check_variants, plan.cluster.num_devices, (plan.to_json(), cases), tmp_path)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert sorted(report) == sorted(c[0] for c in cases)
        for name, errs in report.items():
            tol = 1e-8 if "torch" in name else 1e-10
            for what, e in zip(("out", "dq", "dk", "dv", "dsinks"), errs):
                assert e <= tol, f"{case} {name} rank {rank}: {what} relative error {e:.3g} > {tol}"
