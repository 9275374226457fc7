"""Calibration and plan measurement on a few Gloo processes: results checked for sense, never for speed.

What is checked: the calibrated Cluster is equal on every rank; rates are positive and finite; the bandwidth
matrix (each direction timed by its receiver) is symmetric within noise; the YAML written plans exactly like the
in-memory Cluster; with rank 0 alone on one core and ranks 1 and 2 sharing another, calibration finds rank 0
faster (a 2:1 setup: the margin asked for, 1.2x, is far inside it). Measurement: equal on every rank, phase times
non-negative and adding up to no more than the rank's total, a prediction for every phase, JSON round trip."""

import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import hexiseq  # noqa: E402

import calibrate_worker as cw  # noqa: E402
import dist_worker  # noqa: E402
from errcheck import same_error_on_every_rank  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TWO_CORES = hasattr(os, "sched_getaffinity") and {0, 1} <= os.sched_getaffinity(0)


@pytest.fixture(scope="module")
def calibrated_run(tmp_path_factory):
    """Three ranks, rank 0 alone on core 0 and ranks 1, 2 on core 1 when the machine has two cores: each rank's
    calibrated cluster (a dict), and the probe's seconds per rank before and after calibrating."""
    cores = [{0}, {1}, {1}] if TWO_CORES else None
    out = dist_worker.spawn(cw.calibrate_pinned, 3, (cores,), tmp_path_factory.mktemp("cal"), timeout_s=180)
    for r, (status, value, *_) in out.items():
        assert status == "ok", f"rank {r}: {value}"
    return [out[r][1] for r in range(3)], out[0][2]


@pytest.fixture(scope="module")
def calibrated(calibrated_run):
    return calibrated_run[0]


# The ranks sharing core 1 run at half the speed of rank 0 on a quiet machine (2x on the probe); under load from
# other processes the contrast shrinks, and so does what the calibration can see. Below this, the tests that check
# that the calibration sees the difference have nothing to check and are skipped, saying what the probe measured.
MIN_CONTRAST = 1.5


@pytest.fixture(scope="module")
def contrast(calibrated_run):
    """Skip unless the machine gave the pinned ranks a contrast before and after calibrating."""
    seen = [min(p[r] / p[0] for r in (1, 2)) for p in calibrated_run[1]]
    if min(seen) < MIN_CONTRAST:
        pytest.skip(f"the machine gives the pinned ranks no contrast now: on a fixed matmul the ranks sharing a core "
                    f"took {seen[0]:.2f}x the time of the rank alone before calibrating and {seen[1]:.2f}x after "
                    f"(about 2x on a quiet machine; {MIN_CONTRAST}x needed)")
    return min(seen)


def test_calibration_is_equal_on_every_rank(calibrated):
    assert calibrated[0] == calibrated[1] == calibrated[2]


def test_calibrated_rates_and_links_make_sense(calibrated):
    spec = calibrated[0]
    c = hexiseq.Cluster.from_dict(spec)
    assert c.num_devices == 3
    assert len(spec["devices"]) == 3
    for d in spec["devices"]:
        for key in ("gemm_tflops", "attn_tflops", "attn_causal_tflops", "attn_document_tflops", "runtime_ns",
                    "runtime_a2a_ns", "runtime_ring_ns"):
            sizes = [s for s, _ in d[key]]
            assert sizes == sorted(sizes) and len(sizes) >= 2, (key, d[key])
            assert all(math.isfinite(v) and v > 0 for _, v in d[key]), (key, d[key])
        assert d["memory_gib"] > 0
        # the memory-bound work's rate, timed on the model's shapes: a CPU streams GB/s, not TB/s or KB/s
        assert 0.05 < d["mem_bound_gbps"] < 1000, d["mem_bound_gbps"]
    bw, lat = spec["bandwidth_gbps"], spec["latency_us"]
    for a in range(3):
        for b in range(3):
            if a != b:
                assert math.isfinite(bw[a][b]) and bw[a][b] > 0
                assert math.isfinite(lat[a][b]) and lat[a][b] > 0
                assert lat[a][b] == lat[b][a]  # one figure per pair: the mean of both ends
                # each direction is timed by its own receiver, both directions at once: equal within noise, for
                # pairs with a rank alone on its core (ranks 1 and 2 share core 1, and between them one direction
                # was seen at 4x the other). Within 10x, not 3x: a fresh clone's suite on a machine busy with other
                # work once read 4.2x on a pair with rank 0; a direction timed wrongly (a unit, the wrong receiver)
                # is off by 100x or more
                if 0 in (a, b):
                    assert 1 / 10 < bw[a][b] / bw[b][a] < 10, (a, b, bw)
    cal = spec["calibration"]
    assert cal["model"] == "tiny" and cal["world"] == 3 and cal["backend"] == "gloo"
    assert cal["links"] == "every pair"
    # the block backends each device's runtime will use (and its curves were timed with): on CPUs the C kernels
    assert cal["block_backends"] == [{"pairs": "hexiseq", "documents": "hexiseq"}] * 3
    assert [a["ranks"] for a in cal["all_to_all"]] == [2, 3]
    assert all(a["seconds"] > 0 for a in cal["all_to_all"])


@pytest.mark.skipif(not TWO_CORES, reason="needs cores 0 and 1 to pin ranks")
def test_calibration_finds_the_rank_alone_on_its_core_faster(calibrated, contrast):
    # Rank 0 has core 0 to itself, ranks 1 and 2 share core 1: at the largest size of each curve rank 0 should
    # run near 2x. The sizes are tiny (CI time), so one curve's last point can be off on a loaded machine (seen
    # once: the causal curve at 1.16x while the other two showed the gap): two of the three curves must show
    # 1.2x over both sharing ranks, and none may show rank 0 slower.
    devs = calibrated[0]["devices"]
    ratios = {key: min(devs[0][key][-1][1] / devs[r][key][-1][1] for r in (1, 2))
              for key in ("gemm_tflops", "attn_tflops", "attn_causal_tflops")}
    assert sum(x > 1.2 for x in ratios.values()) >= 2 and min(ratios.values()) > 1.0, (ratios, devs)
    # unequal devices of one node keep their own curves
    assert calibrated[0]["calibration"]["uniform_nodes"] == []


def test_calibrated_yaml_plans_like_the_cluster(calibrated, tmp_path):
    c = hexiseq.Cluster.from_dict(calibrated[0])
    path = tmp_path / "cluster.yaml"
    c.to_yaml(path)
    back = hexiseq.Cluster.from_file(path)
    assert back == c
    model = hexiseq.Model(**cw.TINY)
    for strategy in ("hexiseq", "ring", "usp"):
        a = hexiseq.plan(c, model=model, seq_len=4097, strategy=strategy)
        b = hexiseq.plan(back, model=model, seq_len=4097, strategy=strategy)
        assert a.fingerprint == b.fingerprint and a.step_time_s == b.step_time_s
    # the runtime's own work was timed, so the model charges it: every device of a plan, and measure's "rest"
    from hexiseq.hardware.measurement import predicted_layer

    assert all(x > 0 for x in a.devices.runtime_s), a.devices.runtime_s
    rest = [v["rest"] for v in predicted_layer(a, "attention")[0].values()]
    assert len(rest) == 3 and all(x > 0 for x in rest), rest
    # and the command line reads it unchanged
    cfg = _tiny_hf_config(tmp_path)
    r = subprocess.run([sys.executable, "-m", "hexiseq", "plan", str(path), "--model", str(cfg), "--seq-len", "8k"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not TWO_CORES, reason="needs cores 0 and 1 to pin ranks")
def test_plan_on_calibrated_cluster_gives_the_fast_rank_more(calibrated, contrast):
    c = hexiseq.Cluster.from_dict(calibrated[0])
    p = hexiseq.plan(c, model=hexiseq.Model(**cw.TINY), seq_len=8192, strategy="hexiseq",
                     training=hexiseq.Training(checkpointing=False))
    dev = p.devices
    work = {int(d): int(t) * max(1, int(h)) for d, t, h in zip(dev["device"], dev["tokens"], dev["head_count"])}
    assert work[0] > work[1] and work[0] > work[2], p.layout.groups()


def _tiny_hf_config(folder):
    cfg = folder / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
                               "vocab_size": 512}))
    return cfg


def _plan_json():
    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "CPU-test", "count": 2, "intra_gbps": 2.0, "memory_gib": 4.0,
                                              "peak_tflops": 0.05, "gemm_eff": 0.8, "attn_eff": 0.5}]})
    model = hexiseq.Model(**cw.TINY)
    layout = {"groups": [{"devices": [0, 1], "seq": 301, "tokens": [200, 101], "heads": [3, 1]}]}
    return hexiseq.evaluate(c, model=model, seq_len=301, layout=layout,
                            training=hexiseq.Training(checkpointing=False)).to_json()


def test_measure_reports_every_phase_with_its_prediction(tmp_path):
    plan_json = _plan_json()
    out = dist_worker.spawn(cw.measure_plan, 2, (plan_json, ["attention", "llama"]), tmp_path, timeout_s=120)
    for r, (status, value) in out.items():
        assert status == "ok", f"rank {r}: {value}"
    assert out[0][1] == out[1][1]
    from hexiseq import Measurement

    for layer, m in out[0][1].items():
        assert m["layer"] == layer and m["dtype"] == "float32" and m["iters"] == 2
        assert m["step_s"] > 0 and m["predicted_step_s"] > 0 and math.isfinite(m["ratio"])
        assert len(m["step_samples_s"]) == 2 and m["step_s"] <= max(m["step_samples_s"])
        for r in m["ranks"]:
            meas, pred = r["measured"], r["predicted"]
            assert set(meas) == set(pred) == {"attn", "a2a", "ring", "sync", "rest"}
            assert all(v >= 0 for v in meas.values()) and all(v >= 0 for v in pred.values())
            assert meas["attn"] + meas["a2a"] + meas["ring"] + meas["sync"] <= r["total_s"] * 1.0001
            assert meas["sync"] > 0 and pred["sync"] == 0  # every call checks in; the model charges no waiting
            assert meas["attn"] > 0 and pred["attn"] > 0 and meas["a2a"] > 0 and pred["a2a"] > 0
            # the whole layer has token-parallel matmuls the model predicts; the attention layer alone has none
            assert (pred["rest"] > 0) == (layer == "llama")
        assert [r["tokens"] for r in m["ranks"]] == [200, 101] and [r["heads"] for r in m["ranks"]] == [3, 1]
        d = dict(m)
        d.pop("ratio")
        again = Measurement(**d)
        assert json.loads(again.to_json()) == json.loads(json.dumps(m))
        assert "measured/predicted" in again.table()


def test_bad_arguments_name_the_field():
    from hexiseq import calibrate
    from hexiseq import measure

    plan = hexiseq.Plan.from_json(_plan_json())
    with pytest.raises(hexiseq.InvalidArgumentError, match="layer"):
        measure(plan, layer="mlp")
    with pytest.raises(hexiseq.InvalidArgumentError, match="iters"):
        measure(plan, iters=0)
    with pytest.raises(hexiseq.InvalidArgumentError, match="dtype_bytes=4"):
        measure(plan, dtype="bf16")
    with pytest.raises(hexiseq.InvalidArgumentError, match="plan must be"):
        measure("plan.json")
    with pytest.raises(hexiseq.InvalidArgumentError, match="gemm_rows"):
        calibrate("8b", gemm_rows=[512, 64])
    with pytest.raises(hexiseq.InvalidArgumentError, match="attn_blocks"):
        calibrate("8b", attn_blocks="1024")
    with pytest.raises(hexiseq.InvalidArgumentError, match="tolerance"):
        calibrate("8b", tolerance=2)
    with pytest.raises(hexiseq.InvalidArgumentError, match="unknown model preset"):
        calibrate("9b")
    if not dist.is_initialized():
        with pytest.raises(hexiseq.HexiseqError, match="init_process_group"):
            calibrate("8b")
        with pytest.raises(hexiseq.HexiseqError, match="init_process_group"):
            measure(plan)


def test_measure_defaults_to_the_dtype_the_cluster_was_calibrated_in():
    """measure's dtype, when not given: the calibration record's when it has the model's dtype_bytes (fp16 stays
    fp16), else the model's own, which is calibrate's default."""
    from hexiseq.hardware.harness import model_dtype
    from hexiseq.hardware.measurement import dtype_for

    cpu = torch.device("cpu")
    assert model_dtype(hexiseq.Model.from_name_or_path("llama3-8b"), cpu) == torch.bfloat16
    assert model_dtype(hexiseq.Model(**cw.TINY), cpu) == torch.float32  # dtype_bytes=4
    node = {"gpu": "CPU-test", "count": 1, "memory_gib": 4.0, "peak_tflops": 0.05, "gemm_eff": 0.8, "attn_eff": 0.5}

    def plan_on(calibration, dtype_bytes):
        c = hexiseq.Cluster.from_dict({"nodes": [node], **({"calibration": calibration} if calibration else {})})
        return hexiseq.plan(c, model=hexiseq.Model(**dict(cw.TINY, dtype_bytes=dtype_bytes)), seq_len=256,
                            training=hexiseq.Training(checkpointing=False))

    assert dtype_for(plan_on({"dtype": "float16"}, 2), None) == torch.float16
    assert dtype_for(plan_on({"dtype": "bfloat16"}, 2), None) == torch.bfloat16
    assert dtype_for(plan_on(None, 2), None) == torch.bfloat16
    assert dtype_for(plan_on({"dtype": "float32"}, 4), None) == torch.float32
    # a record in another width than the plan's model: the model's dtype (measure then warns of the difference)
    assert dtype_for(plan_on({"dtype": "float32"}, 2), None) == torch.bfloat16
    assert dtype_for(plan_on({"dtype": "float16"}, 2), "bf16") == torch.bfloat16  # a given dtype wins


def test_cli_calibrate_then_plan_then_measure(tmp_path):
    """One process, no torchrun: the commands make a world of one."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cfg = _tiny_hf_config(tmp_path)
    out = tmp_path / "cluster.yaml"
    r = subprocess.run([sys.executable, "-m", "hexiseq", "calibrate", "--model", str(cfg), "--out", str(out),
                        "--gemm-rows", "32,128", "--attn-blocks", "32,128", "--iters", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "hexiseq calibrate: " in r.stderr and "s elapsed" in r.stderr  # progress lines
    assert "calibrated 1 devices" in r.stdout or "calibrated 1 device" in r.stdout, r.stdout
    c = hexiseq.Cluster.from_file(out)
    assert c.num_devices == 1 and c.calibration["world"] == 1
    # the config names no dtype: the model's 2 bytes, so bf16 on CPU too, the dtype measure then runs in
    assert c.calibration["dtype"] == "bfloat16"
    r = subprocess.run([sys.executable, "-m", "hexiseq", "plan", str(out), "--model", str(cfg), "--seq-len", "512",
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(r.stdout)
    r = subprocess.run([sys.executable, "-m", "hexiseq", "measure", str(plan_path), "--iters", "1", "--warmup", "0",
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["step_s"] > 0 and m["predicted_step_s"] > 0 and len(m["ranks"]) == 1
    assert m["dtype"] == "bfloat16" and "calibrated in" not in r.stderr, r.stderr  # the loop's defaults agree
    r = subprocess.run([sys.executable, "-m", "hexiseq", "measure", str(tmp_path / "missing.json")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "missing.json" in r.stderr


def test_a_world_subgroup_after_a_partial_one(tmp_path):
    """Plans measured one after another on the world: a plan whose HP group holds some ranks, then one whose HP
    group holds all of them. Locally synchronised subgroups took their names from a per-process count that the
    first plan left unequal across ranks, and the second plan's rendezvous hung."""
    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300}]})
    model = hexiseq.Model(**cw.TINY)
    partial = hexiseq.evaluate(c, model=model, seq_len=64, layout={"groups": [
        {"devices": [0, 1], "seq": 40, "tokens": [20, 20], "heads": [3, 1]},
        {"devices": [2], "seq": 24, "tokens": [24], "heads": [4]}]})
    whole = hexiseq.evaluate(c, model=model, seq_len=64, layout={"groups": [
        {"devices": [0, 1, 2], "seq": 64, "tokens": [22, 21, 21], "heads": [2, 1, 1]}]})
    out = dist_worker.spawn(cw.contexts_in_sequence, 3, ([partial.to_json(), whole.to_json()],), tmp_path,
                            timeout_s=60)
    assert all(v == ("ok", 2) for v in out.values()), out


# (scenario, the class every rank raises, words its message must hold)
ARGUMENTS = [
    ("cal_blocks", "RankMismatchError", ["attn_blocks", "rank 0: [32]", "rank 1: [32, 64]", "rank 2: [32]"]),
    ("cal_rows", "RankMismatchError", ["gemm_rows", "rank 0: [16, 32]", "rank 1: [16]"]),
    ("cal_model", "RankMismatchError", ["about model", "rank 1: Model(layers=2, hidden=128, heads=4,",
                                        "rank 2: Model(layers=2, hidden=128, heads=8,"]),
    ("cal_dtype", "RankMismatchError", ["dtype", "rank 0: 'torch.float32'", "rank 2: 'torch.float64'"]),
    ("cal_iters", "RankMismatchError", ["iters", "rank 0: 1", "rank 1: 2"]),
    ("cal_message_bytes", "RankMismatchError", ["message_bytes", "rank 0: 8192", "rank 1: 4096"]),
    ("cal_invalid", "InvalidArgumentError", ["1 of 3 ranks", "rank 2: iters must be an int >= 1, got 0"]),
    ("cal_unknown_model", "InvalidArgumentError", ["1 of 3 ranks", "rank 1: ", "unknown model preset"]),
    ("measure_iters", "RankMismatchError", ["iters", "rank 0: 1", "rank 1: 2"]),
    ("measure_layer", "RankMismatchError", ["layer", "rank 0: 'llama'", "rank 1: 'attention'"]),
    ("measure_documents", "RankMismatchError", ["documents", "rank 1: None", "rank 2: [32, 32]"]),
    ("measure_invalid", "InvalidArgumentError", ["1 of 3 ranks", "rank 0: layer must be 'attention' or 'llama', "
                                                                "got 'mlp'"]),
]


@pytest.fixture(scope="module")
def argument_reports(tmp_path_factory):
    """One spawn of 3 ranks (group timeout 5 s) runs every scenario of ARGUMENTS in turn, then a good measure."""
    c = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 3, "intra_gbps": 300}]})
    plan = hexiseq.evaluate(c, model=hexiseq.Model(**cw.TINY), seq_len=64, layout={"groups": [
        {"devices": [0, 1], "seq": 40, "tokens": [20, 20], "heads": [3, 1]},
        {"devices": [2], "seq": 24, "tokens": [24], "heads": [4]}]})
    out = dist_worker.spawn(cw.argument_scenarios, 3, (plan.to_json(),), tmp_path_factory.mktemp("args"),
                            timeout_s=90)
    for rank, (status, report) in sorted(out.items()):
        assert status == "ok", f"rank {rank}: {report}"
    return {rank: report for rank, (_, report) in out.items()}


@pytest.mark.parametrize("name,cls,words", ARGUMENTS, ids=[a[0] for a in ARGUMENTS])
def test_arguments_that_differ_or_fail_on_one_rank_raise_on_every_rank(argument_reports, name, cls, words):
    """calibrate and measure compare every argument before anything runs: ranks that pass different ones, or an
    invalid one on one rank only, raise the same error on every rank at once, naming the argument and each
    rank's value, instead of a Gloo timeout or a mismatch of plan fingerprints the user never passed."""
    same_error_on_every_rank(argument_reports, name, cls, words)


def test_ranks_stay_in_step_after_refused_arguments(argument_reports):
    for rank, report in sorted(argument_reports.items()):
        assert report["good_after"][0] == "ok", (rank, report["good_after"])
