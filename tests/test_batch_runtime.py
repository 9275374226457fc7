"""Steps of BatchPlans run by the batch runtime (hexiseq.nn.BatchContext) on four Gloo ranks: long-tail batches
of sequences (some of them packed documents) on groups of unequal devices, trained for a few SGD steps with a small
attention language model in float64 against one process that runs every document on its own.

Tolerance 1e-10 relative (to the largest value) for the loss, the per-sequence loss sums and every gradient, and
1e-10 absolute for the parameters after the steps: the same sums in another order (blocks, merges, the gradient
all-reduce), a few ulps times the number of terms. A token attending across a document or sequence boundary, a
label taken from the next sequence, a position not restarted, or a group's gradient missing shows up at 1e-2 or
more."""

import functools
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import batch_worker  # noqa: E402
import dist_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

CANDIDATES = {
    "tree": None,  # the planner's own: the cluster, each node, each device
    "single-devices": [(0, 1, 2, 3), (0,), (1,), (2,), (3,)],
    "three-and-one": [(0, 1, 2, 3), (0, 1, 2), (3,), (0,), (1, 2)],
    "whole-cluster": [(0, 1, 2, 3)],  # one group: every sequence packed into one pass over all ranks
}


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_batch_plans_train_as_one_process(name, tmp_path):
    t0 = time.monotonic()
    out = dist_worker.spawn(batch_worker.train_on_batch_plans, 4, (CANDIDATES[name], 3), tmp_path, timeout_s=180)
    elapsed = time.monotonic() - t0
    reports = {}
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        reports[rank] = report
    for rank, report in reports.items():
        assert report["steps"] == reports[0]["steps"] or all(
            s["groups"] == t["groups"] for s, t in zip(report["steps"], reports[0]["steps"]))
        for i, s in enumerate(report["steps"]):
            assert s["labelled"][0] == s["labelled"][1], s
            for what in ("loss", "per_sequence", "grads"):
                assert s[what] <= 1e-10, f"{name} step {i} rank {rank}: {what} relative error {s[what]:.3g}: {s}"
        assert report["params"] <= 1e-10, f"{name} rank {rank}: parameters differ by {report['params']:.3g}"
    groups = [s["groups"] for s in reports[0]["steps"]]
    if name == "whole-cluster":
        assert all(g == [[0, 1, 2, 3]] for g in groups), groups
    else:  # the point of a batch plan: more than one group in a step
        assert any(len(g) > 1 for g in groups), groups
    assert elapsed < 120, f"took {elapsed:.1f} s"


def test_batch_plans_run_every_attention_variant(tmp_path):
    """A sliding window, logit soft-capping and trained sink logits (Mistral, Gemma 2, gpt-oss layers) on batch
    plans: the passes' attention takes the layer's variant as one layout's does, and three SGD steps equal one process
    running every document alone with the same variant (float64, 1e-10 as above; passes that drop the window of 40
    tokens give a loss 1.6e-5 off)."""
    variant = {"window": (39, 0), "softcap": 20.0, "sinks": True}
    out = dist_worker.spawn(functools.partial(batch_worker.train_on_batch_plans, variant=variant), 4,
                            (CANDIDATES["tree"], 3), tmp_path, timeout_s=180)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        for i, s in enumerate(report["steps"]):
            for what in ("loss", "per_sequence", "grads"):
                assert s[what] <= 1e-10, f"variants step {i} rank {rank}: {what} relative error {s[what]:.3g}: {s}"
        assert report["params"] <= 1e-10, f"variants rank {rank}: parameters differ by {report['params']:.3g}"


def test_ranks_that_disagree_about_a_batch_plan_fail_together(tmp_path):
    out = dist_worker.spawn(batch_worker.batch_refusals, 3 + 1, (), tmp_path, timeout_s=120)
    by_rank = {}
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        by_rank[rank] = report
    for rank, report in by_rank.items():
        kind, message, _ = report["different_plans"]
        assert kind == "RankMismatchError" and "batch plan" in message, (rank, kind, message)
        kind, message, _ = report["not_a_plan"]
        assert kind == "InvalidArgumentError" and "plan must be a hexiseq.Plan" in message \
            and "Schedule it runs as), got dict" in message, message
        kind, message, _ = report["other_model"]
        assert kind == "InvalidArgumentError" and "another cluster or model" in message, message
        kind, passes, _ = report["one_layout"]
        assert kind == "ok" and len(passes) == 1 and passes[0][0] == [0] and passes[0][1] == passes[0][2], passes
        assert report["good_after"][0] == "ok", report["good_after"]
        bad, busy = report["probe"][1]
        kind, message, _ = report["per_sequence_values"]
        assert kind == "InvalidArgumentError" and f"rank {bad}:" in message and "must hold" in message, (rank, message)
        kind, message, _ = report["not_a_planner"]
        assert kind == "InvalidArgumentError" and "rank 1" in message and "not one step's BatchPlan" in message, \
            (rank, message)
    # the bad rank's group refuses its pass on every member, naming the global rank; other groups are not in the call
    for rank in busy:
        kind, message, _ = by_rank[rank]["pass_input"]
        assert kind == "InvalidArgumentError" and f"rank {bad}:" in message, message
        if bad != busy.index(bad):
            assert f"(global rank {bad})" in message, message


def test_hugging_face_model_trains_on_batch_plans(tmp_path):
    """A transformers Llama patched with a BatchContext: each rank feeds pass_.hf_inputs(ids) inside `with pass_:`
    (in the last step a pass parks a rank, which feeds its empty shard); losses and parameters after four AdamW steps
    equal the model trained in one process on every document alone (float64; 1e-10 relative for the loss, 1e-9
    absolute for parameters of size ~0.1 after AdamW's normalised steps)."""
    pytest.importorskip("transformers")
    out = dist_worker.spawn(batch_worker.hf_batch_training, 4, (3,), tmp_path, timeout_s=240)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        for i, s in enumerate(report["steps"]):
            assert s["loss"] <= 1e-10, f"rank {rank} step {i}: loss relative error {s['loss']:.3g}: {s}"
        assert report["params"] <= 1e-9, f"rank {rank}: parameters differ by {report['params']:.3g}"
    assert any(report["steps"][-1]["parked"] for _, report, _ in out.values()), out   # the short step parks a rank


@pytest.mark.parametrize("name", ["three-and-one", "tree"])
def test_batch_plans_with_sharded_states(name, tmp_path):
    """Model states sharded unevenly over all four ranks (hexiseq.states.shard_states, reduce="sum") under batch
    plans whose groups make different numbers of passes (an idle group makes none): every rank runs
    step.padded_passes(), and the parameters after three SGD steps equal one process's (float64, 1e-10)."""
    out = dist_worker.spawn(batch_worker.train_with_sharded_states, 4, (CANDIDATES[name], 3), tmp_path, timeout_s=180)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report["params"] <= 1e-10, f"{name} rank {rank}: parameters differ by {report['params']:.3g}"
    passes = out[0][1]["passes"]
    if name == "three-and-one":  # the case that needs the padding: a group without passes beside a busy one
        assert any(0 in p and max(p) > 0 for p in passes), passes


def test_states_held_once_per_group_train_as_one_process(tmp_path):
    """HSDP with unequal groups: the states held once in group [0] and once in group [1, 2, 3] (shares 0.5, 0.3,
    0.2 there), each group running only its own passes of each step (two in the first, one in the second), the
    gradients summed across the groups by sync_replicas; Adam, reduce="mean" over the four ranks.
    The parameters after three steps equal one process's (float64, 1e-10), and a checkpoint of them (written by the
    first group) loads into the model sharded over the world at other shares; a save the first group cannot write
    raises on every rank."""
    out = dist_worker.spawn(batch_worker.train_with_replicated_states, 4, ([(0,), (1, 2, 3)], 3, str(tmp_path / "ck")),
                            tmp_path, timeout_s=180)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report["params"] <= 1e-10, f"rank {rank}: parameters differ by {report['params']:.3g}"
        assert report["round_trip"] <= 1e-10, f"rank {rank}: loaded parameters differ by {report['round_trip']:.3g}"
        # a save the first group cannot write fails on every rank alike, not on the writers alone
        kind, message = report["refused"]
        assert kind == "InvalidArgumentError" and "rank 0: saving the states to" in message, report["refused"]
    assert out[0][1]["passes"] == [[2, 1]] * 3
