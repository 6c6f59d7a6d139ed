#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): set up, pull the two small real models the
# real-model tests use, then run the whole suite (unit, stat, e2e). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
specserve pull smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
