"""bf16 against --quantization int8 and int4 in one run, JSON out (issue #28's single-user and batched rows).

All in `--dtype auto`: bf16 where the CPU multiplies it natively, and fp32 activations
beside the int8 or int4 weights (engine/worker/dtype_policy.py); `--int8-dtype bfloat16` runs them
with bf16 activations instead.

Single user: one request, a 128-token prompt, 256 greedy tokens (EOS ignored): TTFT and
decode tok/s after the first token. Batched: `--num-requests` requests of the same shape
submitted together, total (prompt + output) tok/s. Offline `LLM`, no HTTP: the server's
own overhead is peers/bench.sh's (and bench single_user's) to measure. Each setting has its
own engine, all loaded in one process; their single-user runs alternate round by round.

    python -m scripts.bench.quant --json results/quant.json
    python -m scripts.bench.quant --settings bf16,bf16-eager-loop,int8,int8-eager-loop --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import LLM, SamplingParams
from scripts.lib.bench_report import write_report


def prompts(num: int, num_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(num_tokens)] for _ in range(num)]


# Each setting: (quantization, run decode steps' layers in one C++ call).
SETTINGS = {"bf16": (None, True), "bf16-eager-loop": (None, False), "int8": ("int8", True),
            "int8-eager-loop": ("int8", False), "int4": ("int4", True), "int4-eager-loop": ("int4", False)}


def make_engine(name: str, args) -> LLM:
    quantization, decode_stack = SETTINGS[name]
    dtype = args.int8_dtype if quantization else "auto"
    llm = LLM(args.model, quantization=quantization, dtype=dtype, enable_prefix_caching=False,
              cpu_decode_stack=decode_stack)
    vocab = llm.engine.model_config.vocab_size
    llm.generate(prompts(1, args.prompt_len, vocab, 99), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    return llm


def single_user_run(llm: LLM, args, seed: int) -> dict:
    vocab = llm.engine.model_config.vocab_size
    single = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    out = llm.generate(prompts(1, args.prompt_len, vocab, seed), single, use_tqdm=False)[0]
    m = out.metrics
    return {"ttft_s": m.first_token_time - m.arrival_time,
            "decode_tok_s": (len(out.token_ids) - 1) / (m.finish_time - m.first_token_time)}


def batched_run(llm: LLM, args) -> dict:
    batch = prompts(args.num_requests, args.prompt_len, llm.engine.model_config.vocab_size, 1000)
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=args.batch_output_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(p) for p in batch) + sum(len(o.token_ids) for o in outs)
    return {"num_requests": len(batch), "elapsed_s": elapsed, "total_tokens_per_s": num_tokens / elapsed}


def describe(name: str, llm: LLM, runs: list[dict], batched: dict) -> dict:
    runner = llm.engine.model_runner
    model = runner.model
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {
        "setting": name,
        "quantization": SETTINGS[name][0],
        "decode_stack": runner.decode_stack is not None,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "single_user": {"median_ttft_s": sorted(r["ttft_s"] for r in runs)[len(runs) // 2],
                        "median_decode_tok_s": sorted(r["decode_tok_s"] for r in runs)[len(runs) // 2], "runs": runs},
        "batched": batched,
        # Prepacked oneDNN weights are opaque, so bf16's resident count misses most of them:
        # loaded_weight_bytes is the parameters' size in the run's dtype before prepacking or int8.
        "resident_weight_bytes": resident,
        "loaded_weight_bytes": runner.num_weight_bytes,
    }


def measure(names: list[str], args) -> list[dict]:
    """Every setting's engine loaded at once, then their runs alternated round by round, so
    that each sees the same stretch of this host's speed."""
    engines = {name: make_engine(name, args) for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(single_user_run(llm, args, seed=i))
    batched = {name: batched_run(llm, args) for name, llm in engines.items()}
    return [describe(name, llm, runs[name], batched[name]) for name, llm in engines.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-output-len", type=int, default=128)
    p.add_argument("--int8-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--settings", default="bf16,int8,int4",
                   help=f"comma-separated, of {', '.join(SETTINGS)} (-eager-loop: --no-cpu-decode-stack)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}")
    results = {"settings": vars(args), "runs": measure(names, args)}
    print(json.dumps(results, indent=2))
    write_report(args.json, results, indent=2)


if __name__ == "__main__":
    main()
