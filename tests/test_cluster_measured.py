"""Clusters that carry measurements: per-device rate curves, a latency matrix, GPU models outside the catalog,
a calibration record; their YAML round trip and what the planner makes of them."""

import json
import math
import random

import numpy as np
import pytest
import yaml

import hexiseq
from hexiseq import Cluster, Node, Plan, Training
from hexiseq.planner import DeviceRates
from hexiseq.errors import InvalidArgumentError, UnknownGPUError


def _flat(tflops, lo=128, hi=131072):
    return [[lo, tflops], [hi, tflops]]


def _measured():
    """Two nodes: 2 H100 with measured curves (device 1 a little slower), 2 of a model the catalog lacks,
    described by the node; awkward floats everywhere so the round trip has something to get wrong."""
    devices = [
        {"memory_gib": 79.1, "gemm_tflops": [[256, 401.3], [1024, 612.0000000000001], [16384, 0.1 + 0.2 + 700]],
         "attn_tflops": [[512, 1 / 3 * 900], [8192, 355.5]], "attn_causal_tflops": [[512, 150.25], [8192, 301.0]],
         "attn_document_tflops": [[64, 20.5], [2048, 1 / 3 * 600]], "runtime_ns": [[81920, 0.75], [1e7, 0.1 + 0.2]],
         "runtime_a2a_ns": [[4096, 2.5]], "runtime_ring_ns": [[512, 7.0], [65536, 1.25]],
         "mem_bound_gbps": 1 / 3 * 4000},
        {"gemm_tflops": [[256, 390.0], [16384, 650.123456789]], "attn_tflops": [[512, 280.0], [8192, 340.0]]},
        None,
        {"memory_gib": 150.0},
    ]
    lat = [[0, 3.5, 21.25, 22], [3.25, 0, 19.5, 1e-3], [20, 20, 0, 4.75], [1 / 7, 20.5, 5.0, 0]]
    calibration = {"model": "tiny", "dtype": "bfloat16", "when": "2025-01-02T03:04:05", "world": 4,
                   "notes": ["a", 1, 2.5, True, None], "nested": {"k": [1, {"x": 0.1}]}}
    return Cluster([Node("H100-SXM", 2, 450.0), Node("XPU-900", 2, 400.0, memory_gib=192.0, peak_tflops=1307.4,
                                                     gemm_eff=0.55, attn_eff=0.4)],
                   inter_node_gbps=37.5, latency_us=lat, devices=devices, calibration=calibration)


def test_yaml_round_trip_is_exact(tmp_path):
    c = _measured()
    path = tmp_path / "cluster.yaml"
    text = c.to_yaml(path)
    assert path.read_text() == text
    back = Cluster.from_file(path)
    assert back == c
    assert back.to_dict() == c.to_dict()
    assert back.calibration == c.calibration and back.calibration["nested"]["k"][1]["x"] == 0.1
    assert yaml.safe_load(text) == c.to_dict()
    for strategy in ("hexiseq", "ring", "usp"):
        a = hexiseq.plan(c, model="7b", seq_len="32k", strategy=strategy)
        b = hexiseq.plan(back, model="7b", seq_len="32k", strategy=strategy)
        assert a.fingerprint == b.fingerprint and a.step_time_s == b.step_time_s, strategy
        assert a.layout == b.layout
    # and a plan's JSON carries it exactly too
    p = hexiseq.plan(c, model="7b", seq_len="32k")
    q = Plan.from_json(p.to_json())
    assert q.cluster == c and q.fingerprint == p.fingerprint and q.step_time_s == p.step_time_s
    # to_yaml without a path only returns the text
    assert Cluster.from_dict(yaml.safe_load(_measured().to_yaml())) == c


def test_yaml_floats_round_trip_exactly(tmp_path):
    rng = random.Random(7)
    values = [rng.uniform(1e-9, 1e9) for _ in range(40)] + [0.1, 1 / 3, 1e-7, 1e16, 123456789.123, 5e-324 * 1e300]
    sizes = sorted(rng.sample(range(1, 1 << 20), 16))
    devices = [{"gemm_tflops": [[s, v] for s, v in zip(sizes, values[:16])],
                "attn_tflops": [[s, v] for s, v in zip(sizes, values[16:32])]},
               {"memory_gib": values[40], "attn_causal_tflops": [[1.5, values[41]], [1e6, values[42]]]}]
    c = Cluster([Node("A100-80G", 2, 300.0)], 1.0, latency_us=values[43], devices=devices,
                calibration={"v": values[44:]})
    back = Cluster.from_file(_write(tmp_path, c))
    assert back == c
    assert back.devices[0].gemm_tflops == c.devices[0].gemm_tflops
    assert back.latency_us == values[43] and back.calibration["v"] == values[44:]


def _write(tmp_path, c):
    path = tmp_path / "c.yml"
    c.to_yaml(str(path))
    return path


def test_to_dict_writes_only_what_is_set():
    d = Cluster.example().to_dict()
    assert set(d) == {"nodes", "inter_node_gbps"}
    c = Cluster([Node("H100", 2, 450.0)], latency_us=5, devices=[None, {"memory_gib": 60}])
    d = c.to_dict()
    assert d["latency_us"] == 5.0 and d["devices"] == [None, {"memory_gib": 60.0}] and "calibration" not in d
    # descriptions that say nothing are no descriptions
    assert Cluster([Node("H100", 2, 450.0)], devices=[None, {}]).devices is None
    assert Cluster([Node("H100", 2, 450.0)], devices=[None, {}]) == Cluster([Node("H100", 2, 450.0)])


def test_equality_covers_every_field():
    base = dict(nodes=[Node("H100", 2, 450.0)], inter_node_gbps=25.0)
    c = Cluster(**base)
    others = [Cluster(**base, latency_us=10.0), Cluster(**base, latency_us=[[0, 10], [10, 0]]),
              Cluster(**base, devices=[{"gemm_tflops": _flat(500)}, None]),
              Cluster(**base, devices=[{"memory_gib": 70.0}, None]), Cluster(**base, calibration={"world": 2})]
    for i, o in enumerate(others):
        assert o != c, i
        assert o == Cluster.from_dict(o.to_dict()), i
        for j, p in enumerate(others):
            assert (i == j) == (o == p), (i, j)
    assert Cluster(**base, calibration={"world": 2}) != Cluster(**base, calibration={"world": 3})


def test_describe_and_device_rates():
    c = _measured()
    assert "measured rates on 2 of them" in c.describe()
    assert "XPU-900" in c.describe()
    assert Cluster([Node("H100", 2, 450.0)], devices=[{"gemm_tflops": _flat(500)}] * 2).describe().endswith(
        "measured rates")
    assert "measured" not in Cluster.example().describe()
    assert "measured" not in Cluster([Node("H100", 2, 450.0)], devices=[{"memory_gib": 60}, None]).describe()
    r = c.devices[0]
    assert isinstance(r, DeviceRates) and r.measured and r.memory_gib == 79.1
    assert r.attn_tflops == ((512.0, 300.0), (8192.0, 355.5))
    assert c.devices[2] is None and not c.devices[3].measured
    # DeviceRates objects are accepted as they are
    again = Cluster(list(c.nodes), c.inter_node_gbps, latency_us=c.latency_us, devices=list(c.devices),
                    calibration=c.calibration)
    assert again == c
    # the device's memory replaces the node's
    p = hexiseq.plan(c, model="7b", seq_len="32k")
    cap = dict(zip(p.devices.device.tolist(), p.devices.mem_cap_gib.tolist()))
    assert cap == {0: 79.1, 1: 79.6, 2: 192.0, 3: 150.0}


def _raises(call, *needles):
    with pytest.raises(InvalidArgumentError) as e:
        call()
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_bad_measurements_name_field_and_value():
    n2 = [Node("H100", 2, 450.0)]
    _raises(lambda: Cluster(n2, devices=[None, {"attn_tflops": [[1024, 100], [512, 90]]}]),
            "devices[1].attn_tflops[1]", "512", "1024")
    _raises(lambda: Cluster(n2, devices=[None, {"gemm_tflops": [[1024, 100], [1024, 90]]}]), "devices[1].gemm_tflops[1]")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": [[0, 100]]}, None]), "devices[0].gemm_tflops[0]", "size", "0")
    _raises(lambda: Cluster(n2, devices=[{"attn_causal_tflops": [[64, -3]]}, None]),
            "devices[0].attn_causal_tflops[0]", "-3")
    _raises(lambda: Cluster(n2, devices=[None, {"attn_document_tflops": [[256, 9], [128, 8]]}]),
            "devices[1].attn_document_tflops[1]", "128", "256")
    _raises(lambda: Cluster(n2, devices=[None, {"runtime_ns": [[1000, 0]]}]), "devices[1].runtime_ns[0]", "0")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": [[64, float("nan")]]}, None]), "devices[0].gemm_tflops[0]",
            "nan")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": [[64, "fast"]]}, None]), "devices[0].gemm_tflops[0]", "fast")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": [[64, 1, 2]]}, None]), "devices[0].gemm_tflops[0]", "[64, 1, 2]")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": 500}, None]), "devices[0].gemm_tflops", "500")
    _raises(lambda: Cluster(n2, devices=[{"gemm_tflops": [[2 ** k, 1.0] for k in range(17)]}, None]),
            "devices[0].gemm_tflops", "17 points", "16")
    _raises(lambda: Cluster(n2, devices=[{"memory_gib": -4}, None]), "devices[0].memory_gib", "-4")
    _raises(lambda: Cluster(n2, devices=[None, {"mem_bound_gbps": 0}]), "devices[1].mem_bound_gbps", "0")
    _raises(lambda: Cluster(n2, devices=[None, {"mem_bound_gbps": float("nan")}]), "devices[1].mem_bound_gbps", "nan")
    _raises(lambda: Cluster(n2, devices=[{"memory": 4}, None]), "devices[0]", "memory")
    _raises(lambda: Cluster(n2, devices=[None, "fast"]), "devices[1]", "fast")
    _raises(lambda: Cluster(n2, devices=[None]), "devices", "2", "1")
    _raises(lambda: Cluster(n2, devices={"0": {}}), "devices")
    _raises(lambda: Cluster(n2, latency_us=[[0, 5], [-1, 0]]), "latency_us[1][0]", "-1")
    _raises(lambda: Cluster(n2, latency_us=[[0, float("inf")], [1, 0]]), "latency_us[0][1]", "inf")
    _raises(lambda: Cluster(n2, latency_us=[[0, 5, 5], [5, 0, 5]]), "latency_us", "2 x 2", "(2, 3)")
    _raises(lambda: Cluster(n2, latency_us=-2), "latency_us", "-2")
    _raises(lambda: Cluster(n2, latency_us=True), "latency_us", "True")
    _raises(lambda: Cluster(n2, latency_us="fast"), "latency_us", "fast")
    _raises(lambda: Cluster(n2, calibration=[1, 2]), "calibration", "[1, 2]")
    _raises(lambda: Cluster(n2, calibration={"x": float("nan")}), "calibration.x", "nan")
    _raises(lambda: Cluster(n2, calibration={"x": [1, {"y": object}]}), "calibration.x[1].y")
    _raises(lambda: Cluster(n2, calibration={1: "a"}), "calibration", "1")
    _raises(lambda: Cluster.from_dict({"nodes": [{"gpu": "H100", "count": 2, "intra_gbps": 450}], "latency": 3}),
            "latency", "latency_us", "devices", "calibration")
    # dates (YAML reads an unquoted 2025-06-01 as one) are kept as their ISO text
    c = Cluster.from_dict(yaml.safe_load("nodes: [{gpu: H100, count: 1}]\ncalibration: {when: 2025-06-01}"))
    assert c.calibration == {"when": "2025-06-01"} and Cluster.from_dict(yaml.safe_load(c.to_yaml())) == c
    # the diagonal of a latency matrix is ignored (and written as 0)
    c = Cluster(n2, latency_us=[[float("nan"), 5], [6, -1]])
    assert c.latency_us.tolist() == [[0.0, 5.0], [6.0, 0.0]]


def test_unknown_gpu_fully_described_plans():
    c = Cluster([Node("H100-SXM", 4, 450.0),
                 Node("XPU-900", 4, 400.0, memory_gib=192.0, peak_tflops=1307.4, gemm_eff=0.55, attn_eff=0.4)], 50.0)
    assert c.nodes[1].gpu == "XPU-900" and list(c.device_gpus[4:]) == ["XPU-900"] * 4
    p = hexiseq.plan(c, model="7b", seq_len="64k")
    assert p.fits and "XPU-900" in p.explain() and "XPU-900" in p.devices.gpu.tolist()
    assert Plan.from_json(p.to_json()).fingerprint == p.fingerprint
    # by measured curves and per-device memory only
    dev = {"memory_gib": 64.0, "gemm_tflops": _flat(300.0), "attn_tflops": _flat(200.0)}
    m = Cluster([Node("Gaudi-X", 2, 300.0)], devices=[dev, dev])
    p = hexiseq.plan(m, model="3b", seq_len="16k")
    assert p.fits and list(p.devices.mem_cap_gib) == [64.0, 64.0]
    assert Cluster.from_dict(m.to_dict()) == m
    # not fully described: the error names the node, the model and what to give
    for bad in (lambda: Cluster([Node("XPU-900", 2, 400.0, peak_tflops=1300.0, gemm_eff=0.5, attn_eff=0.4)]),
                lambda: Cluster([Node("XPU-900", 2, 400.0, memory_gib=192.0)]),
                lambda: Cluster([Node("Gaudi-X", 2, 300.0)], devices=[dev, {"memory_gib": 64.0}])):
        with pytest.raises(UnknownGPUError) as e:
            bad()
        msg = str(e.value)
        assert "nodes[0].gpu" in msg and ("XPU-900" in msg or "Gaudi-X" in msg) and "memory_gib" in msg
        assert "H100-SXM" in msg, msg


def test_twice_as_fast_device_gets_twice_the_work():
    """Three devices of one node; device 0's measured rates are twice the others': the plan gives it about
    twice their tokens and heads (or sequence, if it puts devices in groups of their own)."""
    fast = {"gemm_tflops": _flat(600.0), "attn_tflops": _flat(400.0), "attn_causal_tflops": _flat(300.0)}
    slow = {k: [[s, t / 2] for s, t in v] for k, v in fast.items()}
    c = Cluster([Node("H100-SXM", 3, 450.0)], devices=[fast, slow, slow])
    tr = Training(checkpointing=True)
    p = hexiseq.plan(c, model="gpt-7b", seq_len="64k", strategy="hexiseq", training=tr)
    t = p.devices
    by_dev = {int(d): i for i, d in enumerate(t.device)}
    # token-parallel work: tokens; attention work: heads x the group's positions
    group_seq = p.layout.group_seq[t.group]
    tok = np.array([t.tokens[by_dev[d]] for d in range(3)], dtype=float)
    att = np.array([t.head_count[by_dev[d]] * group_seq[by_dev[d]] for d in range(3)], dtype=float)
    for name, w in (("tokens", tok), ("attention", att)):
        assert 1.6 < w[0] / w[1] < 2.4 and 1.6 < w[0] / w[2] < 2.4, (name, w, p.layout.groups())
    # the same cluster without the curves splits evenly
    even = hexiseq.plan(Cluster([Node("H100-SXM", 3, 450.0)]), model="gpt-7b", seq_len="64k", strategy="hexiseq",
                        training=tr)
    assert max(even.devices.tokens) - min(even.devices.tokens) <= 0.1 * max(even.devices.tokens)


def test_latency_makes_longer_rings_cost_more():
    nodes = [Node("H100-SXM", 8, 450.0)]
    ring = {}
    for lat in (0.0, 50.0):
        c = Cluster(nodes, latency_us=lat)
        ring[lat] = hexiseq.plan(c, model="7b", seq_len="32k", strategy="ring")
    # 8 groups: 7 forward and 8 backward ring steps per layer each pay the 50 us sync (transfers hide here)
    extra = ring[50.0].devices.ring_exposed_s - ring[0.0].devices.ring_exposed_s
    assert np.allclose(extra, (7 + 8) * 50e-6 * 32, rtol=1e-9), extra
    assert ring[50.0].step_time_s > ring[0.0].step_time_s


def test_gradient_collectives_in_the_plan():
    c = Cluster([Node("H100-SXM", 4, 450.0)], latency_us=0.0)
    one = Cluster([Node("H100-SXM", 1, 450.0)])
    assert hexiseq.plan(one, model="3b", seq_len="4k").phases["grad_sync_s"] == 0.0
    model = hexiseq.Model.preset("3b")
    P, b, N = model.params, model.dtype_bytes, 4
    A = (N - 1) / N * P * b / 450e9  # one ring reduce-scatter or all-gather of everything, no latency
    expected = {"none": 2 * A, "opt": 2 * A, "grad_opt": 2 * A, "full": 3 * A}
    for sharding, sync in expected.items():
        p = hexiseq.plan(c, model=model, seq_len="16k", strategy="ulysses", training=Training(sharding=sharding))
        ph = p.phases
        assert math.isclose(ph["grad_sync_s"], sync, rel_tol=1e-9), sharding
        assert 0 < ph["grad_exposed_s"] <= ph["grad_sync_s"]
        if sharding == "grad_opt":  # the parameter gather after the step is never hidden
            assert ph["grad_exposed_s"] >= A * (1 - 1e-9)
        assert "gradient sync" in p.explain()
        doc = json.loads(p.to_json())
        assert doc["predicted"]["grad_sync_s"] == ph["grad_sync_s"]


def test_documented_cluster_snippets_plan():
    import os

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "planning.md")).read()
    section = doc.split("## Describing a cluster", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```yaml")[1:]]
    assert len(blocks) == 2
    for text in blocks:
        c = Cluster.from_dict(yaml.safe_load(text))
        assert hexiseq.plan(c, model="7b", seq_len="64k", training=Training(checkpointing=True)).fits
        assert Cluster.from_dict(yaml.safe_load(c.to_yaml())) == c


def test_measure_says_when_it_runs_unlike_the_calibration():
    """measure() warns when its dtype, head dim or heads are not those the cluster was calibrated with (a bf16 run
    on an fp32 calibration came out 1.33x its prediction): the words name each difference."""
    from hexiseq.hardware.measurement import unlike_calibration

    cal = {"dtype": "float32", "head_dim": 64, "attn_heads": 12, "attn_kv_heads": 4}
    cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 300.0}],
                                         "calibration": cal})
    same = hexiseq.Model(layers=1, hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2048, vocab=8, dtype_bytes=4)
    plan = hexiseq.plan(cluster, model=same, seq_len=1024)
    assert unlike_calibration(plan, "torch.float32") == ""
    other = hexiseq.Model(layers=1, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=2048, vocab=8)
    words = unlike_calibration(hexiseq.plan(cluster, model=other, seq_len=1024), "torch.bfloat16")
    assert "in bfloat16 on a cluster calibrated in float32" in words
    assert "head_dim 128 against the calibration's 64" in words and "8/8 heads against the calibration's 12/4" in words
    plain = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 300.0}]})
    assert unlike_calibration(hexiseq.plan(plain, model=other, seq_len=1024), "torch.bfloat16") == ""


def test_without_drops_devices_and_keeps_the_rest():
    """Cluster.without: the survivors keep their nodes, links and measured rates, a node left empty goes, the
    calibration's per-device block backends are cut the same way and the drop is noted; dropping every device or a
    device that does not exist is refused by name and value."""
    c = _measured()
    w = c.without([1, 2])
    assert w.num_devices == 2 and [n.count for n in w.nodes] == [1, 1] and [n.gpu for n in w.nodes] == ["H100-SXM", "XPU-900"]
    assert w.devices[0] == c.devices[0] and w.devices[1] == c.devices[3]
    assert np.array_equal(w.latency_us, np.asarray(c.latency_us)[np.ix_([0, 3], [0, 3])])
    assert w.calibration["dropped_devices"] == [[1, 2]] and w.calibration["model"] == "tiny"
    gone = c.without([0, 1])
    assert [n.gpu for n in gone.nodes] == ["XPU-900"] and gone.num_devices == 2
    cal = Cluster([Node("H100-SXM", 3, 450.0)], calibration={"block_backends": ["a", "b", "c"]}).without([1])
    assert cal.calibration["block_backends"] == ["a", "c"]
    _raises(lambda: c.without([0, 1, 2, 3]), "every device")
    _raises(lambda: c.without([7]), "devices", "7")


def _hosted():
    return Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0, "host": "a"},
                                        {"gpu": "A100-80G", "count": 2, "intra_gbps": 300.0, "host": "b"}],
                              "inter_node_gbps": 25.0, "latency_us": 10.0,
                              "calibration": {"block_backends": ["h0", "h1", "a0", "a1"]}})


def test_hosts_round_trip_and_are_checked(tmp_path):
    """A node's `host` survives to_dict, YAML and from_dict; an empty or non-string one is refused by name; hosts
    do not change a plan's predicted figures, and groups that differ only by host are priced as one kind."""
    c = _hosted()
    assert c.host_devices() == {"a": [0, 1], "b": [2, 3]}
    path = tmp_path / "c.yaml"
    c.to_yaml(str(path))
    again = Cluster.from_file(str(path))
    assert [n.host for n in again.nodes] == ["a", "b"]
    _raises(lambda: Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0, "host": ""}]}),
            "nodes[0].host", "''")
    _raises(lambda: Cluster([Node("H100-SXM", 2, 450.0, host=7)]), "nodes[0].host", "7")
    plain = Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0},
                                         {"gpu": "A100-80G", "count": 2, "intra_gbps": 300.0}],
                               "inter_node_gbps": 25.0, "latency_us": 10.0})
    assert hexiseq.plan(c, model="7b", seq_len=16384).step_time_s == hexiseq.plan(plain, model="7b",
                                                                                    seq_len=16384).step_time_s
    from hexiseq.planner.batch import BatchPlanner
    two = Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0, "host": "a"},
                                       {"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0, "host": "b"}],
                             "inter_node_gbps": 25.0})
    planner = BatchPlanner(two, model="7b")
    assert planner._kind[planner.groups.index((0, 1))] is planner._kind[planner.groups.index((2, 3))]


def test_for_ranks_puts_the_devices_in_rank_order():
    """Cluster.for_ranks: device r of the result is devices[r]; nodes follow their devices, links and the
    calibration's per-device entries too, the devices left out are noted as dropped; a node's devices split apart,
    a repeated device, or one out of range are refused."""
    c = _hosted()
    r = c.for_ranks([2, 3, 1])
    assert [(n.gpu, n.count, n.host) for n in r.nodes] == [("A100-80G", 2, "b"), ("H100-SXM", 1, "a")]
    assert r.calibration["block_backends"] == ["a0", "a1", "h1"] and r.calibration["dropped_devices"] == [[0]]
    same = c.for_ranks([0, 1, 2, 3])
    assert same.to_dict()["nodes"] == c.to_dict()["nodes"] and "dropped_devices" not in same.calibration
    assert c.without([0]).to_dict() == c.for_ranks([1, 2, 3]).to_dict()
    _raises(lambda: c.for_ranks([2, 0, 3]), "node 1", "consecutive")
    _raises(lambda: c.for_ranks([2, 2]), "distinct", "[2, 2]")
    _raises(lambda: c.for_ranks([4]), "devices", "4")


def test_survivors_match_machines_to_devices():
    """hexiseq.elastic's matching (the pure part of survivors, which every rank runs on the same gathered list):
    each rank's (machine, local rank) to the k-th device of the nodes naming that machine, in rank order; every
    refusal names the rank and the value."""
    from hexiseq.integrations.elastic import _match

    c = _hosted()
    cluster, devices = _match(c, [("b", 0), ("b", 1), ("a", 1)])
    assert devices == [2, 3, 1] and [n.host for n in cluster.nodes] == ["b", "a"]
    _raises(lambda: _match(c, [("b", 0), ("c", 0)]), "rank 1", "'c'", "a, b")
    _raises(lambda: _match(c, [("b", 2)]), "rank 0", "local rank 2", "2 device(s)")
    _raises(lambda: _match(c, [("b", 0), ("b", 0)]), "ranks 0 and 1", "device 2")
    _raises(lambda: _match(c, [("b", 0), ("a", 0), ("b", 1)]), "consecutive")
    _raises(lambda: _match(c, [("a", None)]), "rank 0", "LOCAL_RANK")
    nameless = Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 2, "intra_gbps": 450.0}]})
    _raises(lambda: _match(nameless, [("a", 0)]), "names no machines", "host:")
