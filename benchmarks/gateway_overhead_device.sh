#!/usr/bin/env bash
# The gateway overhead benchmark (issue 13) on a quiet many-core machine, pinned to 2 cores.
#
# Run from the repo root, with the wheels of what that machine lacks in .whl/ (fastapi, starlette,
# uvicorn, httptools, uvloop, pydantic(-core), annotated-types, typing-inspection, typing-extensions,
# opentelemetry-api, anyio, aiohttp and its parts, prometheus-client, annotated-doc: the versions this
# repo's venv runs, so both machines measure the same stack; see docs/benchmarks/README.md):
#
#     OUT=/some/dir bash benchmarks/gateway_overhead_device.sh
#
# Installs the wheels into /tmp/site, then runs benchmarks/gateway_overhead.py (stub, gateway and
# client: all three processes) under `taskset -c $CORES` (default 0,1: the issue's "2 cores"), at 100
# requests/s, streamed and not, and writes $OUT/gateway_overhead_<TAG>.json and $OUT/log.
# Knobs (environment): RUNS (3), REPEATS (3 block pairs per mode), BLOCK_S (10), CORES (0,1),
# TAG (h200host_2cores), TRACE (1: also benchmarks/gateway_trace.py, ~95 s, to $OUT/gateway_trace_<TAG>.json).
# About 130 s per run with the defaults, plus ~20 s to install: RUNS=3 fits a 600 s call, RUNS=2 with TRACE=1 too.
set -euo pipefail
OUT=${OUT:?set OUT to the output folder}
RUNS=${RUNS:-3}
REPEATS=${REPEATS:-3}
BLOCK_S=${BLOCK_S:-10}
CORES=${CORES:-0,1}
TAG=${TAG:-h200host_2cores}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# what will be measured: versions, and that the gateway, the stub and the client all import
"$PY" - <<'EOF'
import importlib.metadata as md, os, platform
import specserve.cli, specserve.gateway.app, tests.helpers.stub_backend  # noqa: F401  (fails here, not later)
names = ["aiohttp", "uvicorn", "uvloop", "httptools", "fastapi", "starlette", "pydantic", "prometheus_client",
         "numpy", "httpx", "PyYAML"]
print("python", platform.python_version(), "cpus", os.cpu_count(),
      {n: md.version(n) for n in names})
EOF
echo "pinning to cores $CORES (SMT siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null || echo unknown))"
echo "load average before: $(cat /proc/loadavg)"
if command -v taskset > /dev/null; then
    PIN=(taskset -c "$CORES")
else  # (no util-linux: the same pinning through Python; children inherit it)
    PIN=("$PY" -c 'import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")}); os.execvp(sys.argv[2], sys.argv[2:])' "$CORES")
fi
"${PIN[@]}" "$PY" benchmarks/gateway_overhead.py --runs "$RUNS" --repeats "$REPEATS" --block-s "$BLOCK_S" \
    --rate 100 --tag "$TAG" --out "$OUT"
echo "load average after: $(cat /proc/loadavg)"
if [ "${TRACE:-0}" = 1 ]; then  # the traced run too (~95 s): where a slow request's time went, per process
    "${PIN[@]}" "$PY" benchmarks/gateway_trace.py --block-s 10 --repeats 2 --out "$OUT/gateway_trace_$TAG.json"
fi
