"""A node lost mid-run, the job resumed on the survivor (measured on this machine, CPU, Gloo).

Two torchrun elastic agents on localhost (`--nnodes 1:2 --max-restarts 3`, c10d rendezvous), one process each,
stand for the two machines of a saved two-device cluster (`host: node-a` and `node-b`; each agent names its machine
by HEXISEQ_HOST, as two real machines would by their host names), and each worker finds its device with
hexiseq.elastic.survivors (its machine and local rank matched to the nodes' hosts). They train a small model with
its states sharded by the plan's shares, checkpointing every few steps (hexiseq.checkpoint, DCP format). Mid-run
the second agent is killed with its worker. The first agent restarts its worker, which finds that only node-a is
left, re-plans on the cluster of the devices left, loads the last checkpoint at the new plan's shares and trains
on. The loss of every step is compared with an uninterrupted one-process run of the same steps: only the
steps since the last checkpoint are taken again, and each step's loss is the same.

    python benchmarks/elastic_restart_cpu.py [--out benchmarks/results/elastic_restart_cpu.md]
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORKER = os.path.join(ROOT, "benchmarks", "elastic_worker.py")
CLUSTER = """nodes:
  - {gpu: cpu-node, count: 1, intra_gbps: 10, memory_gib: 8, peak_tflops: 0.2, gemm_eff: 0.5, attn_eff: 0.3, host: node-a}
  - {gpu: cpu-node, count: 1, intra_gbps: 10, memory_gib: 8, peak_tflops: 0.2, gemm_eff: 0.5, attn_eff: 0.3, host: node-b}
inter_node_gbps: 1
"""


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def agent(device, nnodes, port, work, log, steps, sleep, tag):
    # each agent stands for a machine of the saved cluster: its worker finds its device by that name
    env = dict(os.environ, HEXISEQ_HOST=f"node-{'ab'[device]}",
               HEXISEQ_DEMO_PROGRESS=os.path.join(work, f"progress-{tag}"),
               HEXISEQ_DEMO_SLEEP=str(sleep), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"demo-{tag}",
           "--max-restarts", "3", "--monitor-interval", "1", WORKER, "--cluster", os.path.join(work, "cluster.yaml"),
           "--ckpt", os.path.join(work, f"ckpt-{tag}"), "--steps", str(steps), "--every", "5", "--events", log]
    out = open(os.path.join(work, f"agent-{tag}-{device}.txt"), "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def read(log):
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=12, help="kill the second agent after this step")
    ap.add_argument("--sleep", type=float, default=0.5, help="seconds each step also takes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="hexiseq-elastic-")
    with open(os.path.join(work, "cluster.yaml"), "w") as f:
        f.write(CLUSTER)
    # the reference: one process, the same steps, no interruption
    ref_log = os.path.join(work, "reference.jsonl")
    ref = agent(0, "1", free_port(), work, ref_log, a.steps, 0.0, "ref")
    if ref.wait(timeout=300) != 0:
        sys.exit(f"the reference run failed: see {work}")
    # the elastic job: two agents, the second killed mid-run
    log = os.path.join(work, "elastic.jsonl")
    port = free_port()
    t0 = time.time()
    first = agent(0, "1:2", port, work, log, a.steps, a.sleep, "job")
    time.sleep(2.0)
    second = agent(1, "1:2", port, work, log, a.steps, a.sleep, "job")
    progress = os.path.join(work, "progress-job.1")
    deadline = time.time() + 240
    while time.time() < deadline:
        if os.path.exists(progress) and open(progress).read().strip() and int(open(progress).read()) >= a.kill_at:
            break
        time.sleep(0.1)
    else:
        sys.exit(f"the second agent never reached step {a.kill_at}: see {work}")
    os.killpg(second.pid, signal.SIGKILL)  # the agent (its own session)
    os.kill(int(open(progress + ".pid").read()), signal.SIGKILL)  # and its worker, in a session of its own
    killed_at = time.time() - t0
    rc = first.wait(timeout=600)
    elapsed = time.time() - t0
    events = read(log)
    reference = {e["step"]: e["loss"] for e in read(ref_log) if e["event"] == "step"}
    final = {}
    for e in events:
        if e["event"] == "step":
            final[e["step"]] = e  # a step taken again after the restart replaces the first take
    starts = [e for e in events if e["event"] == "start"]
    lines = ["# A node lost mid-run, the job resumed on the survivor (measured, CPU, Gloo)", "",
             f"`python benchmarks/elastic_restart_cpu.py` (steps {a.steps}, the second agent killed after step "
             f"{a.kill_at}, {a.sleep} s added to each step): the surviving agent's exit status {rc}, "
             f"{elapsed:.1f} s in all, the kill at {killed_at:.1f} s.", "",
             "| (re)start | world | devices present | lost | state shares | from step |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(starts):
        lines.append(f"| {i} | {e['world']} | {e['devices']} | {e['lost']} | {[round(x, 3) for x in e['shares']]} | "
                     f"{e['from_step']} |")
    taken_twice = sorted(s for s in final if sum(1 for e in events if e.get("step") == s) > 1)
    worst = max(abs(final[s]["loss"] - reference[s]) for s in reference) if len(final) == len(reference) else None
    lines += ["", f"Steps taken: {len(final)} of {a.steps}; taken again after the restart: {taken_twice}.",
              "Largest difference of a step's loss from the uninterrupted one-process run: "
              + (f"{worst:.2e}" if worst is not None else "MISSING STEPS"),
              "", "| step | world | loss | uninterrupted | difference |", "|---|---|---|---|---|"]
    for s in sorted(final):
        lines.append(f"| {s} | {final[s]['world']} | {final[s]['loss']:.12f} | {reference[s]:.12f} | "
                     f"{final[s]['loss'] - reference[s]:+.1e} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    ok = rc == 0 and worst is not None and worst < 1e-9 and len(starts) >= 2 and starts[-1]["world"] == 1
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"(kept {work} for inspection)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
