#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): set up, pull the two small real models the
# real-model tests use, then run the whole suite (unit, stat, e2e). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
specserve pull smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
# The HTML report test renders the report in headless Chromium (it skips without one). Best effort:
# install Debian's chromium where we are root with apt-get; never fail the run over it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[test] installing chromium for the report rendering test" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[test] chromium could not be installed; the report rendering test will be skipped" >&2
fi
python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
