#!/usr/bin/env bash
# GPU session checks of the CUDA attention kernels and the NCCL runtime, run from the repo root on a GPU machine:
#   bash benchmarks/run_gpu_checks.sh [steps]      steps: any of build tests split sanitize accept bench variants gqa backends calibrate runtime memory profile
#                                                 (default: all, in that order)
# Builds hexiseq in place with nvcc (no package index needed), runs the CUDA, CPU-op and block-path tests (the runtime on a
# one-rank NCCL group among them), compute-sanitizer memcheck/racecheck/synccheck on forward, backward and merge at
# head dims 64, 128 and 256, an external acceptance check when one is present at .gpu/acceptance.py, the
# benchmark against torch SDPA's flash backend, and an Nsight Compute profile of one forward and one backward.
# Everything lands in $OUT (or benchmarks/results/gpu/ when unset); the full log is $OUT/gpu_checks.log.
# BWD_KERNELS=staged,register and FWD_KEYS=64,32 time those kernel variants side by side in the benchmark;
# SAN_TOOLS=memcheck (say) runs only those compute-sanitizer tools.
# Every step runs even if one fails; the exit status is that of the first failure. Budget: under 10 minutes.
set -u
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_checks.log") 2>&1
STEPS=${*:-build tests split sanitize accept bench variants gqa backends calibrate runtime memory profile}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
want() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
T0=$SECONDS
step() { echo; echo "=== $* ($((SECONDS - T0)) s) ==="; }
note_fail() { local rc=$1; echo "!!! step failed with status $rc"; [ "$status" -eq 0 ] && status=$rc; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
ARCH=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
echo "compute capability: $ARCH"

if want build; then
    step "build (HEXISEQ_CUDA_ARCHS=${HEXISEQ_CUDA_ARCHS:=$ARCH})"
    export HEXISEQ_CUDA_ARCHS
    # in place with the interpreter that holds torch (a bare `pip` may belong to another Python)
    timeout 300 python setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1 || note_fail $?
    grep -E "error|warning" "$RESULTS/build.log" | tail -20
fi
python -c "import hexiseq; info = hexiseq.build_info(); n = hexiseq.cuda_device_count(); print(info, 'devices', n); assert info['cuda'] and n > 0" \
    || note_fail $?

if want tests; then
    TESTS="tests/test_cuda_ops.py tests/test_attention_ops.py tests/test_cuda_loader.py tests/test_torch_blocks.py tests/test_ops.py tests/test_fused.py"
    step "tests: $TESTS"
    timeout 300 python -m pytest -q -rfEs -p no:cacheprovider --durations=5 $TESTS > "$RESULTS/pytest.log" 2>&1
    rc=$?; [ "$rc" -eq 0 ] || note_fail "$rc"
    sed -n '/short test summary/,$p' "$RESULTS/pytest.log"; tail -1 "$RESULTS/pytest.log"
fi

if want split; then
    step "the forward's split of key blocks past 2^16 keys, against float64"
    timeout 120 python benchmarks/gpu_split_and_documents.py || note_fail $?
fi

if want sanitize; then
    step "compute-sanitizer: memcheck, racecheck, synccheck; forward, backward, merge at head dims 64/128/256"
    cat > /tmp/hexiseq_sanitize.py <<'PY'
import torch
from hexiseq import ops
# odd lengths, GQA, ring offsets (partly visible and fully masked rows), both dtypes, every head-dim kernel
for dtype, D, causal, sq, sk, qp, kp in ((torch.bfloat16, 64, True, 97, 130, 40, 0),
                                         (torch.float16, 64, False, 65, 33, 0, 0),
                                         (torch.float16, 128, False, 33, 65, 0, 0),
                                         (torch.bfloat16, 128, True, 130, 97, 0, 20),
                                         (torch.bfloat16, 80, True, 70, 40, 0, 10),
                                         (torch.float16, 256, True, 40, 50, 10, 0),
                                         (torch.bfloat16, 256, False, 71, 129, 0, 0)):
    q = torch.randn(2, sq, 4, D, device="cuda", dtype=dtype)
    k = torch.randn(2, sk, 2, D, device="cuda", dtype=dtype)
    v = torch.randn(2, sk, 2, D, device="cuda", dtype=dtype)
    out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=kp)
    ops.attention_backward(q, k, v, out, lse, torch.randn_like(q), causal=causal, q_pos0=qp, k_pos0=kp)
    acc, acc_lse = out.float(), lse.clone()
    ops.merge_(acc, acc_lse, out, lse)
torch.cuda.synchronize()
print("sanitizer cases ran")
PY
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    if [ -n "$SAN" ]; then
        for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
            echo "--- $tool"
            timeout 200 "$SAN" --tool $tool --error-exitcode 3 python /tmp/hexiseq_sanitize.py 2>&1 | tail -8
            rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || note_fail "$rc"
            echo "--- $tool, windows and soft-capping"
            timeout 200 "$SAN" --tool $tool --error-exitcode 3 python benchmarks/gpu_variants.py --sanitize 2>&1 | tail -3
            rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || note_fail "$rc"
            echo "--- $tool, document mask"
            timeout 200 "$SAN" --tool $tool --error-exitcode 3 python benchmarks/gpu_split_and_documents.py --docs 2>&1 | tail -3
            rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || note_fail "$rc"
        done
    else
        echo "compute-sanitizer not found"; note_fail 4
    fi
fi

if want accept && [ -f .gpu/acceptance.py ]; then
    step "acceptance check (.gpu/acceptance.py)"
    OUT=$RESULTS timeout 240 python .gpu/acceptance.py > "$RESULTS/acceptance.log" 2>&1 || note_fail $?
    grep -E "FAILED|ok': False|error" "$RESULTS/acceptance.log" | head -20
    grep SPEED "$RESULTS/acceptance.log"
    tail -1 "$RESULTS/acceptance.log"
fi

if want bench; then
    step "benchmark vs torch SDPA flash"
    timeout 300 python benchmarks/bench_cuda_attention.py --bwd-kernels ${BWD_KERNELS:-auto} --fwd-keys ${FWD_KEYS:-auto} --out "$RESULTS/cuda_attention.md" || note_fail $?
fi

if want variants; then
    step "attention variants: sliding window and soft-capping vs the plain causal kernels and SDPA flash"
    timeout 200 python benchmarks/gpu_variants.py --out "$RESULTS/variants.md" || note_fail $?
fi

if want gqa; then
    step "the backward with GQA: query heads split over CTAs vs one CTA per group, and torch's flash backward"
    timeout 200 python benchmarks/gpu_gqa_backward.py --out "$RESULTS/gqa_backward.md" || note_fail $?
fi

if want backends; then
    step "block backends side by side: hexiseq, torch flash, torch cuDNN; documents: hexiseq vs varlen flash"
    timeout 200 python benchmarks/bench_block_backends.py --out "$RESULTS" || note_fail $?
fi

if want calibrate; then
    step "calibrate on a one-rank NCCL group: the block backends chosen for the model's head shape, and the curves timed through them"
    RESULTS=$RESULTS timeout 200 python - <<'PY' || note_fail $?
import os, tempfile
import torch.distributed as dist
import hexiseq
dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
try:
    for model in ("llama3-8b", "gpt-7b"):
        c = hexiseq.calibrate(model, attn_blocks=[1024, 4096, 16384], gemm_rows=[2048], iters=3,
                              out=os.path.join(os.environ["RESULTS"], f"calibrated_{model}.yaml"), progress=False)
        cal = c.calibration
        print(model, "heads", cal["attn_heads"], "/", cal["attn_kv_heads"], "head_dim", cal["head_dim"],
              "block backends", cal["block_backends"], flush=True)
finally:
    dist.destroy_process_group()
PY
fi

if want runtime; then
    step "the runtime on a one-rank NCCL group, per block implementation, vs SDPA flash"
    timeout 200 python benchmarks/bench_runtime_gpu.py --out "$RESULTS/runtime_gpu.md" || note_fail $?
fi

if want memory; then
    step "memory features: peak memory saved (measured vs the cost model) and their time, one GPU"
    timeout 200 python benchmarks/gpu_memory_features.py --out "$RESULTS/memory_features.md" || note_fail $?
fi

if want profile; then
    step "Nsight Compute: one forward and one backward (B=1 H=16 S=8192 D=128 causal)"
    cat > /tmp/hexiseq_profile.py <<'PY'
import torch
from hexiseq import ops
q, k, v = (torch.randn(1, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = ops.attention_forward(q, k, v, causal=True)
ops.attention_backward(q, k, v, out, lse, torch.randn_like(q), causal=True)
torch.cuda.synchronize()
PY
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
    if [ -n "$NCU" ]; then
        timeout 200 "$NCU" --clock-control none --set full -k "regex:attn_(fwd|bwd_mma|bwd_staged)_kernel" \
            python /tmp/hexiseq_profile.py > "$RESULTS/ncu.txt" 2>&1 || note_fail $?
        grep -E "^  attn|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|L1/TEX Hit|L2 Hit|Local" "$RESULTS/ncu.txt" | head -60
    else
        echo "ncu not found"
    fi
fi

echo; echo "=== done: status $status ($((SECONDS - T0)) s) ==="
exit $status
