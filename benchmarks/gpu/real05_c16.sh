#!/bin/bash
# The last call of a real-weight session on the GPU machine (docs/gpu-notes.md, session 8): assemble the
# qwen2.5-coder-0.5b GGUF from the parts copied into /root/models by the earlier calls (9 x 55 MiB:
# `split -b 55m -d -a 2 q05.gguf part`), convert it, then 16 concurrent requests repeated per profile
# (c16_reps.py: baseline, ngram, suffix and both adaptive profiles, 5 reps) and the per-step diagnosis
# (adaptive_diag.py). Data (prompts.json from `bench_gpu.py prepare`) in $1 (default /root/gpudata);
# gguf on PYTHONPATH from /root/site. Results go to $OUT.
#   [PROFILES=a,b REQUESTS=96 REPS=5 C16_TIMEOUT=330 SKIP_DIAG=1] bash benchmarks/gpu/real05_c16.sh [DATA_DIR]
set -o pipefail
DATA=${1:-/root/gpudata}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
(cd /root/models && cat part0? > q05.gguf && sha256sum q05.gguf) || exit 1
cd "$REPO" || exit 1
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1 SPECSERVE_HOME=${SPECSERVE_HOME:-/root/ss}
python3 -c "from specserve.hub import resolve_model; print(resolve_model('/root/models/q05.gguf'))" 2>&1 | tail -2
M=qwen2.5-coder-0.5b-instruct
PROFILES=${PROFILES:-baseline,ngram,suffix,ngram_adaptive,suffix_adaptive}
timeout ${C16_TIMEOUT:-330} python3 benchmarks/gpu/c16_reps.py --prompts "$DATA/prompts.json" --model $M --modes default \
  --profiles $PROFILES --requests ${REQUESTS:-96} --reps ${REPS:-5} \
  --out "$OUT/c16_reps.json" 2>&1 | grep -v Warning | tee "$OUT/c16.log" | tail -25
[ -n "$SKIP_DIAG" ] && exit 0
timeout 150 python3 benchmarks/gpu/adaptive_diag.py --prompts "$DATA/prompts.json" --model $M \
  --profiles baseline,ngram_adaptive,suffix_adaptive --out "$OUT/diag_real.json" 2>&1 | grep -v Warning \
  | tee "$OUT/diag.log" | tail -8
