"""The runtime's attention layer on one GPU (a one-rank NCCL group), per block implementation, next to torch SDPA's
flash backend on the same inputs: what the ring's bookkeeping (all-to-all, merges, accumulators) costs on top of
the kernels, and which block implementation the runtime should default to on CUDA tensors.

Usage: python benchmarks/bench_runtime_gpu.py [--out runtime_gpu.md] [--seqs 8192,32768] [--iters 10]
Times are CUDA-event medians of forward+backward (HexiSeqAttention; SDPA with autograd) after warm-up, each step
synchronised; "back to back" queues the steps without a wait between them (the host runs ahead, as in a model of
many layers); "alone" is the block backend's own forward and backward op called once on the whole sequence with
the same GQA inputs, which is what the runtime adds its bookkeeping to; "host time" is what issuing one runtime
step costs the CPU. The profile of one backend (PROFILE_IMPL, default cudnn) at the shortest length goes to stdout.
Implementations: 'flash' and 'cudnn' (the PyTorch block path with torch's fused flash or cuDNN op per block pair; the
default picks the faster per device), 'hexiseq' (the CUDA kernels of kernels/forward.cu and kernels/backward.cu),
each next to its op called alone through SDPA (flash, cuDNN): the ratio is the runtime's own cost. bf16, causal,
GQA 4:1."""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import hexiseq
from bench_block_backends import documents_case  # the document lengths the block benchmark uses
from bench_cuda_attention import time_ms  # CUDA-event median after warm-up, as the kernel benchmark
from hexiseq import ops
from hexiseq.nn import HexiSeqAttention
from hexiseq.runtime import fused


def _hexiseq_forward(q, k, v, causal, scale):
    return ops.attention_forward(q, k, v, causal=causal, scale=scale)


def _hexiseq_backward(q, k, v, o, lse, do, causal, scale):
    return ops.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale)


BLOCK_OPS = {"flash": (fused._flash_forward, fused._flash_backward),
             "cudnn": (fused._cudnn_forward, fused._cudnn_backward),
             "hexiseq": (_hexiseq_forward, _hexiseq_backward)}


def back_to_back_ms(fn, iters):
    """Milliseconds per call of `iters` calls queued back to back between two events: the host runs ahead of the
    GPU, as it does in a model with many layers, so host-side cost hides unless it exceeds the GPU's."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_ms(fn, iters):
    """Median host time to issue one call (the GPU idle and synchronised before each)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(step, alone, impl, S):
    """The GPU kernels of one runtime step next to those of the backend alone (torch.profiler), to the log."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for name, fn in (("runtime step", step), ("backend alone", alone)):
        fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(f"--- {impl} {name}, S={S}, 3 calls", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70),
              flush=True)
    import cProfile
    import pstats
    torch.cuda.synchronize()
    host = cProfile.Profile()
    host.enable()
    for _ in range(5):
        step()
    host.disable()
    torch.cuda.synchronize()
    print(f"--- {impl} runtime step, S={S}: host time by function (cProfile, 5 steps)", flush=True)
    pstats.Stats(host, stream=sys.stdout).sort_stats("tottime").print_stats(22)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqs", default="8192,32768")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    H, Hkv, D = 16, 4, 128
    store = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(store, 'store')}", rank=0, world_size=1)
    rows = []
    try:
        for S in (int(x) for x in args.seqs.split(",")):
            model = hexiseq.Model(layers=1, hidden=H * D, heads=H, kv_heads=Hkv, head_dim=D, ffn=4 * H * D, vocab=1000)
            cluster = hexiseq.Cluster.from_dict({"nodes": [{"gpu": "H100-SXM", "count": 1, "intra_gbps": 300.0}]})
            plan = hexiseq.evaluate(cluster, model=model, seq_len=S, causal=True,
                                    layout={"groups": [{"devices": [0], "seq": S, "tokens": [S], "heads": [H]}]})
            q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
            row = {"S": S}
            scale = D ** -0.5
            for impl in ("flash", "cudnn", "hexiseq", "default"):
                if impl == "default":  # the runtime's own choice for this device (measured on its first call)
                    os.environ.pop("HEXISEQ_RUNTIME_KERNELS", None)
                else:
                    os.environ["HEXISEQ_RUNTIME_KERNELS"] = impl
                attn = HexiSeqAttention(plan, causal=True)
                if impl == "default":
                    attn(q, k, v).backward(do)
                    row["default_is"] = fused.choice(q, k, "pairs")
                def step():
                    attn(q, k, v).backward(do)
                fwd, bwd = BLOCK_OPS[row["default_is"] if impl == "default" else impl]
                qd, kd, vd = q.detach(), k.detach(), v.detach()

                def alone():  # the block backend called once on the whole sequence, GQA native, as the runtime calls it
                    o, lse = fwd(qd, kd, vd, True, scale)
                    bwd(qd, kd, vd, o, lse, do, True, scale)
                try:
                    row[impl] = time_ms(step, args.iters)
                    row[impl + "_b2b"] = back_to_back_ms(step, args.iters)
                    row[impl + "_host"] = host_ms(step, args.iters)
                    row[impl + "_alone"] = time_ms(alone, args.iters)
                    row[impl + "_alone_b2b"] = back_to_back_ms(alone, args.iters)
                    if impl == os.environ.get("PROFILE_IMPL", "cudnn") and S == min(int(x) for x in args.seqs.split(",")):
                        try:
                            profile(step, alone, impl, S)
                        except Exception as e:  # noqa: BLE001 - the profile is for the log; the timings stand
                            print(f"profile: {type(e).__name__}: {e}", flush=True)
                except RuntimeError as e:  # an op this torch or GPU lacks: reported, not timed
                    for key in ("", "_b2b", "_host", "_alone", "_alone_b2b"):
                        row.setdefault(impl + key, float("nan"))
                    print(f"{impl}: {str(e).splitlines()[0][:200]}", flush=True)
                attn.context.close()
            os.environ.pop("HEXISEQ_RUNTIME_KERNELS", None)
            # SDPA's flash backend takes equal head counts: K, V expanded once, outside the timed region (in the
            # baseline's favour); the same tensors for SDPA's cuDNN backend
            qt = q.detach().transpose(1, 2).requires_grad_()
            kt, vt = (x.detach().repeat_interleave(H // Hkv, dim=2).transpose(1, 2).requires_grad_() for x in (k, v))
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa_step(backend=backend):
                    with sdpa_kernel(backend):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                    o.backward(do.transpose(1, 2))
                try:
                    row[name] = time_ms(sdpa_step, args.iters)
                except RuntimeError as e:
                    row[name] = float("nan")
                    print(f"{name}: {str(e).splitlines()[0][:200]}", flush=True)
            # packed documents on each document backend, and the runtime's own choice
            lengths = documents_case(S, S + D)
            q_doc = torch.from_numpy(ops.document_starts(lengths)).to("cuda")
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            row["docs"] = len(lengths)
            for docb in ("varlen", "hexiseq", "default"):
                if docb == "default":
                    os.environ.pop("HEXISEQ_DOCUMENT_KERNELS", None)
                    row["docs_default_is"] = fused.choice(q, k, "documents")
                else:
                    os.environ["HEXISEQ_DOCUMENT_KERNELS"] = docb
                attn = HexiSeqAttention(plan, causal=True)
                seg = fused.segments(qd, kd, 0, 0, q_doc)
                alone_b = row["docs_default_is"] if docb == "default" else docb

                def doc_step():
                    attn(q, k, v, documents=lengths).backward(do)

                def doc_alone():
                    if alone_b == "varlen":
                        o, lse = fused.varlen_forward(qd, kd, vd, seg, scale)
                        fused.varlen_backward(qd, kd, vd, o, lse, do, seg, scale)
                    else:
                        o, lse = ops.attention_forward(qd, kd, vd, causal=True, scale=scale, q_doc=q_doc)
                        ops.attention_backward(qd, kd, vd, o, lse, do, causal=True, scale=scale, q_doc=q_doc)
                try:
                    row[f"docs_{docb}_runtime"] = back_to_back_ms(doc_step, args.iters)
                    row[f"docs_{docb}_alone"] = back_to_back_ms(doc_alone, args.iters)
                except Exception as e:  # noqa: BLE001 - reported, not timed
                    row[f"docs_{docb}_runtime"] = row[f"docs_{docb}_alone"] = float("nan")
                    print(f"documents, {docb}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                attn.context.close()
            os.environ.pop("HEXISEQ_DOCUMENT_KERNELS", None)
            rows.append(row)
            print(row, flush=True)
            del q, k, v, do, qt, kt, vt
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    lines = ["| S | block backend | runtime (ms) | the backend alone (ms) | runtime / alone | runtime, back to back (ms) | "
             "alone, back to back (ms) | runtime / alone, back to back | host time per runtime step (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for impl in ("flash", "cudnn", "hexiseq", "default"):
            name = f"default ({r['default_is']})" if impl == "default" else impl
            lines.append(f"| {r['S']} | {name} | {r[impl]:.2f} | {r[impl + '_alone']:.2f} | "
                         f"{r[impl] / r[impl + '_alone']:.3f} | {r[impl + '_b2b']:.2f} | {r[impl + '_alone_b2b']:.2f} | "
                         f"{r[impl + '_b2b'] / r[impl + '_alone_b2b']:.3f} | {r[impl + '_host']:.2f} |")
    lines += ["", "Packed documents (lognormal lengths, as benchmarks/bench_block_backends.py) per document backend, "
              "back to back; 'alone' is that backend called once on the whole sequence:", "",
              "| S | documents | document backend | runtime (ms) | the backend alone (ms) | runtime / alone |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        for docb in ("varlen", "hexiseq", "default"):
            name = f"default ({r['docs_default_is']})" if docb == "default" else docb
            lines.append(f"| {r['S']} | {r['docs']} | {name} | {r[f'docs_{docb}_runtime']:.2f} | "
                         f"{r[f'docs_{docb}_alone']:.2f} | {r[f'docs_{docb}_runtime'] / r[f'docs_{docb}_alone']:.3f} |")
    lines += ["", "| S | runtime, flash blocks (ms) | runtime, cuDNN blocks (ms) | runtime, hexiseq kernels (ms) | "
             "SDPA flash alone (ms) | SDPA cuDNN alone (ms) | flash blocks / SDPA flash | cuDNN blocks / SDPA cuDNN | "
             "hexiseq kernels / SDPA flash |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['flash']:.2f} | {r['cudnn']:.2f} | {r['hexiseq']:.2f} | {r['sdpa_flash']:.2f} | "
                     f"{r['sdpa_cudnn']:.2f} | {r['flash'] / r['sdpa_flash']:.2f} | {r['cudnn'] / r['sdpa_cudnn']:.2f} | "
                     f"{r['hexiseq'] / r['sdpa_flash']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# The runtime on one GPU: forward+backward per block implementation vs SDPA flash\n\n"
                    f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16, causal, batch 1, "
                    f"{H} query heads, {Hkv} kv heads, head dim {D}; one-rank NCCL group; CUDA-event medians of "
                    f"{args.iters} forward+backward steps (measured).\n\n{table}\n")


if __name__ == "__main__":
    main()
