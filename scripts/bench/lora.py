"""Multi-LoRA speed (issue #56): the reference offline workload spread round-robin over rank-16
adapters against the same workload on the base alone, and one user with an adapter against one
user on the base, in one run on one machine.

    .venv/bin/python -m scripts.bench.lora --json results/bench_lora.json
    .venv/bin/python -m scripts.bench.lora --quick          # 8 short requests, a smoke run

The adapters are written here, PEFT's files with random A and B (rank --rank, all seven
projections, alpha 2r), as an adapter made with peft would be: their values do not change the
cost. The base runs on `LLM(model)` at its defaults; the adapters on `LLM(model, enable_lora=True,
max_loras=--max-loras, max_lora_rank=--rank)`. Each request is greedy with ignore_eos and gets
exactly its requested output length; prefix caching is reset before each measured run. Rounds
alternate base and adapters. Reported per run: total tok/s (prompt + output over wall time) and
output tok/s; for the single user: decode tok/s = (output - 1) / (finish - first token), the median
over the rounds. Timings on a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from scripts.lib.bench_report import machine_info, run_and_report
from scripts.lib.lora_adapters import write_adapter
from scripts.lib.workload import add_random_workload_args, make_workload

logger = logging.getLogger("bench_lora")


def run_workload(llm, workload, lora_requests) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=False, lora_request=lora_requests)
    wall_s = time.perf_counter() - start
    num_out = sum(len(o.token_ids) for o in outputs)
    num_in = sum(r.num_prompt_tokens for r in workload)
    return {"wall_s": round(wall_s, 3), "total_tok_s": round((num_in + num_out) / wall_s, 1),
            "output_tok_s": round(num_out / wall_s, 1)}


def single_user_decode(llm, prompt: list[int], num_out: int, lora_request) -> float:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_out, ignore_eos=True)
    llm.reset_prefix_cache()
    times = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0].metrics
    return (num_out - 1) / (times.finish_time - times.first_token_time)


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, LoRARequest

    if args.quick:
        args.num_requests, args.input_len, args.output_len = 8, (8, 32), (4, 24)
    base = LLM(args.model)
    adapters_dir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    lora_requests = [LoRARequest(f"adapter{i}", i + 1, write_adapter(adapters_dir / f"a{i}", base.engine.model_path,
                                                                     args.rank, seed=i))
                     for i in range(args.num_adapters)]
    lora = LLM(args.model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank)
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.distribution,
                             args.seed, vocab_size=base.engine.vocab_size)
    spread = [lora_requests[i % len(lora_requests)] for i in range(len(workload))]
    warm = workload[: min(max(4, len(lora_requests)), len(workload))]  # every adapter read before the rounds
    run_workload(base, warm, None), run_workload(lora, warm, spread[: len(warm)])
    prompt = workload[0].prompt_token_ids
    rounds = []
    for _ in range(args.rounds):
        rounds.append({
            "base": run_workload(base, workload, None),
            "adapters": run_workload(lora, workload, spread),
            "single_user_base_decode_tok_s": round(single_user_decode(base, prompt, args.single_user_tokens, None), 1),
            "single_user_adapter_decode_tok_s": round(single_user_decode(lora, prompt, args.single_user_tokens,
                                                                         lora_requests[0]), 1),
        })
        logger.info("round: %s", rounds[-1])
    base_tok_s = statistics.median(r["base"]["total_tok_s"] for r in rounds)
    adapter_tok_s = statistics.median(r["adapters"]["total_tok_s"] for r in rounds)
    user_base = statistics.median(r["single_user_base_decode_tok_s"] for r in rounds)
    user_adapter = statistics.median(r["single_user_adapter_decode_tok_s"] for r in rounds)
    return {
        "benchmark": "lora", "model": args.model, "num_adapters": args.num_adapters, "rank": args.rank,
        "max_loras": args.max_loras, "num_requests": args.num_requests, "input_len": list(args.input_len),
        "output_len": list(args.output_len), "rounds": rounds,
        "median_total_tok_s": {"base": base_tok_s, "adapters": adapter_tok_s},
        "adapters_over_base": round(adapter_tok_s / base_tok_s, 3),
        "median_single_user_decode_tok_s": {"base": user_base, "adapter": user_adapter},
        "single_user_adapter_over_base": round(user_adapter / user_base, 3),
        "machine": machine_info(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    add_random_workload_args(p)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=16, choices=(8, 16, 32, 64))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--single-user-tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
