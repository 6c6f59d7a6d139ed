# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything specserve needs.
# On a machine without CUDA it installs torch==2.13.0 (the small CPU build where pip can find it, see the
# README); a torch already in the environment is kept. Safe to run again: it skips what is done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.specserve-setup-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing dependencies (first run: about a minute)" >&2
  python -m pip install -q --upgrade pip >/dev/null
  if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      python -m pip install -q torch
    else
      python -m pip install -q torch==2.13.0
    fi
  fi
  python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
