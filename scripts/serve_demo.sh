#!/usr/bin/env bash
# Starts rollout-serve on the embedded model (a free loopback port), sends one real /generate
# request with routing on, decodes meta_info.routed_experts as SGLang users do, and stops it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
LOG="$(mktemp)"
"$ROOT/.venv/bin/rollout-serve" --port 0 --enable-return-routed-experts >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; rm -f "$LOG"' EXIT
URL=""
for _ in $(seq 1 120); do
  URL="$(grep -o 'http://[0-9.]*:[0-9]*' "$LOG" | head -1 || true)"
  if [ -n "$URL" ] && curl -sf "$URL/health" >/dev/null 2>&1; then break; fi
  kill -0 $PID 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
echo "rollout-serve at $URL"
echo "\$ curl $URL/generate -d '{\"text\": \"Q: 12+7= A:\", \"sampling_params\": {\"temperature\": 0, \"max_new_tokens\": 6}, \"return_logprob\": true, \"return_routed_experts\": true}'"
curl -sf "$URL/generate" -H 'content-type: application/json' \
  -d '{"text": "Q: 12+7= A:", "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": true, "return_routed_experts": true}' |
"$PY" -c '
import base64, json, sys
import numpy as np
o = json.load(sys.stdin)
m = o["meta_info"]
print("text:", repr(o["text"]), " output_ids:", o["output_ids"])
print("finish_reason:", m["finish_reason"], " prompt/completion tokens:", m["prompt_tokens"], m["completion_tokens"])
print("logprobs:", [round(x[0], 3) for x in m["output_token_logprobs"]])
r = np.frombuffer(base64.b64decode(m["routed_experts"]), np.int32)
r = r.reshape(m["prompt_tokens"] + m["completion_tokens"] - 1, -1, 4)
print("routed_experts:", r.shape, "(rows = prompt + output - 1, layers, top_k); row 0:", r[0].tolist())
'
