#!/usr/bin/env bash
# Installs what the tests need into .venv (created on first use) and runs the test suite.
#   bash scripts/test.sh            default suite (CPU, no slow tests)
#   bash scripts/test.sh --slow     only the tests marked slow (multi-process, load, long runs)
#   bash scripts/test.sh --all      everything (the GPU tests skip without a GPU)
#   bash scripts/test.sh --gpu      only the GPU tests (CUDA graphs, NCCL; needs a CUDA torch)
#   bash scripts/test.sh --overlap  the engine, capture, DP and deterministic test files (not slow)
#                                   with the overlap schedule and torch.compile on (decode buckets
#                                   1, 2, 4 compiled where the test's engine can compile; the run's
#                                   own inductor cache carries the graphs from test to test)
# Extra arguments after these go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh "dev,train"
# NOTE: the real Prometheus scrape of tests/test_metrics.py needs Debian's prometheus (about 20 MB; on
# a host booted with systemd the package also starts its own service); installed when this runs as
# root with apt-get (CI's container), else that test skips
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's prometheus for the scrape test"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } \
    >/dev/null 2>&1 || echo "prometheus could not be installed: its test skips"
fi
MARK="not slow"
TARGETS=(tests)
case "${1:-}" in
  --slow) MARK="slow"; shift ;;
  --overlap) shift
    export ROLLOUT_TEST_ENGINE_KW='{"enable_overlap_schedule": true, "enable_torch_compile": true, "torch_compile_max_bs": 4}'
    TARGETS=(tests/test_engine.py tests/test_capture.py tests/test_dp.py tests/test_deterministic_engine.py) ;;
  --all) MARK=""; shift ;;
  --gpu) MARK="gpu"; shift ;;
esac
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
# NOTE: inductor's on-disk cache is this run's own (removed at exit): its keys do not hold all that
# a kernel was compiled for (torch 2.13: a kernel cached under one CPU ISA and run under another,
# chosen by ATEN_CPU_CAPABILITY, returned garbage), so nothing an earlier run or another host
# sharing /tmp compiled is reused; within the run it carries the graphs from test to test
if [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d -t rollout-inductor.XXXXXX)"
  export TORCHINDUCTOR_CACHE_DIR
  trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
fi
ARGS=(-q -p no:cacheprovider --timeout=900)
if [ -n "$MARK" ]; then ARGS+=(-m "$MARK"); fi
set +e
.venv/bin/python -m pytest "${ARGS[@]}" "$@" "${TARGETS[@]}"
rc=$?
set -e
# NOTE: grouped: `a && b || c && d` is `((a && b) || c) && d` in bash, which never reset --slow's 5
if [ "$rc" -eq 5 ] && { [ "$MARK" = "slow" ] || [ "$MARK" = "gpu" ]; }; then
  echo "no tests marked $MARK"; rc=0   # NOTE: pytest exits 5 when a marker selects nothing
fi
exit "$rc"
