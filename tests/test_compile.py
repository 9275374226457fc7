"""torch.compile around HexiSeq attention: a block that calls HexiSeqAttention compiles with fullgraph=True (the
layer is one custom op each way, hexiseq.runtime.compiled) on Gloo ranks of an asymmetric plan, and gives the eager
block's loss and gradients (float64, 1e-12 relative: the same kernels and collectives, only the code around them
compiled), with and without packed documents (whose lengths change between calls, as packed batches do), and
that forwards whose backward never runs keep nothing."""

import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import compile_worker  # noqa: E402
import dist_worker  # noqa: E402
from dist_plans import layout_plan, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(backend, tmp_path):
    # an HP group of two with unequal tokens and heads (a kv head split between them), then a ring step to a
    # single-device group: all-to-all, ring and shared-head reduction inside the op
    plan = layout_plan((2, 1), tiny_model(6, 2), 45, [
        {"devices": [0, 1], "seq": 30, "tokens": [20, 10], "heads": [4, 2]},
        {"devices": [2], "seq": 15, "tokens": [15], "heads": [6]}])
    t0 = time.monotonic()
    out = dist_worker.spawn(compile_worker.compiled_matches_eager, 3, (plan.to_json(), backend), tmp_path,
                            timeout_s=300)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report.pop("kept_after_forwards") == 0, report
        assert len(report) == 4, report
        assert len(report["window-softcap-sinks"]["errors"]) == 4
        for name, r in report.items():
            for what, e in zip(("loss", "dw", "do", "dsinks"), r["errors"]):
                assert e <= 1e-12, f"{backend} {name} rank {rank}: {what} relative error {e:.3g}"
    assert time.monotonic() - t0 < 240
