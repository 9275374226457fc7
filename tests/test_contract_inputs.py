"""Contracts on hostile input: every case of each family ends in the named HexiseqError subclass whose message names
the field and the offending value; never a raw OverflowError, TypeError, IndexError, ZeroDivisionError,
UnicodeDecodeError or RecursionError, and never a silently different result. The CLI cases run `python -m hexiseq`
and expect one `hexiseq: error:` line and no traceback."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import hexiseq
from hexiseq import Cluster, InvalidArgumentError, Model, Node, Plan, Training, _core
from hexiseq.errors import LayoutError, UnsupportedError
from hexiseq.errors import ArgumentTypeError

from errcheck import raises_with

BIG = [2**31, 2**32 + 5, 2**63, 2**70]  # past a C int, past int64


@pytest.fixture(scope="module")
def example():
    return Cluster.example()


@pytest.fixture(scope="module")
def small_plan():
    """A 2-group plan of 4 devices: group chunks, shards and plan files are cut from it."""
    c = Cluster([Node("H100", 2, 450), Node("A100", 2, 300)], 25)
    return hexiseq.evaluate(c, model="7b", seq_len=4096, layout={"groups": [
        {"devices": [0, 1], "seq": 2048, "tokens": [1024, 1024], "heads": [16, 16]},
        {"devices": [2, 3], "seq": 2048, "tokens": [1024, 1024], "heads": [16, 16]}]})


# ------------------------------------------------------------------ 10: a sequence shorter than the cluster

@pytest.mark.parametrize("nodes,seq_len", [([Node("H100", 3, 450)], 2),
                                           ([Node("H100", 2, 450), Node("A100", 3, 300)], 4),
                                           ("example", 1), ("example", 15)])
@pytest.mark.parametrize("strategy", ["auto", "hexiseq", "ring", "usp"])
def test_seq_len_shorter_than_the_cluster(example, nodes, seq_len, strategy):
    """Every strategy refuses by seq_len, naming its value and the least that plans, instead of a LayoutError about
    groups the user never wrote; that least does plan."""
    cluster = example if nodes == "example" else Cluster(nodes, 25)
    n = cluster.num_devices
    msg = raises_with(UnsupportedError, lambda: hexiseq.plan(cluster, seq_len=seq_len, strategy=strategy),
                  f"seq_len {seq_len}", f"seq_len >= {n}")
    assert "groups[" not in msg, msg
    if strategy in ("hexiseq", "ring") and n <= 5:
        assert hexiseq.plan(cluster, seq_len=n, strategy=strategy).layout.tokens.sum() == n


# ------------------------------------------------------------------ 11: integers past a C int

def _model_with(**change):
    return lambda: Model(**{**Model.preset("7b").to_dict(), **change})


def _plan_doc_with(plan, path, value):
    doc = json.loads(plan.to_json())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    doc.pop("fingerprint")
    return lambda: Plan.from_json(json.dumps(doc))


INT_CASES = [
    ("node count", lambda v: lambda: Cluster([Node("H100", v, 450)]), "nodes[0].count", "[1, 65536]"),
    ("node count dict", lambda v: lambda: Cluster.from_dict({"nodes": [{"gpu": "H100", "count": v, "intra_gbps": 1}]}),
     "nodes[0].count", "[1, 65536]"),
    ("layers", lambda v: _model_with(layers=v), "model.layers", "[1, 100000]"),
    ("hidden", lambda v: _model_with(hidden=v), "model.hidden", "[1, 1048576]"),
    ("heads", lambda v: _model_with(heads=v), "model.heads", "[1, 65536]"),
    ("vocab", lambda v: _model_with(vocab=v), "model.vocab", "[1, 67108864]"),
    ("dtype_bytes", lambda v: _model_with(dtype_bytes=v), "model.dtype_bytes", "[1, 8]"),
    ("sliding_window", lambda v: _model_with(sliding_window=v), "model.sliding_window", "2147483647"),
    ("sequences", lambda v: lambda: Training(sequences=v), "training.sequences", "[1, 2147483647]"),
    ("seq_len", lambda v: lambda: hexiseq.plan(Cluster.example(), seq_len=v), "seq_len", "1073741824"),
    ("hf layers", lambda v: lambda: Model.from_hf_config({"num_hidden_layers": v, "hidden_size": 64,
                                                          "num_attention_heads": 4}),
     "num_hidden_layers", "[1, 100000]"),
    ("hf ffn", lambda v: lambda: Model.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64,
                                                       "num_attention_heads": 4, "intermediate_size": v}),
     "intermediate_size", "[1, 16777216]"),
    ("binding", lambda v: lambda: _core.model_params((2, 64, 4, 4, 16, v, 100, 2, 0)), "model.ffn", "[1, 16777216]"),
    ("binding training", lambda v: lambda: _core.evaluate(*Cluster.example()._core_args(),
                                                          Model.preset("7b")._as_core(), (v, 0, 0, 2.0, 0), 4096,
                                                          True, {}),
     "training.sequences", "[1, 2147483647]"),
]


@pytest.mark.parametrize("value", BIG, ids=str)
@pytest.mark.parametrize("name,make,field,allowed", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_integers_past_a_c_int(name, make, field, allowed, value):
    raises_with(InvalidArgumentError, make(value), field, value, allowed)


PLAN_INT_CASES = [
    (("training", "sequences"), InvalidArgumentError, "training.sequences"),
    (("model", "layers"), InvalidArgumentError, "model.layers"),
    (("seq_len",), InvalidArgumentError, "seq_len"),
    (("cluster", "nodes", 0, "count"), InvalidArgumentError, "nodes[0].count"),
    (("layout", "groups", 1, "seq"), LayoutError, "groups[1].seq"),
    (("layout", "groups", 0, "tokens", 1), LayoutError, "groups[0].tokens[1]"),
    (("layout", "groups", 1, "devices", 0), LayoutError, "groups[1].devices[0]"),
    (("layout", "groups", 0, "head_ranges", 1, 1), LayoutError, "groups[0].head_ranges[1][1]"),
]


@pytest.mark.parametrize("value", BIG, ids=str)
@pytest.mark.parametrize("path,exc,field", PLAN_INT_CASES, ids=[c[2] for c in PLAN_INT_CASES])
def test_integers_past_a_c_int_in_plan_files(small_plan, path, exc, field, value):
    raises_with(exc, _plan_doc_with(small_plan, path, value), field, value)


@pytest.mark.parametrize("value", BIG, ids=str)
def test_integers_past_a_c_int_in_yaml_files(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"nodes:\n  - {{gpu: H100, count: 2, intra_gbps: 450}}\n  - {{gpu: A100, count: {value}, "
                    f"intra_gbps: 300}}\ninter_node_gbps: 25\n")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(path), "nodes[1].count", value, "[1, 65536]")


# ------------------------------------------------------------------ 12: raw exceptions of every other kind

def _hf(**change):
    return {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, **change}


HF_CASES = [  # a 0 or a wrong type is refused by the key the config used, never read as "missing"
    ({"num_attention_heads": 0}, "num_attention_heads", "0"),
    ({"n_head": 0, "num_attention_heads": None}, "n_head", "0"),
    ({"hidden_size": 0}, "hidden_size", "0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "0"),
    ({"head_dim": 0}, "head_dim", "0"),
    ({"vocab_size": 0}, "vocab_size", "0"),
    ({"intermediate_size": 0}, "intermediate_size", "0"),
    ({"num_attention_heads": 2.5}, "num_attention_heads", "2.5"),
    ({"hidden_size": [64]}, "hidden_size", "[64]"),
    ({"num_attention_heads": "four"}, "num_attention_heads", "'four'"),
    ({"hidden_size": 2, "num_attention_heads": 4}, "head_dim", "hidden_size (2)"),
    ({"sliding_window": "wide"}, "sliding_window", "'wide'"),
    ({"sliding_window": 8, "use_sliding_window": False, "layer_types": 5}, "layer_types", "5"),
    ({"sliding_window": 8, "use_sliding_window": "no"}, "use_sliding_window", "'no'"),
]


@pytest.mark.parametrize("change,field,value", HF_CASES, ids=[c[1] + "=" + c[2] for c in HF_CASES])
def test_hf_config_values(change, field, value):
    raises_with(InvalidArgumentError, lambda: Model.from_hf_config(_hf(**change)), field, value)


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


NUL_GPU = "H100\x00-SXM"  # a C string would end at the NUL


def _nodes(count, gpu="H100"):
    return json.dumps({"nodes": [{"gpu": gpu, "count": 1, "intra_gbps": 450}] * count, "inter_node_gbps": 25})


def test_gpu_name_with_a_nul(tmp_path):
    """Refused by name, not a raw ValueError from the extension (nor read as another name), from Python and files."""
    raises_with(InvalidArgumentError, lambda: Cluster([Node(NUL_GPU, 8, 450.0)]), "nodes[0].gpu", repr(NUL_GPU))
    raises_with(InvalidArgumentError, lambda: Cluster([Node("A100", 2, 300), Node("H100\x00", 8, 450.0)], 25),
                "nodes[1].gpu", "NUL")
    for name, text in (("c.yaml", 'nodes:\n  - {gpu: "H100\\0-SXM", count: 8, intra_gbps: 450}\n'),
                       ("c.json", _nodes(2, NUL_GPU))):
        raises_with(InvalidArgumentError, lambda: Cluster.from_file(_write(tmp_path, name, text)), "nodes[0].gpu",
                    repr(NUL_GPU))


def test_more_nodes_than_the_core_holds(tmp_path):
    """70,000 nodes: refused with the core's limit (every node holds a device), not a raw ValueError."""
    most = _core.int_range("devices")[1]
    nodes = [Node("H100", 1, 450)] * 70000
    raises_with(InvalidArgumentError, lambda: Cluster(nodes, 25), "nodes", "70000", f"at most {most}")
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(_write(tmp_path, "c.json", _nodes(70000))),
                "nodes", "70000", f"at most {most}")


@pytest.mark.parametrize("path", [None, 3, 2.5, ["c.yaml"], {"nodes": []}], ids=repr)
def test_cluster_file_path_of_another_type(path):
    raises_with(ArgumentTypeError, lambda: Cluster.from_file(path), "path", type(path).__name__, repr(path))


def test_cluster_file_paths_as_bytes_or_with_a_nul(tmp_path):
    """Paths as open() takes them (str, bytes, os.PathLike) read the same file; a NUL in one is refused by name."""
    path = _write(tmp_path, "c.json", _nodes(2))
    assert Cluster.from_file(os.fsencode(path)) == Cluster.from_file(str(path)) == Cluster.from_file(path)
    raises_with(InvalidArgumentError, lambda: Cluster.from_file(str(path) + "\x00.yaml"), "c.json", "NUL")


FILE_READERS = {
    "cluster.yaml": lambda p: Cluster.from_file(p),
    "cluster.json": lambda p: Cluster.from_file(p),
    "config.json": lambda p: Model.from_hf_config(p),
    "plan.json": lambda p: Plan.from_json(p.read_bytes()),
}
DEEP = {".yaml": "[" * 20000 + "]" * 20000, ".json": "[" * 100000 + "]" * 100000}
DEEPISH = {".yaml": "nodes: [{gpu: H100, count: 1}]\ncalibration: " + "[" * 200 + "]" * 200,
           ".json": '{"nodes": [{"gpu": "H100", "count": 1}], "calibration": ' + "[" * 200 + "]" * 200 + "}"}


FILE_CASES = [(name, kind) for kind in ("non-utf8", "deep") for name in FILE_READERS] + [
    ("cluster.yaml", "deep-in-calibration"), ("cluster.json", "deep-in-calibration")]


@pytest.mark.parametrize("name,kind", FILE_CASES)
def test_files_undecodable_or_nested_too_deeply(tmp_path, name, kind):
    """Non-UTF-8 bytes name the file and the byte; nesting past what the readers recurse through names the file."""
    ext = os.path.splitext(name)[1]
    if kind == "non-utf8":
        path = _write(tmp_path, name, b'{"nodes": "\xff\xfe"}')
        needles = ("UTF-8", "byte 11") if name != "plan.json" else ("UTF-8",)
    elif kind == "deep":
        path = _write(tmp_path, name, DEEP[ext])
        needles = ("nested too deeply",)
    else:
        path = _write(tmp_path, name, DEEPISH[ext])
        needles = ("calibration", "nested too deeply")
    if name != "plan.json":
        needles += (name,)
    raises_with(InvalidArgumentError, lambda: FILE_READERS[name](path), *needles)


def _layout_case(**change):
    groups = [{"devices": [0, 1], "seq": 2048, "tokens": [1024, 1024], "heads": [16, 16]},
              {"devices": [2, 3], "seq": 2048, "tokens": [1024, 1024], "heads": [16, 16]}]
    for key, value in change.items():
        g, field = key.split("_", 1)
        groups[int(g[1:])][field] = value
    return {"groups": groups}


LAYOUT_TYPE_CASES = [
    ({"g0_devices": 5}, "groups[0].devices", "5"),
    ({"g1_tokens": None}, "groups[1].tokens", "None"),
    ({"g1_tokens": "1024"}, "groups[1].tokens", "'1024'"),
    ({"g0_heads": None}, "groups[0].heads", "None"),
    ({"g0_heads": {"a": 16}}, "groups[0].heads", "{'a': 16}"),
    ({"g1_head_ranges": [1, 2]}, "groups[1].head_ranges[0]", "1"),
    ({"g1_head_ranges": 7}, "groups[1].head_ranges", "7"),
    ({"g0_seq": [2048]}, "groups[0].seq", "[2048]"),
    ({"g0_seq": "2048"}, "groups[0].seq", "'2048'"),
    ({"g0_devices": [0, "one"]}, "groups[0].devices[1]", "'one'"),
]


@pytest.mark.parametrize("change,field,value", LAYOUT_TYPE_CASES, ids=[c[1] + "=" + c[2] for c in LAYOUT_TYPE_CASES])
def test_layout_fields_of_the_wrong_type(small_plan, change, field, value):
    layout = _layout_case(**change)
    raises_with(LayoutError, lambda: hexiseq.evaluate(small_plan.cluster, model="7b", seq_len=4096, layout=layout),
            field, value)


@pytest.mark.parametrize("call,field,value", [
    (lambda p, x: p.shard(x, 5, 0), "dim", "5"),
    (lambda p, x: p.shard(x, -3, 0), "dim", "-3"),
    (lambda p, x: p.shard(x, "0", 0), "dim", "'0'"),
    (lambda p, x: p.shard(x.tolist(), 0, 0), "x", "list"),
    (lambda p, x: p.unshard([p.shard(x, 0, r) for r in range(4)], 1), "dim", "1"),
    (lambda p, x: p.group_chunks(5), "group", "5"),
    (lambda p, x: p.group_chunks(2), "group", "2"),
    (lambda p, x: p.group_chunks(-1), "group", "-1"),
    (lambda p, x: p.group_chunks(True), "group", "True"),
    (lambda p, x: p.group_positions(-2), "group", "-2"),
], ids=["shard dim 5", "shard dim -3", "shard dim str", "shard list", "unshard dim 1", "chunks 5", "chunks 2",
        "chunks -1", "chunks True", "positions -2"])
def test_indices_out_of_range(small_plan, call, field, value):
    x = np.arange(4096)
    raises_with(InvalidArgumentError, lambda: call(small_plan, x), field, value)
    assert small_plan.group_chunks(1) == [(1024, 1024), (2048, 1024)]  # the valid neighbours still answer


# ------------------------------------------------------------------ 13: values truncated or sizes not checked

FLOAT_LAYOUTS = [
    ({"group_size": [4], "group_seq": [4096.9], "device": [0, 1, 2, 3], "tokens": [1024] * 4,
      "head_lo": [0, 8, 16, 24], "head_count": [8] * 4}, "layout.group_seq[0]", "4096.9"),
    ({"group_size": [4], "group_seq": [4096], "device": [0, 1, 2, 3], "tokens": [1024, 1024, 1024, 1024.5],
      "head_lo": [0, 8, 16, 24], "head_count": [8] * 4}, "layout.tokens[3]", "1024.5"),
    ({"group_size": [4], "group_seq": [4096], "device": [0, 1.5, 2, 3], "tokens": [1024] * 4,
      "head_lo": [0, 8, 16, 24], "head_count": [8] * 4}, "layout.device[1]", "1.5"),
    ({"group_size": [4], "group_seq": [4096], "device": [0, 1, 2, 3], "tokens": [1024] * 4,
      "head_lo": [0, 8, 16, 24], "head_count": np.array([8, 8, 8, 8.25])}, "layout.head_count[3]", "8.25"),
    (_layout_case(g0_seq=2048.5), "groups[0].seq", "2048.5"),
    (_layout_case(g1_tokens=[1024, 1023.9]), "groups[1].tokens[1]", "1023.9"),
    (_layout_case(g1_heads=[16.5, 15.5]), "groups[1].heads[0]", "16.5"),
    (_layout_case(g0_seq=float("nan")), "groups[0].seq", "nan"),
]


@pytest.mark.parametrize("layout,field,value", FLOAT_LAYOUTS, ids=[c[1] for c in FLOAT_LAYOUTS])
def test_layout_values_not_integral(small_plan, layout, field, value):
    raises_with(LayoutError, lambda: hexiseq.evaluate(small_plan.cluster, model="7b", seq_len=4096, layout=layout),
            field, value)


@pytest.mark.parametrize("rank,change", [(0, -1), (3, +1), (2, -1024), (1, +5)])
@pytest.mark.parametrize("dim", [0, 1, -2])
def test_unshard_checks_every_shard_size(small_plan, rank, change, dim):
    """A shard of the wrong length along dim is refused by rank, with the size the plan wants and the size given;
    the right shards give back the input exactly."""
    full = np.arange(4096 * 3).reshape(4096, 3) if dim in (0, -2) else np.arange(2 * 4096).reshape(2, 4096)
    axis = dim
    shards = [small_plan.shard(full, axis, r) for r in range(4)]
    np.testing.assert_array_equal(small_plan.unshard(shards, axis), full)
    bad = list(shards)
    if change < 0:
        bad[rank] = np.take(bad[rank], np.arange(bad[rank].shape[axis] + change), axis=axis)
    else:
        pad = np.zeros_like(np.take(bad[rank], np.arange(change), axis=axis))
        bad[rank] = np.concatenate([bad[rank], pad], axis=axis)
    want = int(small_plan.layout.tokens[rank])
    raises_with(InvalidArgumentError, lambda: small_plan.unshard(bad, axis), f"shards[{rank}]", f"rank {rank}",
            f"{want} tokens", f"got {want + change}")


# ------------------------------------------------------------------ 14: plan files of another version; strict JSON

@pytest.mark.parametrize("version", [0, 2, 99, "1", 1.5, None, True])
def test_plan_format_version(small_plan, version):
    doc = json.loads(small_plan.to_json())
    doc["format_version"] = version
    raises_with(InvalidArgumentError, lambda: Plan.from_json(json.dumps(doc)), "format_version", repr(version),
            "format_version 1")
    del doc["format_version"]
    raises_with(InvalidArgumentError, lambda: Plan.from_json(json.dumps(doc)), "format_version", "None")


def _strict(text):
    """json.loads that refuses NaN, Infinity and -Infinity, as strict JSON parsers do."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("entry", [(0, 0), (1, 1), (2, 2)])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=repr)
def test_bandwidth_diagonal_must_be_finite(entry, value):
    bw = np.full((3, 3), 100.0)
    np.fill_diagonal(bw, 0.0)
    bw[entry] = value
    raises_with(InvalidArgumentError, lambda: Cluster([Node("H100", 3, 450)], 25, bandwidth_gbps=bw),
            f"bandwidth_gbps[{entry[0]}][{entry[1]}]", repr(value))
    np.fill_diagonal(bw, 7.0)  # any finite diagonal is accepted, carried, and written as strict JSON
    plan = hexiseq.plan(Cluster([Node("H100", 3, 450)], 25, bandwidth_gbps=bw), seq_len=4096, strategy="ring")
    doc = _strict(plan.to_json())
    assert doc["cluster"]["bandwidth_gbps"][1][1] == 7.0
    assert Plan.from_json(plan.to_json()).fingerprint == plan.fingerprint


def test_strict_json_helper_refuses_nan():
    """The check the strict-JSON contracts rely on does refuse what json.dumps writes by default."""
    with pytest.raises(ValueError, match="NaN"):
        _strict(json.dumps({"x": float("nan")}))


# ------------------------------------------------------------------ paths where a model is taken

def test_model_config_paths(tmp_path, example):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(_hf(num_hidden_layers=4, hidden_size=512, num_attention_heads=8)))
    m = Model.from_hf_config(str(cfg))
    assert (m.layers, m.hidden, m.heads, m.head_dim) == (4, 512, 8, 64)
    assert Model.from_hf_config(cfg) == m
    assert hexiseq.plan(example, model=str(cfg), seq_len=4096).model == m
    assert hexiseq.plan(example, model=cfg, seq_len=4096).model == m
    raises_with(InvalidArgumentError, lambda: Model.from_dict(str(cfg)), "cfg.json", "from_hf_config")
    raises_with(InvalidArgumentError, lambda: Cluster.from_dict("cluster.yaml"), "cluster.yaml", "from_file")


# ------------------------------------------------------------------ 16: the CLI

def _cli(*args, stdout=subprocess.PIPE, cwd=None, close_stdout=False):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    close = (lambda: os.close(1)) if close_stdout else None  # in the child only, before it runs
    return subprocess.run([sys.executable, "-m", "hexiseq", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=60, env=env, cwd=cwd, preexec_fn=close)


def _one_error_line(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hexiseq: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


CLI_CASES = [
    ("yaml count", "c.yaml", "nodes:\n  - {gpu: H100, count: 2147483648, intra_gbps: 450}\n", [],
     ["nodes[0].count", "2147483648"]),
    ("absurd hf config", "cfg.json", json.dumps(_hf(num_hidden_layers=10**40, num_attention_heads=0)),
     ["--model"], ["num_hidden_layers", str(10**40)]),
    ("zero heads", "cfg.json", json.dumps(_hf(num_attention_heads=0)), ["--model"], ["num_attention_heads", "0"]),
    ("non-utf8 yaml", "c.yaml", b"nodes: [{gpu: H100, count: 2, intra_gbps: 450}]\n# \xff\n", [],
     ["c.yaml", "UTF-8"]),
    ("non-utf8 config", "cfg.json", b'{"x": "\xc3\x28"}', ["--model"], ["cfg.json", "UTF-8"]),
    ("deep config", "cfg.json", "[" * 100000 + "]" * 100000, ["--model"], ["cfg.json", "nested too deeply"]),
    ("sequences flag", None, None, ["--sequences", str(2**31)], ["training.sequences", str(2**31)]),
    ("short seq_len", None, None, ["--seq-len", "8"], ["seq_len 8", "seq_len >= 16"]),
    ("nul gpu yaml", "c.yaml", 'nodes:\n  - {gpu: "H100\\0-SXM", count: 2, intra_gbps: 450}\n', [],
     ["nodes[0].gpu", repr(NUL_GPU)]),
    ("nul gpu json", "c.json", _nodes(2, NUL_GPU), [], ["nodes[0].gpu", repr(NUL_GPU)]),
    ("70000 nodes", "c.json", _nodes(70000), [], ["nodes", "70000", f"at most {_core.int_range('devices')[1]}"]),
]


@pytest.mark.parametrize("name,file,content,flags,needles", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_errors_are_one_line(tmp_path, name, file, content, flags, needles):
    args = ["plan"]
    if file:
        _write(tmp_path, file, content)
        args += [] if flags == ["--model"] else [file]
    args += flags + ([file] if flags == ["--model"] else [])
    _one_error_line(_cli(*args, cwd=tmp_path), *needles)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["plan", "--seq-len", "32k"], ["plan", "--seq-len", "32k", "--json"], ["gpus"]])
def test_cli_full_disk(args):
    with open("/dev/full", "w") as full:
        r = _cli(*args, stdout=full)
    _one_error_line(r, "cannot write the output", "No space left on device")


@pytest.mark.parametrize("args", [["plan", "--seq-len", "32k"], ["gpus"]])
def test_cli_stdout_closed(args):
    """Started with no standard output at all (hexiseq plan >&-): one error line, no traceback."""
    r = _cli(*args, stdout=None, close_stdout=True)
    _one_error_line(r, "cannot write the output", "standard output is closed")


@pytest.mark.parametrize("lines", [1, 0])
def test_cli_closed_pipe(lines):
    """A reader that goes away early (hexiseq plan | head -1), or before reading anything (| head -0), ends the
    command quietly."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    p = subprocess.Popen([sys.executable, "-m", "hexiseq", "plan", "--seq-len", "32k"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    for _ in range(lines):
        p.stdout.readline()
    p.stdout.close()  # the rest of the output goes to a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and err == "", err


def test_cli_plan_json_is_strict():
    r = _cli("plan", "--seq-len", "32k", "--json")
    assert r.returncode == 0, r.stderr
    doc = _strict(r.stdout)
    assert all(math.isfinite(v) for v in doc["predicted"].values())
