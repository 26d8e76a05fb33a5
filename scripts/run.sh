#!/usr/bin/env bash
# The main job on the embedded default model (configs/tiny-moe): installs into .venv on first use,
# then generates a batch of RL rollouts with logprobs and routed experts and prints them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh ""
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python scripts/demo.py "$@"
echo
bash scripts/serve_demo.sh
