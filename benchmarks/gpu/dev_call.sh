#!/bin/bash
# One development call on the GPU machine (docs/gpu-notes.md): environment, the CUDA tests, the
# random-weight dev check, and a smoke run of the benchmark script. Logs go to $OUT.
#   bash benchmarks/gpu/dev_call.sh DATA_DIR   (DATA_DIR: config_0.5b.json, tok/, prompts_smoke.json)
DATA=${1:?data folder}
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, transformers, numpy; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'numpy', numpy.__version__)"; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stamp "tests"
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider tests/cuda tests/unit/test_step_buckets.py \
  --durations=8 > "$OUT/tests_cuda.txt" 2>&1
tail -15 "$OUT/tests_cuda.txt"
stamp "dev check"
timeout "${DEV_TIMEOUT:-250}" python3 benchmarks/gpu/dev_check.py --config-0_5b "$DATA/config_0.5b.json" \
  --config-1_5b "$DATA/config_1.5b.json" \
  --tokenizer "$DATA/tok" --out "$OUT" --models "${MODELS:-0.5b,1.5b}" > "$OUT/dev_check.log" 2>&1
grep -v "^\(0.5b\|1.5b\) {" "$OUT/dev_check.log" | tail -30
stamp "bench smoke"
if [ -n "$RUN_SMOKE" ] && [ -d /tmp/devcheck/1.5b ] && [ -d /tmp/devcheck/0.5b ]; then
  timeout "${SMOKE_TIMEOUT:-110}" python3 benchmarks/gpu/bench_gpu.py run --prompts "$DATA/prompts_smoke.json" \
    --model /tmp/devcheck/1.5b:/tmp/devcheck/0.5b --hf-prompts 1 --hf-max-tokens 16 --c16-requests 16 \
    --out "$OUT/bench_smoke.json" > "$OUT/bench_smoke.log" 2>&1
  tail -14 "$OUT/bench_smoke.log"
fi
stamp "done"
