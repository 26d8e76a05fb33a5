#!/usr/bin/env bash
# Creates (or reuses) .venv and installs the project with the given extras, showing pip's progress.
# Usage: bash scripts/setup_env.sh [extras]     e.g. "dev,train"; none: what rollout-serve needs
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
step() { echo "==> setup_env: $*"; }
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  step "creating $ROOT/.venv with $("$PY" --version 2>&1)"
  "$PY" -m venv "$ROOT/.venv"
else
  step "reusing $ROOT/.venv"
fi
VPY="$ROOT/.venv/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar on)
step "upgrading pip"
"${PIP[@]}" --upgrade pip
# NOTE: install the pinned CPU torch first when none is present: an unpinned torch (or one pulled
# in as a dependency) would download a multi-GB CUDA build.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  step "installing torch==2.13.0 (no torch in .venv yet; GPU users install their CUDA torch first)"
  "${PIP[@]}" "torch==2.13.0"
else
  step "keeping the installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
fi
step "installing the project${EXTRAS:+ with extras [$EXTRAS]} (editable)"
if [ -n "$EXTRAS" ]; then
  DS_BUILD_OPS=0 "${PIP[@]}" -e "$ROOT[$EXTRAS]"
else
  "${PIP[@]}" -e "$ROOT"
fi
step "done: $ROOT/.venv/bin/rollout-serve --help lists the server's flags"
