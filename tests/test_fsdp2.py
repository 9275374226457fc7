"""FSDP2 beside HexiSeq: blocks that call HexiSeqAttention, each wrapped by torch's fully_shard, on three Gloo ranks of
an asymmetric plan. With hexiseq.states.sum_fsdp2_gradients the full gradients equal one process on the whole
sequence (float64, 1e-10 relative); without it they are 1/world of that (FSDP2 averages), which the test also
shows so that the recipe's reason stays visible."""

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dist_worker  # noqa: E402
import fsdp2_worker  # noqa: E402
from dist_plans import layout_plan, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_fsdp2_with_summed_gradients_matches_one_process(tmp_path):
    plan = layout_plan((2, 1), tiny_model(6, 2), 45, [
        {"devices": [0, 1], "seq": 30, "tokens": [20, 10], "heads": [4, 2]},
        {"devices": [2], "seq": 15, "tokens": [15], "heads": [6]}])
    out = dist_worker.spawn(fsdp2_worker.fsdp2_matches_one_process, 3, (plan.to_json(),), tmp_path, timeout_s=120)
    for rank, (status, report, _) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
        assert report["units"] == 3, report           # two blocks and the root
        assert report["summed"] <= 1e-10, report
        assert report["ratio"] <= 1e-10, report       # FSDP2's own mean: exactly 1/world of the gradient
        assert report["mean"] > 0.5, report
