"""Every bad input raises a subclass of hexiseq.HexiseqError whose message names the field and the value."""

import json
import math
import re

import pytest

import hexiseq
from hexiseq import Cluster, HexiseqError, InvalidArgumentError, MemoryFitError, Model, Node, Plan, Training
from hexiseq.errors import LayoutError, UnknownGPUError
from hexiseq._validate import parse_tokens

from errcheck import raises_with

GOOD_NODE = {"gpu": "H100-SXM", "count": 2, "intra_gbps": 450}


def _two_nodes(**override):
    node = {**GOOD_NODE, **override}
    return {"nodes": [dict(GOOD_NODE), node], "inter_node_gbps": 25}


# ------------------------------------------------------------------ GPU names

def test_unknown_gpu_lists_known_models():
    msg = raises_with(UnknownGPUError, lambda: Cluster.from_dict({"nodes": [{**GOOD_NODE, "gpu": "H999"}]}),
                  "nodes[0].gpu", "H999")
    for known in ("H100-SXM", "A100-80G", "L40S", "RTX4090", "V100"):
        assert known in msg
    raises_with(UnknownGPUError, lambda: Cluster([Node("B300", 1, 1.0)]), "B300")


def test_gpu_name_not_a_string():
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [{**GOOD_NODE, "gpu": 100}]}), "gpu", "100")


# ------------------------------------------------------------------ counts and bandwidths

BAD_COUNTS = [0, -1, -8, 1.5, float("nan"), "8", None, True, [2]]
BAD_BANDWIDTHS = [0, -1, -0.5, float("nan"), float("inf"), "450", None, True, False]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_bad_count(value):
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict(_two_nodes(count=value)), "nodes[1].count", repr(value)
            if not isinstance(value, int) or isinstance(value, bool) else value)


@pytest.mark.parametrize("value", BAD_BANDWIDTHS, ids=repr)
def test_bad_intra_bandwidth(value):
    msg = raises_with(InvalidArgumentError, lambda: Cluster.from_dict(_two_nodes(intra_gbps=value)), "nodes[1].intra_gbps")
    assert _value_text(value) in msg, msg


@pytest.mark.parametrize("value", BAD_BANDWIDTHS, ids=repr)
def test_bad_inter_bandwidth(value):
    spec = _two_nodes()
    spec["inter_node_gbps"] = value
    msg = raises_with(InvalidArgumentError, lambda: Cluster.from_dict(spec), "inter_node_gbps")
    assert _value_text(value) in msg, msg


@pytest.mark.parametrize("field", ["memory_gib", "peak_tflops", "gemm_eff", "attn_eff"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "x", True], ids=repr)
def test_bad_override(field, value):
    msg = raises_with(InvalidArgumentError, lambda: Cluster.from_dict(_two_nodes(**{field: value})), f"nodes[1].{field}")
    assert _value_text(value) in msg, msg


@pytest.mark.parametrize("field", ["gemm_eff", "attn_eff"])
def test_efficiency_above_one(field):
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict(_two_nodes(**{field: 1.5})), f"nodes[1].{field}", "1.5")


def _value_text(value):
    """How a bad value appears in a message: the repr, or for numbers the number itself."""
    if isinstance(value, (bool, str)) or value is None:
        return repr(value)
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return repr(value)
    return str(value)


@pytest.mark.parametrize("value", [0, -2, float("nan"), float("inf")], ids=repr)
def test_bad_bandwidth_matrix_entry(value):
    bw = [[0, 100], [100, 0]]
    bw[1][0] = value
    raises_with(InvalidArgumentError, lambda: Cluster([Node("H100", 2, 450)], 25, bandwidth_gbps=bw),
            "bandwidth_gbps[1][0]")


def test_bandwidth_matrix_of_wrong_size():
    # 2 devices, 3 x 3 matrix
    bw = [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    raises_with(InvalidArgumentError, lambda: Cluster([Node("H100", 2, 450)], 25, bandwidth_gbps=bw),
            "bandwidth_gbps", "2 x 2")


def test_bandwidth_matrix_not_numbers():
    raises_with(InvalidArgumentError, lambda: Cluster([Node("H100", 2, 450)], 25, bandwidth_gbps=[["a", "b"], [1, 0]]),
            "bandwidth_gbps")
    raises_with(InvalidArgumentError, lambda: Cluster([Node("H100", 2, 450)], 25, bandwidth_gbps=[1, 2]),
            "bandwidth_gbps")


# ------------------------------------------------------------------ YAML files

YAML_CASES = [
    ("count: 0", "nodes[1].count", "0"),
    ("count: -4", "nodes[1].count", "-4"),
    ("count: eight", "nodes[1].count", "'eight'"),
    ("count: .nan", "nodes[1].count", "nan"),
    ("count: ~", "nodes[1].count", "None"),
    ("count: true", "nodes[1].count", "True"),
    ("intra_gbps: 0", "nodes[1].intra_gbps", "0"),
    ("intra_gbps: -300", "nodes[1].intra_gbps", "-300"),
    ("intra_gbps: .nan", "nodes[1].intra_gbps", "nan"),
    ("intra_gbps: .inf", "nodes[1].intra_gbps", "inf"),
    ("intra_gbps: fast", "nodes[1].intra_gbps", "'fast'"),
    ("intra_gbps: ~", "nodes[1].intra_gbps", "None"),
]


@pytest.mark.parametrize("line,field,value", YAML_CASES)
def test_bad_yaml_values(tmp_path, line, field, value):
    key, val = line.split(": ")
    text = ("nodes:\n  - {gpu: H100-SXM, count: 8, intra_gbps: 450}\n"
            f"  - gpu: A100-80G\n    count: 8\n    intra_gbps: 300\ninter_node_gbps: 25\n")
    text = text.replace(f"    {key}: {'8' if key == 'count' else '300'}\n", f"    {key}: {val}\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(path), field, value)


def test_bad_yaml_inter_node_and_gpu(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("nodes:\n  - {gpu: H100, count: 8, intra_gbps: 450}\n  - {gpu: A100, count: 8, intra_gbps: 300}\n"
                    "inter_node_gbps: -25\n")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(path), "inter_node_gbps", "-25")
    path.write_text("nodes:\n  - {gpu: Z80, count: 8, intra_gbps: 450}\n")
    raises_with(UnknownGPUError, lambda: Cluster.from_file(path), "nodes[0].gpu", "Z80")


def test_unreadable_and_malformed_files(tmp_path):
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(tmp_path / "missing.yaml"), "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [ {gpu: H100\n")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(bad), "bad.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{nodes: }")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(bad), "bad.json")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(scalar), "mapping")


# ------------------------------------------------------------------ missing and unknown fields

def test_missing_fields():
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({}), "nodes")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [{"count": 2, "intra_gbps": 1}]}), "nodes[0].gpu")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [{"gpu": "H100", "intra_gbps": 1}]}),
            "nodes[0].count")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [{"gpu": "H100", "count": 2}]}),
            "nodes[0].intra_gbps")
    spec = _two_nodes()
    del spec["inter_node_gbps"]
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict(spec), "inter_node_gbps")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": []}), "nodes")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": "H100"}), "nodes")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict([GOOD_NODE]), "mapping")


def test_unknown_fields():
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [{**GOOD_NODE, "colour": "red"}]}), "colour")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict({"nodes": [GOOD_NODE], "gpus": 4}), "gpus")
    raises_with(InvalidArgumentError, lambda: Model.from_dict({**Model.preset("7b").to_dict(), "experts": 8}), "experts")
    raises_with(InvalidArgumentError, lambda: hexiseq.Training.from_dict({"sequences": 1, "micro_batch": 4}),
            "micro_batch")


# ------------------------------------------------------------------ sequence lengths

@pytest.mark.parametrize("value", [0, -1, -131072, "0", "-5", "abc", "", "12q", "1.5", "nan", "inf", None, True, 1.5,
                                   2 ** 31, 2 ** 70, float("nan")], ids=repr)
def test_bad_seq_len(value):
    msg = raises_with(InvalidArgumentError, lambda: hexiseq.plan(Cluster.example(), seq_len=value, strategy="ring"),
                  "seq_len")
    if not isinstance(value, int) or isinstance(value, bool):
        assert repr(value) in msg or str(value) in msg, msg


# ------------------------------------------------------------------ models

def test_heads_not_divisible_by_kv_heads():
    raises_with(InvalidArgumentError, lambda: Model(32, 4096, 32, 5, 128, 11008, 32000), "kv_heads", "5", "32")
    raises_with(InvalidArgumentError, lambda: Model(32, 4096, 8, 16, 128, 11008, 32000), "kv_heads", "16")


@pytest.mark.parametrize("field", ["layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"])
@pytest.mark.parametrize("value", [0, -3, "x", None, 2.5], ids=repr)
def test_bad_model_fields(field, value):
    d = Model.preset("7b").to_dict()
    d[field] = value
    raises_with(InvalidArgumentError, lambda: Model.from_dict(d), f"model.{field}", value if isinstance(value, int)
            else repr(value))


def test_unknown_preset_and_hf_config():
    raises_with(InvalidArgumentError, lambda: Model.preset("gpt-5"), "gpt-5", "llama3-8b")
    raises_with(InvalidArgumentError, lambda: hexiseq.plan(Cluster.example(), model="175b"), "175b")
    raises_with(InvalidArgumentError, lambda: Model.from_hf_config({"hidden_size": 512}), "num_hidden_layers")


# ------------------------------------------------------------------ memory

def test_nothing_fits():
    cluster = {"nodes": [{"gpu": "RTX3090", "count": 2, "intra_gbps": 32}]}
    msg = raises_with(MemoryFitError, lambda: hexiseq.plan(cluster, model="llama3-70b", seq_len="1m"), "device", "GiB")
    assert "RTX3090" in msg
    for strategy in ("ring", "ulysses", "usp"):
        raises_with(MemoryFitError, lambda: hexiseq.plan(cluster, model="70b", seq_len="1m", strategy=strategy),
                "device", "GiB", strategy)


MIXED = {"nodes": [{"gpu": "H100-SXM", "count": 8, "intra_gbps": 450}, {"gpu": "A100-80G", "count": 8, "intra_gbps": 300},
                   {"gpu": "L40S", "count": 4, "intra_gbps": 32, "attn_eff": 0.45}], "inter_node_gbps": 25}


def test_memory_error_says_the_states_do_not_fit():
    """70B on 20 devices with 45 GiB L40S: under full sharding with even shares each device holds 1/20 of the
    states, more than an L40S has, so no length fits; the error says so as text and as fields, with the states
    per device."""
    with pytest.raises(MemoryFitError) as info:
        hexiseq.plan(MIXED, model="70b", seq_len="128k", training=Training(checkpointing=True, state_shares="even"))
    err, e = info.value, str(info.value)
    for needle in ("model states alone take", "device 16 (L40S, 45.0 GiB)", "no sequence fits"):
        assert needle in e, (needle, e)
    assert err.states_fit is False and err.longest_seq_len == 0 and err.longest_seq_len_checkpointing == 0
    assert len(err.states_gib) == 20 and len(set(err.states_gib)) == 1 and err.states_gib[0] > 45.0
    assert f"{err.states_gib[0]:.1f} GiB per device" in e


def test_states_shared_by_memory_fit_where_even_shares_do_not():
    """The same 70B, 20 devices, 64k tokens: even shares overflow the L40S, so auto shares the states by memory
    (each device in proportion to what it has beside the unsharded part) and the plan fits and says so. Where
    even the states shared by memory do not fit (70B on four L40S), the error says that."""
    training = Training(checkpointing=True)
    with pytest.raises(MemoryFitError, match="L40S"):
        hexiseq.plan(MIXED, model="70b", seq_len="64k", training=Training(checkpointing=True, state_shares="even"))
    p = hexiseq.plan(MIXED, model="70b", seq_len="64k", training=training)
    assert p.fits and p.training.state_shares == "memory" and training.state_shares == "auto"
    shares = p.state_shares
    assert abs(shares.sum() - 1.0) < 1e-12 and shares.min() > 0
    gpus = p.cluster.device_gpus
    small, big = shares[gpus == "L40S"], shares[gpus != "L40S"]
    assert len(set(small.tolist())) == 1 and small[0] < 1 / 20 < big.min()  # 80 GB H100s hold a hair less: 79.6 GiB
    assert "shared by memory" in p.explain() and "hexiseq.shard_states" in p.explain()
    assert hexiseq.Plan.from_json(p.to_json()).state_shares.tolist() == shares.tolist()
    # a plan that fits with even shares keeps them, and its file is what it was (no state_shares field)
    even = hexiseq.plan(MIXED, model="8b", seq_len="64k", training=training)
    assert even.training.state_shares == "even" and "state_shares" not in even.to_json()
    assert even.state_shares.tolist() == [1 / 20] * 20
    with pytest.raises(MemoryFitError) as info:
        hexiseq.plan({"nodes": [{"gpu": "L40S", "count": 4, "intra_gbps": 32}], "inter_node_gbps": 25}, model="70b",
                     seq_len="8k", training=training)
    assert "shared by memory" in str(info.value) and "no sequence fits" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="training.state_shares must be one of"):
        Training(state_shares="uneven")


@pytest.mark.parametrize("features", ["none", "auto"])
def test_memory_error_gives_the_longest_sequence_that_fits(features):
    """llama3-8b at 4M tokens (16M with the memory features, which fit 4M with checkpointing): the error names the
    longest length that fits, with and without checkpointing, and both are true: a plan of that length fits, 1024
    tokens more does not. The same holds for one strategy."""
    cluster = Cluster.from_dict(MIXED)
    seq_len = 4 * 1048576 if features == "none" else 16 * 1048576
    for strategy in ("auto", "ring"):
        with pytest.raises(MemoryFitError) as info:
            hexiseq.plan(cluster, model="8b", seq_len=seq_len, strategy=strategy,
                         training=Training(memory_features=features))
        err, msg = info.value, str(info.value)
        assert "the longest sequence that fits is" in msg, msg
        assert ("with the memory features where a device needs them" in msg) == (features == "auto"), msg
        assert err.states_fit is True and all(0 < s < 45 for s in err.states_gib)
        assert 0 < err.longest_seq_len < err.longest_seq_len_checkpointing < seq_len, msg
        for length, ckpt in ((err.longest_seq_len, False), (err.longest_seq_len_checkpointing, True)):
            training = Training(checkpointing=ckpt, memory_features=features)
            assert hexiseq.plan(cluster, model="8b", seq_len=length, strategy=strategy, training=training).fits
            with pytest.raises(MemoryFitError):
                hexiseq.plan(cluster, model="8b", seq_len=length + 1024, strategy=strategy, training=training)


def test_a_shorter_sequence_fits_where_a_longer_one_does():
    """Whether a length fits is monotone in the length. Llama-3-70B without memory features on 64 GPUs of six
    models, where the A100-40G and the devices holding the attention heads are short of memory: 127,744 tokens fit,
    and so does every shorter length tried, planned afresh and as that plan re-balanced. The token shares were
    rounded to granules of 64 tokens without looking at memory, and a granule rounded onto a device whose memory
    binds left the layout short by 0.1-0.4 GiB: 108,582 tokens were refused while 127,744 fitted."""
    gpus = ["H100-SXM", "A100-80G", "A800", "L40S", "H800", "A100-40G"]
    cluster = Cluster.from_dict({"nodes": [{"gpu": gpus[i % 6], "count": 8, "intra_gbps": 300} for i in range(8)],
                                 "inter_node_gbps": 25})
    training = Training(memory_features="none")
    longest = hexiseq.plan(cluster, model="llama3-70b", seq_len=127744, training=training)
    assert longest.fits
    for length in (108582, 121356, 114969, 100000, 64000):
        p = hexiseq.plan(cluster, model="llama3-70b", seq_len=length, training=training)
        q = longest.rebalanced(seq_len=length)
        for plan in (p, q):
            assert plan.fits and plan.seq_len == length
            assert (plan.devices.mem_total_gib <= plan.devices.mem_cap_gib).all()


def test_rebalanced_to_a_length_that_does_not_fit():
    """Plan.rebalanced to a sequence too long for memory raises what plan() raises for it, MemoryFitError naming
    the short device with what would fit, instead of returning a plan that does not fit; a custom layout too."""
    base = hexiseq.plan(Cluster.example(), seq_len="16k")
    with pytest.raises(MemoryFitError):
        hexiseq.plan(Cluster.example(), seq_len=2**30)
    for plan, seq_len in ((base, 2**30), (_evaluate(_layout()), "2m")):
        with pytest.raises(MemoryFitError) as info:
            plan.rebalanced(seq_len=seq_len)
        err, msg = info.value, str(info.value)
        for needle in ("no plan fits", f"rebalanced to seq_len {parse_tokens(seq_len)}", "is short by", "GiB",
                       "the longest sequence that fits is"):
            assert needle in msg, (needle, msg)
        assert re.search(r"device \d+ \((H100-SXM|A100-80G), \d+\.\d GiB\)", msg), msg
        assert err.states_fit is True and 0 < err.longest_seq_len < parse_tokens(seq_len)


@pytest.mark.parametrize("value,needle", [(1, "seq_len must be >= 2"), (0, "seq_len must be >= 1"),
                                          (2**30 + 1, "seq_len must be <= 1073741824"), (-3, "seq_len must be >= 1"),
                                          (True, "seq_len must be an integer"), (1.5, "seq_len must be an integer"),
                                          ("abc", "seq_len must be a token count")], ids=repr)
def test_rebalanced_seq_len_bounds(value, needle):
    """A seq_len out of bounds is refused by name and value, not by a layout error about groups never written: at
    least one token for each of the plan's groups, at most 2^30."""
    msg = raises_with(InvalidArgumentError, lambda: _evaluate(_layout()).rebalanced(seq_len=value), needle,
                      repr(value) if isinstance(value, (bool, float, str)) else str(value))
    assert "groups[" not in msg, msg


# ------------------------------------------------------------------ layouts

def _layout(**change):
    groups = [{"devices": list(range(8)), "seq": 65536, "tokens": [8192] * 8, "heads": [4] * 8},
              {"devices": list(range(8, 16)), "seq": 65536, "tokens": [8192] * 8, "heads": [4] * 8}]
    for key, value in change.items():
        g, field = key.split("_", 1)
        groups[int(g[1:])][field] = value
    return {"groups": groups}


def _evaluate(layout, seq_len=131072):
    return hexiseq.evaluate(Cluster.example(), model="7b", seq_len=seq_len, layout=layout)


def test_valid_layout_baseline():
    assert _evaluate(_layout()).num_groups == 2


def test_layout_shares_that_do_not_sum():
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_tokens=[8192] * 7 + [8000])), "groups[1]", "65344")
    raises_with(LayoutError, lambda: _evaluate(_layout(g0_seq=65535)), "seq_len=131072", "131071")
    raises_with(LayoutError, lambda: _evaluate(_layout(), seq_len=131073), "131073")
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_heads=[4] * 7 + [3])), "groups[1]", "31")
    raises_with(LayoutError, lambda: _evaluate(_layout(g0_tokens=[-8192, 24576] + [8192] * 6)), "tokens", "-8192")
    raises_with(LayoutError, lambda: _evaluate(_layout(g0_tokens=[8192] * 7)), "groups[0].tokens")


def test_layout_overlapping_heads():
    ranges = [[0, 4], [2, 8]] + [[4 * i, 4 * i + 4] for i in range(2, 8)]
    raises_with(LayoutError, lambda: _evaluate({"groups": [
        {"devices": list(range(8)), "seq": 65536, "tokens": [8192] * 8, "head_ranges": ranges},
        _layout()["groups"][1]]}), "head ranges in groups[0]", "device 1")
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_heads=[4] * 7 + [-4])), "head")


def test_layout_device_twice_or_missing():
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_devices=[0] + list(range(9, 16)))), "device 0", "twice")
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_devices=[16] + list(range(9, 16)))), "device 16")
    raises_with(LayoutError, lambda: _evaluate(_layout(g1_devices=list(range(9, 16)), g1_tokens=[8192] * 6 + [16384],
                                                   g1_heads=[4] * 6 + [8])), "16", "15")


def test_layout_malformed():
    raises_with(LayoutError, lambda: _evaluate({"groups": []}), "groups")
    raises_with(LayoutError, lambda: _evaluate({"groups": [{"devices": [0]}]}), "groups[0].seq")
    raises_with(LayoutError, lambda: _evaluate({"rings": 3}), "groups")
    raises_with(LayoutError, lambda: _evaluate({"groups": [{"devices": list(range(16)), "seq": 131072,
                                                        "tokens": [8192] * 16}]}), "heads")


# ------------------------------------------------------------------ strategies and plans

def test_unknown_strategy():
    raises_with(InvalidArgumentError, lambda: hexiseq.plan(Cluster.example(), strategy="zigzag"), "strategy", "zigzag")
    raises_with(InvalidArgumentError, lambda: hexiseq.plan(Cluster.example(), strategy=None), "strategy", "None")


def test_ulysses_unsupported():
    c = Cluster([Node("H100", 3, 450)])
    raises_with(hexiseq.errors.UnsupportedError, lambda: hexiseq.plan(c, model="7b", seq_len=4096, strategy="ulysses"),
            "heads", "32", "3")


@pytest.mark.parametrize("text", ["junk", "", "[]", "{}", "null", "42", '{"format": "hexiseq-plan"}',
                                  '{"format": "other"}'])
def test_plan_from_json_junk(text):
    with pytest.raises(HexiseqError):
        Plan.from_json(text)


def test_plan_from_json_not_text():
    with pytest.raises(HexiseqError):
        Plan.from_json(None)


@pytest.mark.parametrize("field,value", [("seq_len", "abc"), ("seq_len", None), ("causal", "maybe"),
                                         ("stopped_early", "yes"), ("stopped_early", 1), ("stopped_early", None),
                                         ("training", {"micro_batch": 4}), ("training", None),
                                         ("model", {"layers": 2}), ("cluster", {"nodes": 5}),
                                         ("layout", {"groups": [{"devices": "x"}]})])
def test_plan_from_json_bad_fields(field, value):
    doc = json.loads(hexiseq.plan(Cluster.example(), seq_len="32k", strategy="usp").to_json())
    doc[field] = value
    with pytest.raises(HexiseqError):
        Plan.from_json(json.dumps(doc))
