#!/usr/bin/env bash
# The README's first command: set up (.venv, CPU torch on a CPU machine, the package), then run the
# one-command demo: pull the default model, serve baseline + speculative profiles, benchmark them on
# real workload segments, print the comparison, write out/demo/report.html. Arguments go to
# `specserve demo` (e.g. --num-prompts 5 --max-tokens 128; see `specserve demo --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
exec specserve demo "$@"
