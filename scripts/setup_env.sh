#!/usr/bin/env bash
# Creates (or reuses) .venv and installs the project with the given extras.
# Usage: source scripts/setup_env.sh [extras]   e.g. "dev,train"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
VPY="$ROOT/.venv/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null
# NOTE: install the pinned CPU torch first when none is present: an unpinned torch (or one pulled
# in as a dependency) would download a multi-GB CUDA build.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
if [ -n "$EXTRAS" ]; then
  DS_BUILD_OPS=0 "$VPY" -m pip install -q -e "$ROOT[$EXTRAS]"
else
  "$VPY" -m pip install -q -e "$ROOT"
fi
