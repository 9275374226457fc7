#!/usr/bin/env python3
"""CPU attention benchmark: HexiSeq's fp32 C kernels against torch SDPA, forward and forward+backward.

Builds nothing into the package. It compiles a small C timing driver with gcc, using the flags setup.py
uses for csrc (-std=c11 -O3 -fopenmp, no -march), linking csrc/common/status.c and csrc/attention/'s
attention_check.c, attention_cpu.c and attention_simd.c, in a temporary directory; then, per shape, runs that driver
and a torch script, each in a fresh subprocess (2 threads), and prints a markdown table.

Timing: one warm-up call, then the median of --reps calls (default 5). Ours: forward is
hexiseq_attn_forward_cpu; forward+backward is forward then hexiseq_attn_backward_cpu. torch:
F.scaled_dot_product_attention on [B, A, S, d] fp32 tensors, and for fwd+bwd, out.backward(dout).

Peak memory: the growth of VmHWM (peak resident set, /proc/self/status; ru_maxrss as a fallback) of the measuring process from just after the
inputs (q, k, v, and dout for fwd+bwd) are allocated and written, to the end of the timed calls. It
therefore counts outputs (o and lse; plus dq, dk, dv) and all scratch, for both sides alike.

Usage: python benchmarks/bench_cpu_attention.py [--reps N] [--grid quick|default|full]
(quick: S=2048, A=8; default: S in {2048, 4096}, A=8; full: S in {2048, 4096, 8192}, A in {8, 16};
all with d in {64, 128}, causal and not)
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS = 2

DRIVER_C = r"""/* Timing driver: fp32 attention forward and forward+backward, [B=1, S, A, d] contiguous. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>
#include <sys/resource.h>
#include "attention.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* Peak resident set of this process image: VmHWM (reset at exec, unlike ru_maxrss, which keeps the
 * parent's peak across fork + exec); ru_maxrss where /proc is missing. */
static long maxrss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (f != NULL) {
        char line[256];
        long kb = -1;
        while (fgets(line, sizeof line, f) != NULL)
            if (sscanf(line, "VmHWM: %ld", &kb) == 1)
                break;
        fclose(f);
        if (kb >= 0)
            return kb;
    }
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_maxrss;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static float *randn(size_t n, unsigned *seed) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; ++i) { *seed = *seed * 1664525u + 1013904223u; x[i] = ((*seed >> 8) * (1.0f / 16777216.0f)) * 2.0f - 1.0f; }
    return x;
}
int main(int argc, char **argv) {
    if (argc < 7) { fprintf(stderr, "usage: S A d causal mode(0 fwd, 1 fwd+bwd) reps\n"); return 2; }
    const long S = atol(argv[1]); const int A = atoi(argv[2]), d = atoi(argv[3]), causal = atoi(argv[4]);
    const int mode = atoi(argv[5]), reps = atoi(argv[6]);
    const size_t n = (size_t)S * A * d;
    unsigned seed = 12345u;
    float *q = randn(n, &seed), *k = randn(n, &seed), *v = randn(n, &seed), *dout = mode ? randn(n, &seed) : NULL;
    const long base = maxrss_kb();
    float *o = malloc(n * sizeof *o), *lse = malloc((size_t)S * A * sizeof *lse);
    float *dq = mode ? malloc(n * sizeof *dq) : NULL, *dk = mode ? malloc(n * sizeof *dk) : NULL, *dv = mode ? malloc(n * sizeof *dv) : NULL;
    hexiseq_attn_params p;
    memset(&p, 0, sizeof p);
    p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse; p.do_ = dout; p.dq = dq; p.dk = dk; p.dv = dv;
    const int64_t st[4] = {S * A * d, (int64_t)A * d, d, 1};
    memcpy(p.q_stride, st, sizeof st); memcpy(p.k_stride, st, sizeof st); memcpy(p.v_stride, st, sizeof st);
    memcpy(p.o_stride, st, sizeof st); memcpy(p.do_stride, st, sizeof st); memcpy(p.dq_stride, st, sizeof st);
    memcpy(p.dk_stride, st, sizeof st); memcpy(p.dv_stride, st, sizeof st);
    p.lse_stride[0] = (int64_t)A * S; p.lse_stride[1] = S; p.lse_stride[2] = 1;
    p.batch = 1; p.seq_q = S; p.seq_k = S; p.scale = 1.0 / sqrt((double)d);
    p.heads = A; p.kv_heads = A; p.head_dim = d; p.causal = causal; p.dtype = HEXISEQ_DTYPE_F32;
    double *t = malloc(sizeof(double) * (size_t)(reps + 1));
    for (int r = 0; r <= reps; ++r) { /* r = 0 is the warm-up */
        const double t0 = now();
        if (hexiseq_attn_forward_cpu(&p) != HEXISEQ_OK) { fprintf(stderr, "forward failed\n"); return 1; }
        if (mode && hexiseq_attn_backward_cpu(&p) != HEXISEQ_OK) { fprintf(stderr, "backward failed\n"); return 1; }
        t[r] = now() - t0;
    }
    qsort(t + 1, (size_t)reps, sizeof *t, cmp);
    double chk = 0;
    for (size_t i = 0; i < n; i += 997) chk += o[i] + (mode ? dq[i] + dk[i] + dv[i] : 0);
    printf("median_ms %.3f peak_delta_kb %ld checksum %.6g\n", 1e3 * t[1 + reps / 2], maxrss_kb() - base, chk);
    return 0;
}
"""

TORCH_SNIPPET = r"""
import resource, statistics, sys, time
import torch
import torch.nn.functional as F
S, A, d, causal, mode, reps = (int(x) for x in sys.argv[1:7])
torch.set_num_threads(%(threads)d)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.rand(1, A, S, d, generator=g) * 2 - 1 for _ in range(3))
dout = torch.rand(1, A, S, d, generator=g) * 2 - 1 if mode else None
if mode:
    for t in (q, k, v):
        t.requires_grad_(True)
def peak_kb():
    # VmHWM: peak RSS of this process image (ru_maxrss would include the parent's peak before exec)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = peak_kb()
times = []
for r in range(reps + 1):
    t0 = time.perf_counter()
    if mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None
        del out
    else:
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        del out
    times.append(time.perf_counter() - t0)
peak = peak_kb() - base
print("median_ms %%.3f peak_delta_kb %%d" %% (1e3 * statistics.median(times[1:]), peak))
""" % {"threads": THREADS}


def build_driver(tmp):
    src = os.path.join(tmp, "driver.c")
    exe = os.path.join(tmp, "attn_driver")
    with open(src, "w") as f:
        f.write(DRIVER_C)
    common, attention = os.path.join(ROOT, "csrc", "common"), os.path.join(ROOT, "csrc", "attention")
    cmd = ["gcc", "-std=c11", "-O3", "-fopenmp", "-I" + common, "-I" + attention,
           os.path.join(common, "status.c"), os.path.join(attention, "attention_check.c"),
           os.path.join(attention, "attention_cpu.c"), os.path.join(attention, "attention_simd.c"), src,
           "-lm", "-o", exe]
    subprocess.run(cmd, check=True)
    return exe


def parse(out):
    words = out.split()
    return float(words[words.index("median_ms") + 1]), int(words[words.index("peak_delta_kb") + 1])


def run_ours(exe, S, A, d, causal, mode, reps):
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    out = subprocess.run([exe, str(S), str(A), str(d), str(causal), str(mode), str(reps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return parse(out)


def run_torch(S, A, d, causal, mode, reps):
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    out = subprocess.run([sys.executable, "-c", TORCH_SNIPPET, str(S), str(A), str(d), str(causal), str(mode),
                          str(reps)], env=env, check=True, capture_output=True, text=True).stdout
    return parse(out)


def shapes(grid):
    out = []
    # default: S 2048 and 4096 at A = 8 (about 3 minutes); full adds A = 16 and S = 8192 (much longer)
    seqs = {"quick": [2048], "default": [2048, 4096], "full": [2048, 4096, 8192]}[grid]
    for S in seqs:
        for A in (8, 16):
            if grid != "full" and A == 16:
                continue
            for d in (64, 128):
                for causal in (1, 0):
                    out.append((S, A, d, causal))
    return out


def mib(kb):
    return "%.1f" % (kb / 1024.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (median reported)")
    ap.add_argument("--grid", choices=["quick", "default", "full"], default="default")
    args = ap.parse_args()
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        sys.exit("torch is not installed (pip install torch==2.13.0)")
    print("# fp32 CPU attention, B=1, %d threads, torch %s, median of %d after 1 warm-up" % (THREADS, torch_version,
                                                                                           args.reps))
    print("# ratio = torch ms / ours ms (> 1: ours is faster); peak = growth of peak RSS (VmHWM) in a fresh process "
          "after the inputs exist (outputs + scratch), MiB")
    print()
    print("| S | A | d | causal | ours fwd ms | torch fwd ms | fwd ratio | ours f+b ms | torch f+b ms | f+b ratio "
          "| ours peak fwd / f+b MiB | torch peak fwd / f+b MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_driver(tmp)
        for S, A, d, causal in shapes(args.grid):
            of, ofm = run_ours(exe, S, A, d, causal, 0, args.reps)
            tf, tfm = run_torch(S, A, d, causal, 0, args.reps)
            ob, obm = run_ours(exe, S, A, d, causal, 1, args.reps)
            tb, tbm = run_torch(S, A, d, causal, 1, args.reps)
            print("| %d | %d | %d | %s | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %s / %s | %s / %s |" % (
                S, A, d, "yes" if causal else "no", of, tf, tf / of, ob, tb, tb / ob, mib(ofm), mib(obm), mib(tfm),
                mib(tbm)))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
