"""The plans the distributed tests execute (tests/test_distributed.py) and whose geometry tests/test_topology.py
checks without processes: needs hexiseq only, not torch."""

import hexiseq


def cluster(*counts, gpus=("H100-SXM", "A100-80G", "L40S")):
    nodes = [{"gpu": gpus[i % len(gpus)], "count": c, "intra_gbps": 300.0} for i, c in enumerate(counts)]
    return hexiseq.Cluster.from_dict({"nodes": nodes, "inter_node_gbps": 25.0})


def tiny_model(heads, kv_heads, head_dim=8):
    return hexiseq.Model(layers=2, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         ffn=64, vocab=100)


def layout_plan(counts, model, seq, groups, causal=True):
    return hexiseq.evaluate(cluster(*counts), model=model, seq_len=seq, layout={"groups": groups}, causal=causal)


CASES = {
    # one group of 4 (Ulysses-like), GQA 12:4, a prime sequence length
    "one-group-gqa": lambda: hexiseq.plan(cluster(2, 2), model=tiny_model(12, 4), seq_len=97, strategy="usp"),
    # one rank alone: its attention is one block pair, whose results the runtime takes as they come
    "one-rank": lambda: layout_plan((1,), tiny_model(6, 2), 67, [
        {"devices": [0], "seq": 67, "tokens": [67], "heads": [6]}]),
    # unequal groups, a rank with one token, a rank with no heads, a kv head split between two ranks,
    # members not in device order
    "asymmetric": lambda: layout_plan((2, 2), tiny_model(12, 4), 97, [
        {"devices": [0, 2, 1], "seq": 61, "tokens": [30, 1, 30], "heads": [5, 0, 7]},
        {"devices": [3], "seq": 36, "tokens": [36], "heads": [12]}]),
    # pure ring of three unequal blocks, MQA, full attention
    "ring-mqa-noncausal": lambda: layout_plan((1, 1, 1), tiny_model(6, 1), 97, [
        {"devices": [0], "seq": 40, "tokens": [40], "heads": [6]},
        {"devices": [1], "seq": 7, "tokens": [7], "heads": [6]},
        {"devices": [2], "seq": 50, "tokens": [50], "heads": [6]}], causal=False),
    # GQA 4:1 over groups of 2, 1, 2; unaligned head ranges; a rank with 0 heads; 5 processes
    "gqa4-three-groups": lambda: layout_plan((2, 1, 2), tiny_model(8, 2), 101, [
        {"devices": [0, 1], "seq": 50, "tokens": [1, 49], "heads": [3, 5]},
        {"devices": [2], "seq": 10, "tokens": [10], "heads": [8]},
        {"devices": [3, 4], "seq": 41, "tokens": [20, 21], "heads": [8, 0]}]),
    # the scheduler's own plan on 6 heterogeneous devices, heads and length that divide nothing
    # the scheduler's own plan on 6 heterogeneous devices (at this length it parks four of them: ranks with
    # no tokens and no heads), heads and length that divide nothing
    "scheduler-6": lambda: hexiseq.plan(cluster(2, 2, 2), model=tiny_model(10, 2, 128), seq_len=1031,
                                        strategy="hexiseq"),
    # two groups, 7 heads (MHA), 2 processes, full attention
    "two-groups-7-heads": lambda: layout_plan((1, 1), tiny_model(7, 7), 33, [
        {"devices": [1], "seq": 20, "tokens": [20], "heads": [7]},
        {"devices": [0], "seq": 13, "tokens": [13], "heads": [7]}], causal=False),
}
