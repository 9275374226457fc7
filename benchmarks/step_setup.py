"""What a step of a batch plan costs each rank before its first layer: BatchContext.step(plan) at 128 devices and 512
sequences (or --devices, --sequences), measured on every rank (or the first --ranks).

The plans are those a job makes per step (BatchPlanner.plan(lengths, exact=False), gpt-7b with activation
checkpointing on benchmarks/batch_planning.py's 128-GPU cluster of six GPU models, 512 sequences of its "pretraining
long tail" per step). Every rank of a job holds the same plans; here one process plays each rank in turn on torch's
"fake" process-group backend (any world size in one process; its collectives move nothing), so the figure is the
rank's own work: checking the plan, finding its group and passes, the pass contexts (topology, routes, block
kernels), and the process groups a step needs, made once per job (the first step makes them; the later steps find
them made). The one collective of a step, the agreement on the plan's fingerprint (one all-gather of two int64s
over the world), moves nothing on that backend: it is measured apart, on real Gloo ranks of this machine, and added.

Also measured: the per-step plan itself (what the planner's threads pay, every pass resolved), and that the step
plans nothing (the core's planning entry points raise while the steps run). Beside them, in the same run, what
running the scheduler on each pass of the same plans costs (exact_pass, how a per-step plan's passes were resolved
when the runtime first asked for them, which every rank then paid in its step).

    python benchmarks/step_setup.py [--devices 128] [--sequences 512] [--ranks N] [--steps 4]
                                    [--out benchmarks/results/step_setup.md]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import batch_planning as bp  # noqa: E402
from _machine import machine  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from hexiseq import _core  # noqa: E402
from hexiseq.planner.batch import BatchPlanner  # noqa: E402
from hexiseq.planner.batch_kinds import exact_pass  # noqa: E402
from hexiseq.runtime import batch as batch_runtime  # noqa: E402

PLANNING = ("plan_strategy", "rebalance", "evaluate", "batch_assign", "memory_tokens_bound")


def batches(steps, sequences, seed=0, devices=128):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = []
        while len(lengths) < sequences:
            lengths += bp.distribution("pretraining long tail", 16384 * devices, rng)
        out.append(lengths[:sequences])
    return out


def setup_per_rank(planner, plans, ranks):
    """Seconds of each step's setup (BatchContext.step) on each rank, with torch's fake backend; planning refused."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def no_agreement(group, values, fields, error=None, **kwargs):  # measured apart, on Gloo ranks
        if error is not None:
            raise error
        return [list(values)]

    saved = {name: getattr(_core, name) for name in PLANNING}

    def planning(*args, **kwargs):
        raise AssertionError("the runtime planned during a step")

    real_new_group = dist.new_group

    def fake_twin(*args, backend=None, **kwargs):  # the Gloo twins a non-Gloo world needs: fake ones here
        return real_new_group(*args, **kwargs)

    real_agree = batch_runtime.agree
    batch_runtime.agree = no_agreement
    dist.new_group = fake_twin
    for name in PLANNING:
        setattr(_core, name, planning)
    try:
        times = []
        for rank in ranks:
            for plan in plans:  # what one rank derives from its plan, derived again for each (not kept from the last)
                for passes in plan.pass_plans:
                    for p in passes:
                        p.__dict__.pop("_chunks", None)
                        p.layout.__dict__.pop("_geometry_chunks", None)
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=planner.cluster.num_devices)
            ctx = batch_runtime.BatchContext(planner)
            mine = []
            for plan in plans:
                t0 = time.perf_counter()
                step = ctx.step(plan)
                mine.append(time.perf_counter() - t0)
                assert step.devices and rank in step.devices
            ctx.close()
            dist.destroy_process_group()
            times.append(mine)
        return times
    finally:
        batch_runtime.agree = real_agree
        dist.new_group = real_new_group
        for name, fn in saved.items():
            setattr(_core, name, fn)


def _agreement_rank(rank, world, init, reps, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    for _ in range(20):
        batch_runtime.agree(group, [1], ["batch plan"])
    t0 = time.perf_counter()
    for _ in range(reps):
        batch_runtime.agree(group, [1], ["batch plan"])
    out.put((rank, (time.perf_counter() - t0) / reps))
    dist.barrier()
    dist.destroy_process_group()


def agreement_s(world, reps=200):
    """Seconds of one step agreement (an all-gather of two int64s) on `world` Gloo ranks of this machine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'init')}"
        procs = [ctx.Process(target=_agreement_rank, args=(r, world, init, reps, out)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
    return max(got.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=128, choices=(64, 128, 1024))
    parser.add_argument("--ranks", type=int, default=None, help="how many of the ranks to play (default all)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    cluster = bp.cluster(args.devices)
    t0 = time.perf_counter()
    planner = BatchPlanner(cluster, model=bp.MODEL, training=bp.TRAINING)
    lengths = batches(args.steps + 1, args.sequences, devices=args.devices)
    planner.plan(lengths[0], exact=False)  # the job's one-time pricing
    priced = time.perf_counter() - t0
    plans, plan_s = [], []
    for b in lengths[1:]:
        t = time.perf_counter()
        plans.append(planner.plan(b, exact=False))
        plan_s.append(time.perf_counter() - t)
    searched_s = []
    for p in plans:  # every pass of the plan searched by the scheduler, as plan_for did on first use
        t = time.perf_counter()
        for g, devices in enumerate(p.groups):
            kind = planner._kind[planner.groups.index(devices)]
            for seqs in p.passes[g]:
                exact_pass(kind, [L for i in seqs for L in (p.documents[i] or (p.lengths[i],))])
        searched_s.append(time.perf_counter() - t)
    passes = [sum(len(ps) for ps in p.passes) for p in plans]
    groups = [len(p.groups) for p in plans]
    ranks = list(range(args.devices))[:args.ranks]
    times = setup_per_rank(planner, plans, ranks)
    first = [t[0] for t in times]
    later = [x for t in times for x in t[1:]]
    agree4 = agreement_s(4)
    lines = [
        f"# A step's setup on every rank (batch runtime, {args.devices} devices, {args.sequences} sequences a step)",
        "",
        f"Machine: {machine()}. Command: `python benchmarks/step_setup.py --devices {args.devices} --sequences "
        f"{args.sequences} --ranks {len(ranks)} --steps {args.steps}`.",
        "",
        f"Cluster: benchmarks/batch_planning.py's {args.devices} GPUs (8 per node); {bp.MODEL}, activation "
        f"checkpointing; {args.steps} steps of {args.sequences} sequences (\"pretraining long tail\"), each planned "
        f"per step (`BatchPlanner.plan(lengths, exact=False)`): {groups} groups, {passes} passes.",
        "",
        f"Load average (1 minute) before / after the run: {load_before:.1f} / {os.getloadavg()[0]:.1f} (2 cores).",
        "",
        "| what | measured |",
        "| --- | --- |",
        f"| the job's one-time pricing (planner and first plan) | {priced:.1f} s |",
        f"| a per-step plan, every pass resolved (median of {len(plan_s)}) | {statistics.median(plan_s) * 1e3:.1f} ms |",
        f"| `BatchContext.step`, first step of the job (makes the process groups), median / max over "
        f"{len(ranks)} ranks | {statistics.median(first) * 1e3:.2f} / {max(first) * 1e3:.2f} ms |",
        f"| `BatchContext.step`, later steps, median / 95th percentile / max over {len(ranks)} ranks x "
        f"{args.steps - 1} steps | {statistics.median(later) * 1e3:.2f} / {np.percentile(later, 95) * 1e3:.2f} / "
        f"{max(later) * 1e3:.2f} ms |",
        f"| the same plans' passes each searched by the scheduler (exact_pass), median of {len(plans)} | "
        f"{statistics.median(searched_s) * 1e3:.0f} ms ({statistics.median(searched_s) / statistics.median(later):.0f}x "
        "a later step's median setup) |",
        f"| the step's agreement (one all-gather of two int64s), 4 Gloo ranks on this machine | "
        f"{agree4 * 1e3:.2f} ms |",
        "",
        f"The later steps' setup is each rank's own work (torch's fake backend plays the {len(ranks)} ranks in one "
        "process); "
        "the agreement is its one collective, measured on real ranks. The core's planning entry points "
        f"({', '.join(PLANNING)}) raised if called while the steps ran: none was.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
