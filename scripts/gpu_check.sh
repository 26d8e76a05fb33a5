#!/usr/bin/env bash
# The GPU check on one GPU (made for one H200 and its device image; needs nothing from the network):
#   bash scripts/gpu_check_prepare.sh               # HERE, where pip reaches PyPI: the wheels to carry
#   bash scripts/gpu_check.sh OUT_DIR               # THERE, with .whl/ carried: < 9 minutes in all
#   bash scripts/gpu_check.sh OUT_DIR --smoke       # the same code on the CPU, tiny shape, Triton interpreter
# Steps, each a process with its own printed budget (one cannot starve the other): the carried wheels
# are installed (.whl/*.whl, pip --no-index --no-deps --target); the report header (imports nothing
# of the project); pytest on the files holding GPU tests; the benchmark; the total.
# Writes OUT_DIR/gpu_check.md (a table), OUT_DIR/gpu_check.json, pytest_gpu.{xml,log}.
# Wheels: $GPU_CHECK_WHEELS (default .whl/). Python: $PYTHON, else .venv/bin/python when present, else python3.
# Budgets (seconds): GPU_CHECK_PYTEST_S, GPU_CHECK_BENCH_S (defaults 180 / 300; smoke 300 / 600).
set -u
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--smoke]}
shift
t0=$(date +%s)
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
smoke=0
case " $* " in *" --smoke "*) smoke=1 ;; esac
if [ "$smoke" = 1 ]; then pytest_s=${GPU_CHECK_PYTEST_S:-300}; bench_s=${GPU_CHECK_BENCH_S:-600}
else pytest_s=${GPU_CHECK_PYTEST_S:-180}; bench_s=${GPU_CHECK_BENCH_S:-300}; fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
whl=${GPU_CHECK_WHEELS:-.whl}   # the carried wheels' folder
wheels=""
if compgen -G "$whl/*.whl" >/dev/null; then
  site=${GPU_CHECK_SITE:-$out/site}
  echo "== carried wheels -> $site: $(ls "$whl"/*.whl | wc -l) files"
  if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$whl"/*.whl \
      >"$out/wheels.log" 2>&1; then
    wheels="installed $(ls "$whl"/*.whl | wc -l) carried wheels"
  else
    wheels="pip install of $whl/ FAILED (see wheels.log)"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline PYTHONUNBUFFERED=1
rc=0
step() {   # step NAME BUDGET_S: one process, killed at its budget (+10 s for its own cleanup)
  local name=$1 budget=$2; shift 2
  echo "== step $name: budget ${budget} s"
  timeout -k 10 "$((budget + 10))" "$py" scripts/gpu_check.py --out "$out" --step "$name" --budget-s "$budget" "$@"
  local r=$?
  if [ "$r" -eq 124 ] || [ "$r" -eq 137 ]; then
    "$py" scripts/gpu_check.py --out "$out" --step killed --killed "$name" --budget-s "$budget" "$@"
  fi
  [ "$r" -ne 0 ] && rc=1
  return 0
}
step header 60 --wheels "${wheels:-no .whl/ carried}" "$@"
step pytest "$pytest_s" "$@"
step bench "$bench_s" "$@"
"$py" scripts/gpu_check.py --out "$out" --step total --budget-s "$((pytest_s + bench_s + 60))" \
  --wall-s "$(($(date +%s) - t0))" "$@" || rc=1
[ -f "$out/gpu_check.md" ] && cat "$out/gpu_check.md"
exit $rc
