#!/bin/bash
# The last call of a real-weight session on the GPU machine (docs/gpu-notes.md): 16 concurrent requests
# repeated per profile (c16_reps.py: bench_gpu.py's c16 profiles, every rep each profile back to back,
# rotated) and, unless SKIP_DIAG is set, the per-step diagnosis (adaptive_diag.py). The models must be
# converted already (assemble_gguf.sh; this waits up to 300 s for the .done or .failed files of those
# named in WAIT, e.g. WAIT="q05 q15"). MODEL is TARGET[:DRAFT] by catalog name; data (prompts.json from
# `bench_gpu.py prepare`) in $1 (default /root/gpudata); gguf on PYTHONPATH from /root/site.
# Results go to $OUT.
#   [MODEL=qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct] [PROFILES=a,b] [REQUESTS=96] [REPS=5]
#   [C16_TIMEOUT=330] [SKIP_DIAG=1] [DIAG_PROFILES=baseline,draft_model_adaptive] [DIAG_TIMEOUT=150]
#   [WAIT="q05 q15"] bash benchmarks/gpu/real_c16.sh [DATA_DIR]
set -o pipefail
DATA=${1:-/root/gpudata}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for n in $WAIT; do
  for _ in $(seq 300); do [ -e "/root/models/$n.done" ] || [ -e "/root/models/$n.failed" ] && break; sleep 1; done
  [ -e "/root/models/$n.done" ] || { echo "$n was not converted (see its assemble_gguf.sh log)"; exit 1; }
done
cd "$REPO" || exit 1
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1 SPECSERVE_HOME=${SPECSERVE_HOME:-/root/ss}
M=${MODEL:-qwen2.5-coder-0.5b-instruct}
TAG=$(echo "${M%%:*}" | tr -c 'a-z0-9.\n' '_')
PROFILES=${PROFILES:-baseline,ngram,suffix,ngram_adaptive,suffix_adaptive}
timeout ${C16_TIMEOUT:-330} python3 benchmarks/gpu/c16_reps.py --prompts "$DATA/prompts.json" --model "$M" --modes default \
  --profiles "$PROFILES" --requests ${REQUESTS:-96} --reps ${REPS:-5} \
  --out "$OUT/c16_reps_$TAG.json" 2>&1 | grep -v Warning | tee "$OUT/c16_$TAG.log" | tail -25
[ -n "$SKIP_DIAG" ] && exit 0
timeout ${DIAG_TIMEOUT:-150} python3 benchmarks/gpu/adaptive_diag.py --prompts "$DATA/prompts.json" --model "$M" \
  --profiles ${DIAG_PROFILES:-baseline,ngram_adaptive,suffix_adaptive} --out "$OUT/diag_$TAG.json" 2>&1 | grep -v Warning \
  | tee "$OUT/diag_$TAG.log" | tail -8
