"""Batch plans at scale, predicted: a step's sequences of unequal lengths on mixed clusters, next to the ways a step
is run today, all scored by the same cost model (every step time here is a PREDICTION; the solve times are
measured on this machine).

For each cluster (64, 128 and 1,024 GPUs of mixed models, 8 per node, 25 GB/s between nodes) and each length
distribution (shapes of the kind published for real corpora: a pretraining long tail, a long-context mix, short
fine-tuning samples), one batch is drawn and planned by:

  batch plan       hexiseq.BatchPlanner: groups cut from the candidate tree, sequences assigned, each group's
                   packed pass scored exactly (step_time_s)
  equal devices    the same planner told that every device is an H100 (what a planner for identical GPUs, FlexSP's
                   kind, would choose), its groups and assignment then scored on the real devices
  packed           today's path: the whole batch packed as documents into one sequence over every device (the
                   scheduler's plan; in k sequential passes of equal tokens when one does not fit)
  ring/ulysses/usp equal groups (one per node), sequences dealt out by tokens without regard to device speed, each
                   group's packed pass planned by that strategy

and the ratio of each to the batch plan's step. One BatchPlanner per cluster serves its distributions in turn, as one
would serve a job's steps: what its exact plans learn about its pricing carries over to the next. Also: the per-step solve time of the BatchPlanner (measured, warm:
the job's candidate groups and their pricing made once beforehand, plan(lengths, exact=False)), and its lower
bound and gap (under the search's linear pricing).

    python benchmarks/batch_planning.py [--sizes 64,128,1024] [--out benchmarks/results/batch_planning.md]
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hexiseq  # noqa: E402
from hexiseq.errors import MemoryFitError, UnsupportedError  # noqa: E402
from hexiseq.planner.batch import BatchPlanner  # noqa: E402
from hexiseq.planner.batch_kinds import exact_pass  # noqa: E402
from hexiseq.planner.packing import first_fit  # noqa: E402

KINDS = [("H100-SXM", 450.0), ("A100-80G", 300.0), ("A800", 200.0), ("L40S", 32.0), ("H800", 200.0),
         ("A100-40G", 300.0)]
MODEL = "gpt-7b"
TRAINING = hexiseq.Training(checkpointing=True)


def cluster(size):
    if size == 64:  # 3 nodes of H100, 3 of A100-80G, 2 of L40S
        nodes = [KINDS[0]] * 3 + [KINDS[1]] * 3 + [KINDS[3]] * 2
    else:           # the six kinds in turn
        nodes = [KINDS[i % len(KINDS)] for i in range(size // 8)]
    return hexiseq.Cluster.from_dict({"nodes": [{"gpu": g, "count": 8, "intra_gbps": bw} for g, bw in nodes],
                                      "inter_node_gbps": 25.0})


def distribution(name, tokens, rng):
    """Sequence lengths adding up to about `tokens`."""
    out = []
    while sum(out) < tokens:
        if name == "pretraining long tail":   # lognormal, median 2K, a tail to 128K
            x = rng.lognormal(math.log(2048), 1.3)
            out.append(int(min(max(x, 64), 131072)))
        elif name == "long-context mix":      # mostly short, one in ten 32K-256K
            out.append(int(rng.uniform(32768, 262144)) if rng.random() < 0.1
                       else int(min(max(rng.lognormal(math.log(1536), 1.0), 64), 32768)))
        else:                                  # short fine-tuning samples
            out.append(int(min(max(rng.lognormal(math.log(800), 0.8), 32), 16384)))
    return out


def lp_bound(planner, lengths, most=3_000_000):
    """A lower bound on the step of any cut of the planner's candidate tree and any assignment, under its linear
    pricing: the linear programme min T over fractional assignments x[g, i] >= 0 (each sequence's x summing to 1,
    only groups that can hold it), each device's load summed over every candidate group holding it <= T. A cut
    puts each device in one group, so every cut's integral assignment is a point of it (the groups' per-pass and
    synchronisation times, both >= 0, left out). Tighter than the planner's own bound, which fixes the weights of
    its devices instead of solving for them. None without scipy, or past `most` variables."""
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    cost = planner.cost_matrix(lengths)[0]
    g_idx, i_idx = np.nonzero(np.isfinite(cost))
    k = len(g_idx)
    if k + 1 > most:
        return None
    n = planner.cluster.num_devices
    rows, cols, vals = [], [], []
    for col, (g, i) in enumerate(zip(g_idx, i_idx)):
        devs = planner.groups[g]
        rows.extend(devs)
        cols.extend([col] * len(devs))
        vals.extend([cost[g, i]] * len(devs))
    rows += list(range(n))
    cols += [k] * n
    vals += [-1.0] * n
    a_ub = coo_matrix((vals, (rows, cols)), shape=(n, k + 1)).tocsr()
    a_eq = coo_matrix((np.ones(k), (i_idx, np.arange(k))), shape=(len(lengths), k + 1)).tocsr()
    obj = np.zeros(k + 1)
    obj[-1] = 1.0
    res = linprog(obj, A_ub=a_ub, b_ub=np.zeros(n), A_eq=a_eq, b_eq=np.ones(len(lengths)), bounds=(0, None),
                  method="highs")
    return float(res.fun) if res.status == 0 else None


def milp_bound(planner, lengths, time_limit_s=300.0, most=400_000, one_cut=True, priced=None):
    """A lower bound on the slowest group of ANY plan of the planner's candidate tree under its linear pricing that
    runs one cut a step, from the mixed-integer programme of that problem (scipy's HiGHS): choose a cut (y_g, each
    device in exactly one chosen group), give each sequence to one chosen group that can hold it (x[g, i] binary),
    and a count of passes per group (m_g integer, its tokens <= m_g x capacity), minimising T >= every device's
    f_g m_g + sum_i c[g, i] x[g, i]. Packing whole sequences into passes needs at least the aggregate count, so the
    programme relaxes what the planner does. one_cut=False drops the cut: any candidate group may hold sequences
    and a device's load sums over every group it is in, which is what a step could reach by running groups one
    after another (a group's own passes, then its children's side by side: on a tree of groups the step is then
    the most loaded device's load). Returns (bound, best found, proved optimal): the solver's dual bound when the
    time limit stops it (still a valid bound), else its optimum; None without scipy or past `most` variables.
    priced: the planner's (cost, fixed, capacity) for `lengths` taken earlier (a job's pricing moves as its exact
    plans teach it), else taken now."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    cost, fixed, cap = planner.cost_matrix(lengths) if priced is None else priced
    total = np.array([sum(x) if isinstance(x, (list, tuple)) else x for x in lengths], dtype=np.float64)
    g_idx, i_idx = np.nonzero(np.isfinite(cost))
    G, N, D, K = cost.shape[0], cost.shape[1], planner.cluster.num_devices, len(g_idx)
    if K + 2 * G + 1 > most:
        return None
    xm, ym, tcol = K, K + G, K + 2 * G  # columns: x (K), m (G), y (G), T
    rows, cols, vals, lo, hi = [], [], [], [], []

    def put(r, c, v):
        rows.append(r)
        cols.append(c)
        vals.append(v)
    for col, (g, i) in enumerate(zip(g_idx, i_idx)):
        put(i, col, 1.0)                                  # each sequence in one group
        for d in planner.groups[g]:
            put(N + d, col, cost[g, i])                   # device loads
        put(N + D + g, col, total[i])                     # tokens <= m_g x capacity
    lo += [1.0] * N
    hi += [1.0] * N
    for g in range(G):
        for d in planner.groups[g]:
            put(N + d, xm + g, fixed[g])
            put(N + D + G + d, ym + g, 1.0)               # each device in exactly one chosen group
        put(N + D + g, xm + g, -float(cap[g]))
        put(N + D + G + D + g, xm + g, 1.0)               # m_g <= N y_g: only a chosen group holds anything
        put(N + D + G + D + g, ym + g, -float(N))
    for d in range(D):
        put(N + d, tcol, -1.0)
    lo += [-np.inf] * D + [-np.inf] * G + ([1.0] if one_cut else [0.0]) * D + [-np.inf] * G
    hi += [0.0] * D + [0.0] * G + ([1.0] if one_cut else [np.inf]) * D + [0.0] * G
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), tcol + 1)).tocsr()
    obj = np.zeros(tcol + 1)
    obj[tcol] = 1.0
    integrality = np.ones(tcol + 1)
    integrality[tcol] = 0
    upper = np.full(tcol + 1, np.inf)
    upper[:K] = 1.0
    upper[ym:tcol] = 1.0
    res = milp(obj, constraints=LinearConstraint(a, lo, hi), integrality=integrality, bounds=Bounds(0, upper),
               options={"time_limit": time_limit_s})
    if res.x is None:
        return None
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(res.fun) if bound is None or res.status == 0 else float(bound)
    return bound, float(res.fun), res.status == 0


SOLVE_AT = {128: 512, 1024: 4096}  # devices: sequences of a step, where the per-step solve time is timed


def solve_times(planner, size, n, seed, draws=5):
    """Per-step solve time of `n` sequences of the pretraining long tail on the planner's cluster, warm (the
    pricing made by a first plan): median and slowest of `draws` batches."""
    rng = np.random.default_rng(seed + 100)
    batches = [[distribution("pretraining long tail", 1, rng)[0] for _ in range(n)] for _ in range(draws)]
    planner.plan(batches[0], exact=False)
    times = []
    for b in batches:
        t = time.perf_counter()
        planner.plan(b, exact=False)
        times.append(time.perf_counter() - t)
    return dict(size=size, sequences=n, median_ms=float(np.median(times)) * 1e3, max_ms=max(times) * 1e3)


def homogeneous(c):
    """The cluster with every node an H100 (same counts and links): what a planner for identical GPUs sees."""
    d = c.to_dict()
    for n in d["nodes"]:
        n["gpu"] = "H100-SXM"
    return hexiseq.Cluster.from_dict(d)


def score_groups(planner, groups, assignment, lengths):
    """Step of given groups and assignment on the planner's (real) cluster: each group's sequences packed (first fit
    by length into passes of its capacity), every pass scored exactly; the slowest group plus the gradient sync."""
    times = []
    for g, devs in enumerate(groups):
        kind = planner._kind[planner.groups.index(tuple(devs))]
        kind._ensure()
        seqs = [i for i, a in enumerate(assignment) if a == g]
        total = 0.0
        for b in first_fit(seqs, lengths, max(kind.longest, 1)):  # the planner's own packing
            p = exact_pass(kind, [lengths[i] for i in b]) if kind.longest else None
            total += math.inf if p is None else p.step_time_s
        times.append(total)
    return max(times) + planner.sync_s(groups)


def packed(c, lengths, strategy="hexiseq"):
    """One packed sequence over every device, or k sequential passes of about equal tokens."""
    for k in (1, 2, 4, 8, 16, 32, 64):
        chunks, per = [[]], sum(lengths) / k
        for L in lengths:
            if sum(chunks[-1]) + L > per * 1.0001 and chunks[-1] and len(chunks) < k:
                chunks.append([])
            chunks[-1].append(L)
        try:
            return sum(hexiseq.plan(c, model=MODEL, seq_len=sum(ch), training=TRAINING, strategy=strategy,
                                    documents=ch if len(ch) > 1 else None).step_time_s for ch in chunks), k
        except (MemoryFitError, UnsupportedError):
            continue
    return math.inf, None


def equal_groups(planner, c, lengths, strategy):
    """One group per node, sequences dealt out largest first to the least loaded group by tokens (speed-blind);
    each group's passes planned by `strategy` (first fit into passes that hold)."""
    nodes = [tuple(range(8 * n, 8 * n + 8)) for n in range(c.num_devices // 8)]
    load = [0.0] * len(nodes)
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = int(np.argmin(load))
        owner[i] = g
        load[g] += lengths[i] + lengths[i] ** 2 / 8192.0  # work grows with tokens and pairs
    times = []
    for g, devs in enumerate(nodes):
        docs = sorted((lengths[i] for i in range(len(lengths)) if owner[i] == g), reverse=True)
        sub = c.subset(devs)
        t, passes = 0.0, [docs]
        while passes:
            b = passes.pop()
            if not b:
                continue
            try:
                t += hexiseq.plan(sub, model=MODEL, seq_len=sum(b), training=TRAINING, strategy=strategy,
                                  documents=b if len(b) > 1 else None).step_time_s
            except (MemoryFitError, UnsupportedError):
                if len(b) == 1:
                    t = math.inf
                    break
                passes += [b[0::2], b[1::2]]
        times.append(t)
    return max(times) + planner.sync_s(nodes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128,1024")
    ap.add_argument("--out", default="benchmarks/results/batch_planning.md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-shared", action="store_true",
                    help="also bound plans that run groups one after another (64 GPUs; milp_bound(one_cut=False))")
    ap.add_argument("--milp-s", type=float, default=300.0,
                    help="time limit of each mixed-integer bound (64 and 128 GPUs; 0: none)")
    a = ap.parse_args()
    dists = ["pretraining long tail", "long-context mix", "short fine-tuning samples"]
    rows, solves, bounds = [], [], []
    for size in (int(x) for x in a.sizes.split(",")):
        c = cluster(size)
        t0 = time.perf_counter()
        planner = BatchPlanner(c, model=MODEL, training=TRAINING)
        eq = BatchPlanner(homogeneous(c), model=MODEL, training=TRAINING)
        tokens = 16384 * size  # 16K tokens per GPU per step
        for name in dists if size < 1024 else dists[:2]:
            rng = np.random.default_rng(a.seed)
            lengths = distribution(name, tokens, rng)
            t = time.perf_counter()
            bp = planner.plan(lengths)
            first_s = time.perf_counter() - t
            # per-step solve time, warm (a fresh draw of the same distribution, the pricing already made)
            lengths2 = distribution(name, tokens, np.random.default_rng(a.seed + 1))
            planner.plan(lengths2, exact=False)
            t = time.perf_counter()
            planner.plan(lengths2, exact=False)
            step_solve_s = time.perf_counter() - t
            e = eq.plan(lengths, exact=False)
            # the per-step plan and the mixed-integer bound under one pricing (the job's, as it stands now)
            quick = planner.plan(lengths, exact=False)
            if size <= 128 and a.milp_s > 0:  # solved once every plan is timed (the solver's threads linger)
                bounds.append((len(rows), planner, lengths, planner.cost_matrix(lengths), a.time_shared and size <= 64))
            row = dict(size=size, cluster=c.describe(), distribution=name, sequences=len(lengths),
                       tokens=sum(lengths), longest=max(lengths), groups=len(bp.groups),
                       group_sizes=sorted({len(g) for g in bp.groups}), step_s=bp.step_time_s,
                       model_step_s=bp.model_step_time_s, bound_s=bp.lower_bound_s, gap=bp.gap_to_bound,
                       lp_bound_s=lp_bound(planner, lengths), step_group_s=max(quick.model_group_time_s),
                       step_sync_s=quick.sync_s,
                       milp_bound_s=None, milp_found_s=None, milp_optimal=None, shared_bound_s=None,
                       solve_first_s=first_s, solve_step_s=step_solve_s,
                       equal_devices_s=score_groups(planner, e.groups, e.assignment, list(bp.lengths)))
            row["packed_s"], row["packed_passes"] = packed(c, lengths)
            for s in ("ring", "ulysses", "usp"):
                row[f"{s}_s"] = equal_groups(planner, c, lengths, s)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if size in SOLVE_AT:
            solves.append(solve_times(planner, size, SOLVE_AT[size], a.seed))
            print(json.dumps(solves[-1]), flush=True)
        print(f"# {size} GPUs done in {time.perf_counter() - t0:.0f} s", flush=True)
    for k, planner, lengths, priced, shared in bounds:
        got = milp_bound(planner, lengths, a.milp_s, priced=priced)
        if got:
            rows[k].update(milp_bound_s=got[0], milp_found_s=got[1], milp_optimal=got[2])
        got = milp_bound(planner, lengths, a.milp_s, one_cut=False, priced=priced) if shared else None
        if got:
            rows[k]["shared_bound_s"] = got[0]
        keys = ("size", "distribution", "step_group_s", "milp_bound_s", "milp_found_s", "milp_optimal",
                "shared_bound_s")
        print(json.dumps({key: rows[k][key] for key in keys}), flush=True)
    lines = ["# Batch plans at scale (predicted)", "",
             f"Model {MODEL} with activation checkpointing; 8 GPUs per node, 25 GB/s between nodes; about 16K tokens "
             "per GPU per step. Every step time is a prediction of hexiseq's cost model (no GPU ran here); solve "
             "times are measured on the machine that ran `python benchmarks/batch_planning.py` (2 CPU cores). "
             "Ratios: the other method's step over the batch plan's (above 1: the batch plan is faster).", "",
             "| GPUs | lengths | seqs | longest | groups (sizes) | batch plan s | bound s (gap) | LP bound s (gap) | "
             "vs equal devices | vs packed (passes) | vs ring | vs ulysses | vs usp | solve per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def ratio(x):
            return "does not fit" if math.isinf(x) else f"{x / r['step_s']:.2f}x"
        lines.append(
            f"| {r['size']} | {r['distribution']} | {r['sequences']} | {r['longest']:,} | {r['groups']} "
            f"({', '.join(map(str, r['group_sizes']))}) | {r['step_s']:.3f} | {r['bound_s']:.3f} ({r['gap']:.2f}x) | "
            + (f"{r['lp_bound_s']:.3f} ({r['model_step_s'] / r['lp_bound_s']:.2f}x) | " if r["lp_bound_s"] else "- | ")
            + f"{ratio(r['equal_devices_s'])} | {ratio(r['packed_s'])} ({r['packed_passes']}) | {ratio(r['ring_s'])} | "
            f"{ratio(r['ulysses_s'])} | {ratio(r['usp_s'])} | {r['solve_step_s'] * 1e3:.0f} ms |")
    lines += ["", "bound: the planner's own lower bound (BatchPlan.lower_bound_s); LP bound: the linear programme of "
              "lp_bound() in this script (scipy's HiGHS; '-' past 3M variables), tighter; both under the search's "
              "linear pricing, gaps are the linearly priced step (model_step_time_s) over them. No plan of the "
              "candidate groups can beat the packed path by more than packed / LP bound."]
    for r in rows:
        if r["lp_bound_s"] and not math.isinf(r["packed_s"]):
            lines.append(f"- {r['size']} GPUs, {r['distribution']}: packed / LP bound = "
                         f"{r['packed_s'] / r['lp_bound_s']:.2f}x at most; the batch plan reaches "
                         f"{r['packed_s'] / r['step_s']:.2f}x")
    lines += ["", "One cut per step, under the same linear pricing: the per-step plan "
              "(`plan(lengths, exact=False)`: its slowest group plus the gradient sync) against milp_bound() in "
              "this script, the mixed-integer programme of choosing a cut, an assignment and passes to minimise "
              "the slowest group (HiGHS, at most "
              f"{a.milp_s:.0f} s; a bound the solver proved optimal is marked exact, else its dual bound). "
              "Every plan of the candidate tree that runs one cut a step has a slowest group, and so a step, at "
              "least this bound; the gap (step over bound) says how far the planner's plan can be from the best such "
              "plan, and overstates it by up to the sync, which the programme leaves out.", "",
              "| GPUs | lengths | per-step plan: slowest group + sync, s | one-cut bound s | gap | "
              "the solver's best cut, slowest group s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("milp_bound_s"):
            step = r["step_group_s"] + r["step_sync_s"]
            lines.append(f"| {r['size']} | {r['distribution']} | {r['step_group_s']:.3f} + {r['step_sync_s']:.3f} | "
                         f"{r['milp_bound_s']:.3f}{' (exact)' if r['milp_optimal'] else ''} | "
                         f"{step / r['milp_bound_s']:.3f}x | {r['milp_found_s']:.3f} |")
    shared = [r for r in rows if r.get("shared_bound_s")]
    if shared:
        lines += ["", "Groups one after another (a group's passes, then its children's side by side), bounded by "
                  "milp_bound(one_cut=False): what no plan of the candidate tree, one cut a step or not, can beat:",
                  ""]
        lines += [f"- {r['size']} GPUs, {r['distribution']}: at least {r['shared_bound_s']:.3f} s, the per-step plan "
                  f"{r['step_group_s'] + r['step_sync_s']:.3f} s "
                  f"({(r['step_group_s'] + r['step_sync_s']) / r['shared_bound_s']:.3f}x)" for r in shared]
    if solves:
        lines += ["", "Per-step solve time at fixed batch sizes (measured, warm `plan(lengths, exact=False)`, "
                  "five batches of the pretraining long tail with exactly that many sequences, each planned once):", "",
                  "| GPUs | sequences | median | slowest |", "|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['sequences']} | {r['median_ms']:.1f} ms | {r['max_ms']:.1f} ms |"
                  for r in solves]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
