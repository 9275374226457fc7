"""Plans for packed documents: the documents argument of plan/evaluate/compare, the chunking of a layout, the
re-balancing of a plan per batch, and what explain() says. The pair counts themselves are checked against a brute
force in the C tests (tests/c/test_documents.c); here the Python surface and its errors."""

import json

import numpy as np
import pytest

import hexiseq
from hexiseq import Cluster, InvalidArgumentError, Layout, Plan, Training
from hexiseq.errors import LayoutError

S = 65536
TRAIN = Training(checkpointing=True)


@pytest.fixture(scope="module")
def mixed():
    return Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 4, "intra_gbps": 450},
                                        {"gpu": "L40S", "count": 4, "intra_gbps": 32}], "inter_node_gbps": 25})


def short_docs(seed=0, total=S):
    rng = np.random.default_rng(seed)
    out, left = [], total
    while left:
        n = min(left, int(rng.integers(200, 3000)))
        out.append(n)
        left -= n
    return out


def test_documents_plan_beats_the_one_document_plan_under_the_same_batch(mixed):
    docs = short_docs()
    one = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="hexiseq")
    aware = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="hexiseq", documents=docs)
    assert one.documents is None and one.layout.chunking == "zigzag"
    assert aware.documents.tolist() == docs and aware.layout.chunking in Layout.CHUNKINGS
    under = hexiseq.evaluate(mixed, model="llama3-8b", seq_len=S, training=TRAIN, layout=one.layout, documents=docs)
    assert aware.step_time_s <= under.step_time_s * (1 + 1e-9)
    assert under.step_time_s < one.step_time_s  # far fewer visible pairs
    assert aware.lower_bound_s < one.lower_bound_s
    text = aware.explain()
    assert f"{len(docs):,} packed" in text and "priced as one causal document" in text
    assert f"{aware.layout.chunking} chunks" in text


def test_one_document_is_the_plain_causal_plan(mixed):
    plain = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="hexiseq")
    one = hexiseq.evaluate(mixed, model="llama3-8b", seq_len=S, training=TRAIN, layout=plain.layout, documents=[S])
    assert one.step_time_s == plain.step_time_s
    assert np.array_equal(one.devices.attn_s, plain.devices.attn_s)


def test_contiguous_chunking_positions_and_json(mixed):
    groups = [{"devices": [0, 1, 2, 3], "seq": 40000, "tokens": [10000] * 4, "heads": [8] * 4},
              {"devices": [4, 5, 6, 7], "seq": S - 40000, "tokens": [(S - 40000) // 4] * 4, "heads": [8] * 4}]
    lay = Layout.from_dict({"groups": groups, "chunking": "contiguous"})
    p = hexiseq.evaluate(mixed, model="llama3-8b", seq_len=S, training=TRAIN, layout=lay, documents=short_docs(1))
    assert p.group_chunks(0) == [(0, 40000)] and p.group_chunks(1) == [(40000, S - 40000)]
    assert np.array_equal(np.concatenate([p.positions(r) for r in range(8)]), np.arange(S))
    back = Plan.from_json(p.to_json())
    assert back.layout == p.layout and back.layout.chunking == "contiguous"
    assert back.documents.tolist() == p.documents.tolist() and back.step_time_s == p.step_time_s
    zig = hexiseq.evaluate(mixed, model="llama3-8b", seq_len=S, training=TRAIN, layout=Layout.from_groups(groups))
    assert "chunking" not in json.loads(zig.to_json())["layout"]  # zigzag plans keep their old fingerprints
    assert zig.fingerprint != p.fingerprint
    with pytest.raises(LayoutError, match="chunking"):
        Layout.from_dict({"groups": groups, "chunking": "spiral"})


def test_rebalanced_keeps_the_structure_and_never_predicts_worse(mixed):
    base = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="hexiseq")
    assert base.num_groups > 1
    for seed in range(3):
        docs = short_docs(seed + 10)
        re = base.rebalanced(docs)
        kept = hexiseq.evaluate(mixed, model="llama3-8b", seq_len=S, training=TRAIN, layout=base.layout,
                                documents=docs)
        assert re.documents.tolist() == docs
        for col in ("group_size", "device", "head_lo", "head_count"):
            assert np.array_equal(getattr(re.layout, col), getattr(base.layout, col)), col
        assert re.step_time_s <= kept.step_time_s
    longer = base.rebalanced(None, seq_len="96k")
    assert longer.seq_len == 98304 and int(longer.layout.group_seq.sum()) == 98304


@pytest.mark.parametrize("docs, match", [
    ([S - 1], r"documents must add up to seq_len=65536, they add up to 65535"),
    ([S, 0], r"documents\[1\] must be in \[1, "),
    ([1.5, S - 1.5], r"documents\[0\] must be an integer, got 1.5"),
    ("65536", r"documents must be a list of integers"),
    ([], r"documents must hold at least one length"),
])
def test_bad_documents_name_the_field(mixed, docs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, documents=docs)


def test_documents_need_causal(mixed):
    with pytest.raises(InvalidArgumentError, match="documents need causal attention"):
        hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, causal=False, documents=[S])
    base = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="ring")
    with pytest.raises(InvalidArgumentError, match="add up to seq_len=65536"):
        base.rebalanced([100])


def test_measure_prices_and_checks_documents(mixed):
    from hexiseq.hardware.measurement import predicted_layer

    p = hexiseq.plan(mixed, model="llama3-8b", seq_len=S, training=TRAIN, strategy="ring")
    _, plain = predicted_layer(p)
    _, packed = predicted_layer(p, documents=short_docs(3))
    assert packed < plain
    with pytest.raises(InvalidArgumentError, match="documents must add up to seq_len=65536"):
        hexiseq.measure(p, documents=[5])  # checked before anything distributed
