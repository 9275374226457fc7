"""Pipeline plans (hexiseq.planner.pipeline): stages cut at node boundaries by speed, layers split by the stages'
speeds and memory, each stage's layout the scheduler's for its part of the model, and the step the schedule's
simulation over the stages' times; the compute floor is below every plan it bounds."""

import dataclasses

import pytest

import hexiseq
from hexiseq import _core
from hexiseq.errors import InvalidArgumentError
from hexiseq.planner import Cluster, Node
from hexiseq.planner.floor import compute_floor_s, model_flops
from hexiseq.planner.pipeline import plan_pipeline, stage_cuts
from hexiseq.planner.plan import plan_layout

MODEL = hexiseq.Model(layers=12, hidden=1024, heads=16, kv_heads=4, head_dim=64, ffn=4096, vocab=32000,
                      gated_mlp=True, name="small")


def nodes(*kinds, inter=25.0):
    return Cluster([Node(g, n, 300.0) for g, n in kinds], inter_node_gbps=inter)


def test_model_flops_by_hand():
    # one layer: q, o (H x A d), k, v (H x A_kv d), a gated MLP (3 H F), two norms (2 H); 6 per parameter and token
    H, A, Akv, d, F, V, L, S = 1024, 16, 4, 64, 4096, 32000, 12, 2048
    layer = H * A * d * 2 + 2 * H * Akv * d + 3 * H * F + 2 * H
    matmul, attention = model_flops(MODEL, S, sequences=3)
    assert matmul == pytest.approx(3 * 6.0 * S * (L * layer + V * H), rel=1e-12)
    assert attention == pytest.approx(3 * 12.0 * L * S * (S + 1) / 2 * d * A, rel=1e-12)
    _, full = model_flops(MODEL, S, causal=False)
    assert full == pytest.approx(12.0 * L * S * S * d * A, rel=1e-12)
    windowed = dataclasses.replace(MODEL, sliding_window=512, sliding_layers=6)
    _, some = model_flops(windowed, S)
    per_window = 512 * 513 / 2 + (S - 512) * 512
    assert some == pytest.approx(12.0 * d * A * (6 * S * (S + 1) / 2 + 6 * per_window), rel=1e-12)


def test_stage_cuts_follow_the_nodes_rates():
    c = nodes(("H100-SXM", 8), ("H100-SXM", 8), ("H100-SXM", 8), ("H100-SXM", 8))
    assert stage_cuts(c, 2) == [tuple(range(16)), tuple(range(16, 32))]
    assert stage_cuts(c, 4) == [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]
    assert stage_cuts(c, 5) is None
    # two fast nodes then four slow ones (an H100's matmul rate, 989.4 x 0.55, is 2.9x an A100's, 312 x 0.6): half
    # the rate is reached inside the second H100 node (at 1.54 nodes' worth of 2 x 2.9 + 4), nearer its end than its
    # start, so the cut falls after it: 2 H100 nodes (5.8) against 4 A100 nodes (4), better than 2.9 against 6.9
    mixed = nodes(("H100-SXM", 8), ("H100-SXM", 8), ("A100-80G", 8), ("A100-80G", 8), ("A100-80G", 8),
                  ("A100-80G", 8))
    cuts = stage_cuts(mixed, 2)
    assert [len(c) for c in cuts] == [16, 32] and cuts[0][0] == 0 and cuts[1][-1] == 47
    three = stage_cuts(mixed, 3)
    assert sum(len(c) for c in three) == 48 and all(len(c) % 8 == 0 and c for c in three)
    assert [len(c) for c in stage_cuts(mixed, 6)] == [8] * 6


def test_a_pipeline_plan_is_its_stages_and_their_schedule():
    c = nodes(("H100-SXM", 4), ("A100-80G", 4), inter=10.0)
    tr = hexiseq.Training(sequences=6)
    p = plan_pipeline(c, model=MODEL, seq_len=8192, training=tr, pipelines=1, stages=2, pack=1)
    assert len(p.stages) == 2 and p.micro_batches == 6
    assert [s.devices for s in p.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert sum(s.layers for s in p.stages) == 12 and p.stages[1].first_layer == p.stages[0].layers
    first, last = p.stages[0].plan.model, p.stages[1].plan.model
    assert (first.embedding, first.head, last.embedding, last.head) == (True, False, False, True)
    assert [s.plan.model.layers for s in p.stages] == [s.layers for s in p.stages]
    # the faster devices hold more layers
    assert p.stages[0].layers > p.stages[1].layers
    # each stage's time per micro-batch is its plan's step over the micro-batches, forward : backward 1 : 2
    for s in p.stages:
        assert s.forward_s + s.backward_s == pytest.approx(s.plan.step_time_s / 6, rel=1e-12)
        assert s.backward_s == pytest.approx(2 * s.forward_s, rel=1e-12)
        assert s.memory_gib <= s.memory_cap_gib
    # the step is the schedule's simulation over the stages and the send between them
    send = 8192 * MODEL.hidden * MODEL.dtype_bytes / (4 * 10.0e9) + 20e-6
    assert p.send_s == (pytest.approx(send, rel=1e-12),)
    timing, idle, held = _core.pipeline_schedule([s.forward_s for s in p.stages], [s.backward_s for s in p.stages],
                                                 [send], 6)
    assert p.step_time_s == pytest.approx(timing["step_s"], rel=1e-12) and held.tolist() == [2, 1]
    assert p.bubble_s == pytest.approx(p.step_time_s - p.work_s, rel=1e-12) and p.bubble_s > 0
    assert [s.in_flight for s in p.stages] == [2, 1]
    text = p.explain()
    assert "2 stages" in text and "+emb" in text and "+head" in text and "compute floor" in text
    assert p.to_dict()["predicted"]["step_time_s"] == p.step_time_s


def test_one_stage_is_the_layout_of_today_under_its_fastest_setting():
    c = nodes(("H100-SXM", 4), ("A100-80G", 4))
    tr = hexiseq.Training(sequences=3)
    p = plan_pipeline(c, model=MODEL, seq_len=16384, training=tr, pipelines=1, stages=1, pack=1)
    today = [plan_layout(c, model=MODEL, seq_len=16384, training=t, strategy="hexiseq")
             for t in (tr, dataclasses.replace(tr, sharding="opt"))]
    assert p.step_time_s == pytest.approx(min(x.step_time_s for x in today), rel=1e-9)
    assert p.bubble_s == pytest.approx(0.0, abs=1e-9) and p.stages[0].in_flight == 1
    # every sequence packed into one micro-batch: one pass of their documents, as a batch plan's group runs them
    packed = plan_pipeline(c, model=MODEL, seq_len=16384, training=tr, pipelines=1, stages=1, pack=3)
    one = hexiseq.Training(sequences=1)
    passes = [plan_layout(c, model=MODEL, seq_len=3 * 16384, training=t, strategy="hexiseq", documents=[16384] * 3)
              for t in (one, dataclasses.replace(one, sharding="opt"))]
    assert packed.pack == 3 and packed.micro_batches_of == (1,)
    assert packed.step_time_s == pytest.approx(min(x.step_time_s for x in passes), rel=1e-9)
    assert packed.step_time_s < p.step_time_s  # the parameters gathered once, not once per sequence


def test_the_fastest_shape_is_chosen_and_every_shape_reported():
    c = nodes(("H100-SXM", 4), ("H100-SXM", 4), ("A100-80G", 4), ("A100-80G", 4), inter=5.0)
    p = plan_pipeline(c, model=MODEL, seq_len=4096, training=hexiseq.Training(sequences=8))
    shapes = {(r, k, pack) for r, k, pack, _ in p.alternatives}
    # packs of 1, 2, 4 sequences while a pipeline of several stages keeps as many micro-batches as stages; one stage
    # runs one sequence per micro-batch (the sequences shared out evenly and by the pipelines' rates: the same shape
    # may be tried with both)
    assert shapes == {(1, 1, 1), (1, 2, 1), (1, 2, 2), (1, 2, 4), (1, 4, 1), (1, 4, 2), (2, 1, 1), (2, 2, 1),
                      (2, 2, 2), (4, 1, 1)}
    assert p.step_time_s == min(t for *_, t in p.alternatives if t is not None)
    chosen = [(r, k, pack) for r, k, pack, t in p.alternatives if t == p.step_time_s][0]
    assert (len(p.pipelines), len(p.stages), p.pack) == chosen


def test_faster_pipelines_take_more_sequences():
    """Two pipelines over an H100 node and an A100 node: sharing the sequences by the nodes' matmul rates (2.9 : 1)
    gives the H100 pipeline 6 of 8, and the step is faster than the even share."""
    c = nodes(("H100-SXM", 4), ("A100-80G", 4))
    tr = hexiseq.Training(sequences=8)
    p = plan_pipeline(c, model=MODEL, seq_len=4096, training=tr, pipelines=2, stages=1, pack=1)
    assert p.micro_batches_of == (6, 2)
    times = [t for r, k, pack, t in p.alternatives]
    assert len(times) == 2 and p.step_time_s == min(times) < max(times)


def test_pipelines_side_by_side_share_the_sequences_and_sync_their_gradients():
    """Two pipelines of two stages over four nodes: each runs half the sequences over its two nodes, the second the
    first's stages two nodes along; the step is the slower pipeline's schedule plus the all-reduce of each stage's
    gradients with its counterpart, by hand: 2 (R - 1) / R of a device's share over the link between nodes, plus
    2 (R - 1) latencies of 20 us."""
    c = nodes(("H100-SXM", 4), ("A100-80G", 4), ("H100-SXM", 4), ("A100-80G", 4), inter=10.0)
    p = plan_pipeline(c, model=MODEL, seq_len=8192, training=hexiseq.Training(sequences=6), pipelines=2, stages=2,
                      pack=1)
    assert len(p.pipelines) == 2 and p.micro_batches_of == (3, 3)
    one, two = p.pipelines
    assert [s.devices for s in one] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [s.devices for s in two] == [(8, 9, 10, 11), (12, 13, 14, 15)]
    assert [s.layers for s in one] == [s.layers for s in two] and sum(s.layers for s in one) == 12
    share = max(s.plan.model.params * 2 / 4 for s in one)
    assert p.sync_s == pytest.approx(2 * 1 / 2 * share / 10e9 + 2 * 20e-6, rel=1e-12)
    timing, _, _ = _core.pipeline_schedule([s.forward_s for s in one], [s.backward_s for s in one], list(p.send_s), 3)
    assert p.step_time_s == pytest.approx(timing["step_s"] + p.sync_s, rel=1e-12)
    assert "2 pipelines (data parallel) of 2 stages" in p.explain()
    # odd sequences: the first pipeline runs one more, and the step waits for it
    odd = plan_pipeline(c, model=MODEL, seq_len=8192, training=hexiseq.Training(sequences=5), pipelines=2, stages=2,
                        pack=1)
    assert odd.micro_batches_of == (3, 2)


def test_the_compute_floor_is_below_every_plan():
    for c, S, n in ((nodes(("H100-SXM", 4), ("A100-80G", 4)), 16384, 2),
                    (nodes(("H100-SXM", 8), ("H100-SXM", 8), inter=50.0), 32768, 4)):
        floor = compute_floor_s(c, MODEL, S, n)
        tr = hexiseq.Training(sequences=n)
        assert plan_pipeline(c, model=MODEL, seq_len=S, training=tr).step_time_s > floor
        layout = plan_layout(c, model=MODEL, seq_len=S, training=tr)
        assert layout.step_time_s > floor and layout.compute_floor_s == pytest.approx(floor, rel=1e-12)
        step = hexiseq.plan(c, model=MODEL, seq_len=S, training=tr)
        assert step.step_time_s > step.compute_floor_s == pytest.approx(floor, rel=1e-12)
    # a batch of unequal sequences and documents: the floor counts each one's visible pairs
    c = nodes(("H100-SXM", 4), ("A100-80G", 4))
    bp = hexiseq.planner.plan_batch(c, model=MODEL, lengths=[[1024, 3072], 8192, 2048])
    matmul, attention = model_flops(MODEL, 0, 0, documents=[[1024, 3072], [8192], [2048]])
    assert attention == pytest.approx(12.0 * 12 * 64 * 16 * sum(d * (d + 1) / 2 for d in (1024, 3072, 8192, 2048)))
    assert bp.step_time_s > bp.compute_floor_s == pytest.approx(compute_floor_s(c, MODEL, 0, 0, documents=[
        [1024, 3072], [8192], [2048]]), rel=1e-12)


@pytest.mark.parametrize("kwargs,words", [({"stages": 0}, "stages must be in [1, 2], got 0"),
                                           ({"stages": 3}, "stages must be in [1, 2], got 3"),
                                           ({"stages": "2"}, "stages must be an integer"),
                                           ({"pipelines": 3}, "pipelines must be in [1, 2], got 3"),
                                           ({"pipelines": 2, "stages": 2}, "stages must be in [1, 1], got 2"),
                                           ({"pack": 0}, "pack must be in [1, 4], got 0"),
                                           ({"pipelines": 2, "pack": 3}, "pack must be in [1, 2], got 3")])
def test_bad_shapes_are_named(kwargs, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("[", r"\[").replace("]", r"\]")):
        plan_pipeline(nodes(("H100-SXM", 4), ("A100-80G", 4)), model=MODEL, seq_len=4096,
                      training=hexiseq.Training(sequences=4), **kwargs)


def test_a_stage_that_holds_no_layer_makes_no_plan():
    tiny = nodes(("H100-SXM", 1), ("H100-SXM", 1))
    with pytest.raises(hexiseq.MemoryFitError, match=r"no pipeline plan \(1 x 1 stages, 1 x 2 stages tried\)"):
        plan_pipeline(tiny, model="llama3-70b", seq_len="1m")


def test_the_floor_holds_under_measured_rates_faster_than_the_catalog():
    """A cluster whose measured matmul and attention rates beat the catalog's (calibrated on faster parts than it
    names): the cost model prices with the measured curves, and the floor takes the fastest measured point, so it
    stays below the plan (with the catalog's rates alone it would not)."""
    base = nodes(("H100-SXM", 2), ("A100-80G", 2))
    fast = {"gemm_tflops": [[512, 1500.0], [65536, 1800.0]], "attn_tflops": [[512, 900.0], [65536, 1200.0]],
            "attn_causal_tflops": [[512, 800.0], [65536, 1100.0]]}
    c = Cluster.from_dict({**base.to_dict(), "devices": [fast] * 4})
    p = plan_layout(c, model=MODEL, seq_len=32768, training=hexiseq.Training(sequences=2))
    assert p.step_time_s > p.compute_floor_s
    catalog_only = compute_floor_s(base, MODEL, 32768, 2)
    assert p.compute_floor_s < p.step_time_s < catalog_only
