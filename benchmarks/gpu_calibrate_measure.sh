#!/usr/bin/env bash
# calibrate -> plan -> measure on one GPU (one-rank NCCL group): a Llama-3.2-3B-shaped model (benchmarks/data/llama32-3b.json)
# at 8K and 16K tokens and gpt-3b at 32K, each with activation checkpointing; the attention layer and a whole Llama layer.
# Run from the repository root on a GPU machine: bash benchmarks/gpu_calibrate_measure.sh (results in $OUT, else /tmp/out).
# HEXISEQ_CUDA=0 (the default here) builds without the CUDA kernels: on an H100 calibrate picks torch's cuDNN op anyway.
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
T0=$SECONDS
exec > >(tee "$R/calmeasure.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
export PYTHONPATH=$PWD
HEXISEQ_CUDA=${HEXISEQ_CUDA:-0} timeout 300 python setup.py build_ext --inplace > "$R/build.log" 2>&1 || { tail -30 "$R/build.log"; exit 1; }
python -c "import hexiseq; print(hexiseq.build_info())"
echo "built ($((SECONDS - T0)) s)"
run() { local name=$1 model=$2 seq=$3
  echo "=== $name seq $seq ($((SECONDS - T0)) s)"
  [ -f "$R/cal_$name.yaml" ] || timeout 150 python -m hexiseq calibrate --model "$model" --out "$R/cal_$name.yaml" || return
  timeout 60 python -m hexiseq plan "$R/cal_$name.yaml" --model "$model" --seq-len "$seq" --checkpointing --json > "$R/plan_${name}_$seq.json" || return
  for L in attention llama; do
    timeout 90 torchrun --nproc-per-node 1 -m hexiseq measure "$R/plan_${name}_$seq.json" --layer $L --iters 10 --warmup 3 --json > "$R/measure_${name}_${seq}_$L.json"
    python - "$R/measure_${name}_${seq}_$L.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit('/', 1)[-1], {k: v for k, v in d.items() if not isinstance(v, (list, dict))})
PY
  done
}
run llama32-3b benchmarks/data/llama32-3b.json 8k
run llama32-3b benchmarks/data/llama32-3b.json 16k
run gpt-3b gpt-3b 32k
echo "done ($((SECONDS - T0)) s)"
