#!/usr/bin/env bash
# GPU session checks of the CUDA attention kernels, run from the repo root on a GPU machine:
#   bash benchmarks/run_gpu_checks.sh
# Builds hexiseq with nvcc (no package index needed), runs the CUDA and CPU op tests, compute-sanitizer memcheck
# on one small forward+backward, and the benchmark (Markdown to $OUT if set, else benchmarks/results/).
# Budget: ~9 minutes (build ~1, tests ~3-4, sanitizer <1, benchmark ~3). Every step runs even if one fails;
# the exit status is that of the first failure.
set -u
cd "$(dirname "$0")/.."
# the CUDA kernels are opt-in until these checks pass on a GPU
export HEXISEQ_CUDA_KERNELS=1
status=0
step() { echo; echo "=== $* ==="; }
note_fail() { local rc=$1; echo "!!! step failed with status $rc"; [ "$status" -eq 0 ] && status=$rc; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
ARCH=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
echo "compute capability: $ARCH"

step "build (HEXISEQ_CUDA_ARCHS=${HEXISEQ_CUDA_ARCHS:-80;90})"
timeout 300 pip install --no-build-isolation --no-deps -v -e . > /tmp/hexiseq_build.log 2>&1 || note_fail $?
grep -E "nvcc|error|warning" /tmp/hexiseq_build.log | grep -v "^ *$" | tail -20
python -c "import hexiseq; info = hexiseq.build_info(); n = hexiseq.cuda_device_count(); print(info, 'devices', n); assert info['cuda'] and n > 0" \
    || note_fail $?

step "tests: tests/test_cuda_ops.py tests/test_ops.py"
timeout 300 python -m pytest -q -x -rs tests/test_cuda_ops.py tests/test_ops.py 2>&1 | tail -40
rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || note_fail "$rc"

step "compute-sanitizer memcheck (small forward + backward)"
cat > /tmp/hexiseq_sanitize.py <<'EOF'
import torch
from hexiseq import ops
for dtype, D, causal, sq, sk, qp, kp in ((torch.bfloat16, 64, True, 97, 130, 40, 0),
                                         (torch.float16, 128, False, 33, 65, 0, 0),
                                         (torch.bfloat16, 80, True, 70, 40, 0, 10),
                                         (torch.float16, 256, True, 40, 50, 10, 0)):
    q = torch.randn(2, sq, 4, D, device="cuda", dtype=dtype)
    k = torch.randn(2, sk, 2, D, device="cuda", dtype=dtype)
    v = torch.randn(2, sk, 2, D, device="cuda", dtype=dtype)
    out, lse = ops.attention_forward(q, k, v, causal=causal, q_pos0=qp, k_pos0=kp)
    ops.attention_backward(q, k, v, out, lse, torch.randn_like(q), causal=causal, q_pos0=qp, k_pos0=kp)
    acc, acc_lse = out.float(), lse.clone()
    ops.merge_(acc, acc_lse, out, lse)
torch.cuda.synchronize()
print("sanitizer case ran")
EOF
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$SAN" ]; then
    for tool in memcheck racecheck; do
        timeout 180 "$SAN" --tool $tool --error-exitcode 3 python /tmp/hexiseq_sanitize.py 2>&1 | tail -15
        rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || note_fail "$rc"
    done
else
    echo "compute-sanitizer not found"; note_fail 4
fi

step "benchmark"
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
timeout 240 python benchmarks/bench_cuda_attention.py --out "$RESULTS/cuda_attention.md" || note_fail $?

echo; echo "=== done: status $status ==="
exit $status
