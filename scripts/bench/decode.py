"""Decode speed of one fixed batch, and the share of memory bandwidth it reaches.

    python -m scripts.bench.decode --model smollm2 --batch-size 64 --input-len 128 --output-len 128
    python -m scripts.lib.make_model_config mistral-7b /tmp/mistral-7b
    python -m scripts.bench.decode --model /tmp/mistral-7b --load-format dummy --dtype bfloat16 \
        --attention-backend triton --batch-size 32 --input-len 512 --output-len 64 --json mistral.json

B requests of L random token ids each, all arriving at once, each generating exactly T
tokens (greedy, EOS ignored). By default one step prefills the whole batch, so the B
sequences then decode in lockstep and every decode step has the same batch.

A decode step (every scheduled sequence adds exactly one token) is memory-bound: it
reads every weight once and each sequence's whole K/V context. Its bandwidth share is

    (weight bytes + sum over sequences of context length x KV bytes per token)
        / step time / peak bandwidth

with KV bytes per token = 2 (K and V) x layers x KV heads x head dim x element size.
Weight bytes count every parameter, untied embedding rows included although a step
gathers only B of them (for Mistral-7B that is 0.26 of 14.5 GB). Activations, logits
and the one new K/V row per sequence are left out, so the share is a lower bound. The
step time is the whole engine step (schedule, host-to-device copies, forward, sampling,
update), so host overhead counts against the share as it does in serving.
The per-step context lengths come from a thin wrapper around ModelRunner.execute.

References: the roofline view of decoding, e.g. "LLM Inference Unveiled: Survey and
Roofline Model Insights" (Yuan et al., 2024); H200 HBM3e peak: 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import logging
import statistics

from engine.attention import BACKEND_NAMES
from scripts.lib.bench_report import engine_flags, machine_info, run_and_report, require_at_least_one
from scripts.lib.lockstep_batch import add_lockstep_args, generate_recorded, lockstep_llm, random_prompts


logger = logging.getLogger("bench_decode")

H200_PEAK_BANDWIDTH_GBS = 4800.0


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V one cached token holds across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def decode_step_bytes(weight_bytes: int, num_context_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes a decode step must read: every weight once, plus each sequence's whole context."""
    return weight_bytes + num_context_tokens * kv_bytes_per_token


def bandwidth_share(num_bytes: int, step_time_s: float, peak_bandwidth_gbs: float) -> float:
    """Achieved bandwidth over peak (GB/s here are 1e9 bytes/s, as HBM specs quote them)."""
    return num_bytes / step_time_s / (peak_bandwidth_gbs * 1e9)


def record_context_tokens(engine) -> list[int]:
    """Wrap the engine's model runner so each executed step appends its total context length.

    EngineCore.step records a StepStats exactly when it calls execute, so while
    record_step_stats is on, entry i of the returned list belongs to step_stats[i].
    """
    runner = engine.model_runner
    execute = runner.execute
    context_tokens: list[int] = []

    def execute_and_record(scheduler_output):
        # Before execute, num_computed_tokens + num_new_tokens is the sequence's length this step.
        context_tokens.append(
            sum(s.request.num_computed_tokens + s.num_new_tokens for s in scheduler_output.scheduled)
        )
        return execute(scheduler_output)

    runner.execute = execute_and_record
    return context_tokens


def summarize(steps: list, context_tokens: list[int], weight_bytes: int, kv_bytes: int,
              peak_bandwidth_gbs: float) -> dict:
    """Median step time and bandwidth share over the pure decode steps."""
    decode = [
        (s.end_time - s.start_time, s.num_seqs, n)
        for s, n in zip(steps, context_tokens)
        if s.num_decode_tokens == s.num_seqs
    ]
    if not decode:
        return {"num_decode_steps": 0}
    times = [t for t, _, _ in decode]
    shares = [bandwidth_share(decode_step_bytes(weight_bytes, n, kv_bytes), t, peak_bandwidth_gbs)
              for t, _, n in decode]
    median_share = statistics.median(shares)
    return {
        "num_decode_steps": len(decode),
        "decode_batch_size_median": statistics.median(b for _, b, _ in decode),
        "decode_step_time_median_s": statistics.median(times),
        "decode_step_time_min_s": min(times),
        "decode_step_time_max_s": max(times),
        "decode_context_tokens_median": statistics.median(n for _, _, n in decode),
        "decode_bytes_median": statistics.median(decode_step_bytes(weight_bytes, n, kv_bytes) for _, _, n in decode),
        "decode_bandwidth_gbs_median": median_share * peak_bandwidth_gbs,
        "decode_bandwidth_share_median": median_share,
    }


def run(args: argparse.Namespace) -> dict:
    from ipc.sampling_params import SamplingParams

    batch_size, input_len, output_len = args.batch_size, args.input_len, args.output_len
    llm = lockstep_llm(
        args.model, batch_size, input_len, output_len, args.block_size,
        **engine_flags(args, "num_kv_blocks", "max_num_batched_tokens", "load_format", "dtype", "device",
                       "attention_backend", "enforce_eager", "compile", "num_threads"),
    )
    engine = llm.engine
    model_config = engine.model_config
    num_params = engine.model_runner.num_params
    weight_bytes = engine.model_runner.num_weight_bytes
    kv_element_size = engine.model_runner.kv_caches[0][0].element_size()
    kv_bytes = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                  kv_element_size)
    print(f"model: {model_config.architecture} from {engine.model_path}, {num_params / 1e6:.1f}M parameters, "
          f"{weight_bytes / 1e9:.3f} GB of weights", flush=True)

    prompts = random_prompts(args.seed, model_config.vocab_size, batch_size, input_len)
    # Warm-up on the same batch shape: Triton compiles its kernels (and CUDA settles) here.
    warmup = SamplingParams(temperature=0.0, max_tokens=min(output_len, args.warmup_output_len), ignore_eos=True)
    llm.generate(prompts, warmup, use_tqdm=False)

    context_tokens = record_context_tokens(engine)
    steps, elapsed = generate_recorded(
        llm, prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    assert len(steps) == len(context_tokens), (len(steps), len(context_tokens))

    num_output_tokens = batch_size * output_len
    report = {
        "model": args.model,
        "model_path": engine.model_path,
        "architecture": model_config.architecture,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "dtype": str(engine.model_runner.dtype).removeprefix("torch."),
        "compile_mode": "inductor" if engine.model_runner.is_compiled else "eager",
        "device": str(engine.model_runner.device),
        "attention_backend": engine.model_runner.backend.name,
        "machine": machine_info(),
        "num_params": num_params,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes,
        "peak_bandwidth_gbs": args.peak_bandwidth_gbs,
        "elapsed_s": elapsed,
        "num_steps": len(steps),
        "num_prompt_tokens": batch_size * input_len,
        "num_output_tokens": num_output_tokens,
        "total_tokens_per_s": (batch_size * input_len + num_output_tokens) / elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed,
        **summarize(steps, context_tokens, weight_bytes, kv_bytes, args.peak_bandwidth_gbs),
    }
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lockstep_args(p)
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights from config.json alone")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--attention-backend", default=None, choices=BACKEND_NAMES,
                   help="default: triton on CUDA, torch on the CPU")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: batch size x input length, so one step prefills the whole batch")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: enough for every sequence at full length")
    p.add_argument("--enforce-eager", action="store_true", help="skip CUDA graphs (and, on the CPU, --compile)")
    p.add_argument("--compile", action="store_true", help="CPU: torch.compile the forward")
    p.add_argument("--peak-bandwidth-gbs", type=float, default=H200_PEAK_BANDWIDTH_GBS,
                   help="peak memory bandwidth in GB/s (default: H200's 4800)")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("batch_size", "input_len", "output_len"))
    return args


def main(argv: list[str] | None = None) -> dict:
    args, report = run_and_report(parse_args, run, argv, logger)
    if "decode_step_time_median_s" in report:
        print(f"decode: median step {report['decode_step_time_median_s'] * 1e3:.2f} ms at batch "
              f"{report['decode_batch_size_median']}, {report['decode_bandwidth_gbs_median']:.0f} GB/s = "
              f"{report['decode_bandwidth_share_median']:.1%} of {args.peak_bandwidth_gbs:.0f} GB/s; "
              f"{report['output_tokens_per_s']:.0f} output tok/s", flush=True)
    return report


if __name__ == "__main__":
    main()
