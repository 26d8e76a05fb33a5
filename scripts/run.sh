#!/usr/bin/env bash
# The main job on the embedded default model (configs/tiny-moe, pre-trained on the embedded
# arithmetic task): installs into .venv on first use, then
#   1. generates RL rollouts with logprobs and routed experts through the Python API,
#   2. does the same over HTTP against rollout-serve (SGLang's /generate wire format),
#   3. closes the RL loop: GRPO with rollout routing replay (configs/train/tiny.yaml) — two
#      rollout-serve processes (bf16) sample, a DeepSpeed trainer (fp32) replays their routing,
#      trains, and pushes the new weights back each step; rewards and train/rollout agreement
#      metrics per step, the held-out reward and a summary table at the end.
# Arguments go to the training loop, e.g. `bash scripts/run.sh --set steps=5`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh "train"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline DS_BUILD_OPS=0
echo "== 1/3  rollouts with logprobs and routed experts (Python API)"
.venv/bin/python scripts/demo.py --n 2 --max-new-tokens 8
echo
echo "== 2/3  the same over HTTP (rollout-serve)"
bash scripts/serve_demo.sh
echo
echo "== 3/3  GRPO with rollout routing replay: 2 rollout servers + a DeepSpeed trainer (configs/train/tiny.yaml)"
.venv/bin/python -m trainer_bridge.train --config configs/train/tiny.yaml "$@"
