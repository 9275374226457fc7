"""The plan-free call (hexiseq.group): attention over a process group from the ranks' shards alone, in rank order or
zigzag, unequal shares, packed sequences by cu_seqlens, head parallelism across ranks; float64 against one process
within 1e-10 (the runtime's tolerance: the same sums in another order), forward and backward, on three Gloo ranks;
the log-sum-exp returned as flash-attn returns it; bad arguments on one rank raise the same error on every rank, and
the ranks stay in step."""

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dist_worker  # noqa: E402
import group_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_group_attention_matches_one_process_and_refuses_together(tmp_path):
    out = dist_worker.spawn(group_worker.group_attention_cases, 3, (), tmp_path, timeout_s=120)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert len(report["cases"]) == 6 and len(report["cases"]["variants"]) == 5
        for name, errs in report["cases"].items():
            for what, e in zip(("out", "dq", "dk", "dv", "dsinks"), errs):
                assert e <= 1e-10, f"{name} rank {rank}: {what} relative error {e:.3g}"
        r = report["refusals"]
        assert r["chunking"][0] == "InvalidArgumentError" and "rank 1" in r["chunking"][1] and \
            "chunking must be one of ['contiguous', 'zigzag'], got 'spiral'" in r["chunking"][1], r["chunking"]
        assert r["ulysses"][0] == "InvalidArgumentError" and "dividing the group's 3 ranks, got 2" in r["ulysses"][1]
        assert r["heads"][0] == "InvalidArgumentError" and "rank 2" in r["heads"][1], r["heads"]
        assert r["good_after"] == ("ok", [1, 10, 6, 8]), r["good_after"]
        assert r["return_lse"][0] == "RankMismatchError", r["return_lse"]
        assert r["return_lse_text"][0] == "InvalidArgumentError" and \
            "rank 2: return_lse must be True or False, got 'yes'" in r["return_lse_text"][1], r["return_lse_text"]
        assert r["scale_one_rank"][0] == "RankMismatchError" and "softmax_scale" in r["scale_one_rank"][1] and \
            "rank 1: 0.5" in r["scale_one_rank"][1], r["scale_one_rank"]
        assert r["scale_negative"][0] == "InvalidArgumentError" and \
            "rank 2: softmax_scale must be positive, got -1.0" in r["scale_negative"][1], \
            r["scale_negative"]
        for name, got in report["lse"].items():  # every case again, returning the log-sum-exp
            assert got["shape"][:2] == [1, group_worker.H] and not got["grad"], (name, got)
            assert got["lse"] <= 1e-10, f"{name} rank {rank}: lse relative error {got['lse']:.3g}"
            assert got["same"] == 0.0, f"{name} rank {rank}: output or gradients differ by {got['same']:.3g}"


def test_hugging_face_model_runs_unpatched_under_sequence_parallel(tmp_path):
    """A transformers Llama with attn_implementation="sdpa", not patched, inside hexiseq.group.sequence_parallel:
    its SDPA calls go through the runtime; loss and summed gradients equal one process on the whole sequence
    (float64, 1e-10), zigzag and contiguous shards; SDPA is restored after the block. A sequence shorter than the
    group is refused when sharded: no rank gets an empty shard."""
    pytest.importorskip("transformers")
    out = dist_worker.spawn(group_worker.hf_under_sequence_parallel, 3, (), tmp_path, timeout_s=180)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report.pop("short") == ("sequence_parallel gives each of the 3 ranks at least one token: seq_len must "
                                       "be at least 3, got 2"), report
        for chunking, r in report.items():
            assert r["loss"] <= 1e-10 and r["grads"] <= 1e-10, (chunking, rank, r)
            assert r["restored"], (chunking, rank, r)
