#!/usr/bin/env bash
# The GPU check of issue 13 on one GPU (made for one H200; needs nothing from the network):
#   bash scripts/gpu_check.sh OUT_DIR            # pytest -m gpu + benchmark, < 8 minutes
#   bash scripts/gpu_check.sh OUT_DIR --smoke    # the same code on the CPU, tiny shape, Triton interpreter
# Writes OUT_DIR/gpu_check.md (a table), OUT_DIR/gpu_check.json, pytest_gpu.{xml,log}.
# Python: $PYTHON, else .venv/bin/python when present, else python3.
set -u
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--smoke]}
shift
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
mkdir -p "$out"
limit=470
case " $* " in *" --smoke "*) limit=1200 ;; esac
# NOTE: a hard stop below the 8 minutes; every row is written as soon as it exists
timeout -k 10 "$limit" "$py" scripts/gpu_check.py --out "$out" "$@"
rc=$?
[ -f "$out/gpu_check.md" ] && cat "$out/gpu_check.md"
exit $rc
