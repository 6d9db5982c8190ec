"""bench_offline's workload through vLLM's `LLM.generate`, for scripts/peers/bench.sh.

    .peers/vllm-venv/bin/python -m scripts.peers.vllm_offline --model MODEL_FOLDER \
        --dtype float32 --json results/peers/vllm_offline.json

Runs in vLLM's venv, so it imports only scripts/lib/workload.py from this repo, never engine/.
The prompts are the same token ids bench_offline builds (same sizes, seed and vocabulary),
sent as TokensPrompts; every request is greedy with ignore_eos and its own max_tokens.
One small warm-up, then the prefix cache is reset (the warm-up's prompts are the
workload's own) and the timed run. The JSON has bench_offline's layout, with one mode,
"vllm", and its throughput keys (elapsed_s, requests_per_s, output_tokens_per_s,
total_tokens_per_s) plus the prefix cache's share of prompt tokens, from each
RequestOutput's num_cached_tokens (what vLLM logs as "Prefix cache hit rate").

`--workload shared_prefix` builds bench_offline's shared-prefix requests from the same
generator and flags (--num-groups, --prefix-len, --question-len, --shared-output-len), so
both engines see identical token ids. vLLM V1 caches prefixes by default;
`--no-enable-prefix-caching` turns that off.

`--lora-path DIR` (repeated) serves those PEFT adapters with `enable_lora=True`, `--max-loras`
and `--max-lora-rank`, the requests spread round-robin over them (as scripts/bench/lora.py does);
the warm-up names every adapter once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from scripts.lib.bench_report import cpu_steal_s, machine_info, steal_share, write_report
from scripts.lib.workload import (
    add_prefix_workload_args,
    add_random_workload_args,
    make_shared_prefix_workload,
    make_workload,
)

WORKLOADS = ("random", "shared_prefix")
NUM_WARMUP_REQUESTS = 8
WARMUP_MAX_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local HF folder")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: vLLM's own default (bf16 for an fp32 checkpoint on x86)")
    add_random_workload_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile")
    add_prefix_workload_args(p, WORKLOADS)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="vLLM's prefix caching off (on by default in V1)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of the folder's config.json, and no tokenizer (token ids only)")
    p.add_argument("--lora-path", action="append", default=[], help="a PEFT adapter folder (repeat for more)")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def _dtype_used(llm) -> str | None:
    """The dtype vLLM chose (its "auto" resolves at load time); None if this version hides it."""
    try:
        return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    except AttributeError:
        return None


def lora_kwargs(args: argparse.Namespace) -> dict:
    if not args.lora_path:
        return {}
    return {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}


def lora_spread(paths: list[str], num_requests: int) -> list | None:
    """Each request's vLLM LoRARequest, round-robin over `paths` (ids from 1); None without adapters."""
    if not paths:
        return None
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    return [adapters[i % len(adapters)] for i in range(num_requests)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.workload == "shared_prefix":
        workload = make_shared_prefix_workload(args.num_requests, args.num_groups, args.prefix_len, args.question_len,
                                               args.shared_output_len, args.seed, vocab_size)
    else:
        workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                                 args.distribution, args.seed, vocab_size=vocab_size)
    longest = max(r.num_prompt_tokens + r.max_tokens for r in workload)
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest})")
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]

    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
              load_format=args.load_format, skip_tokenizer_init=args.load_format == "dummy",
              **lora_kwargs(args))
    spread = lora_spread(args.lora_path, len(prompts))
    num_warmup = max(NUM_WARMUP_REQUESTS, len(args.lora_path))
    llm.generate(prompts[:num_warmup], SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True),
                 use_tqdm=False, lora_request=spread[:num_warmup] if spread else None)
    if args.enable_prefix_caching and not llm.reset_prefix_cache():  # start the measured run cold
        raise RuntimeError("vLLM refused to reset its prefix cache after the warm-up")
    steal_before = cpu_steal_s()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=spread)
    elapsed = time.perf_counter() - start
    stolen = steal_share(steal_before, cpu_steal_s(), elapsed)

    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    bad = [(i, r.max_tokens, n) for i, (r, n) in enumerate(zip(workload, output_lens)) if n != r.max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} requests got the wrong output length (index, wanted, got): {bad[:5]}")
    num_prompt = sum(r.num_prompt_tokens for r in workload)
    num_output = sum(output_lens)
    num_cached = sum(o.num_cached_tokens or 0 for o in outputs)
    summary = {
        "elapsed_s": elapsed,
        "requests_per_s": len(workload) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_prompt + num_output) / elapsed,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "dtype_used": _dtype_used(llm),
        "compiled": not args.enforce_eager,
        "prefix_caching": args.enable_prefix_caching,
        "prefix_cache_hit_rate": num_cached / num_prompt,  # cached prompt tokens / prompt tokens
        "num_prefix_cache_hit_tokens": num_cached,
        "steal_share": stolen,
        "num_lora_adapters": len(args.lora_path),
    }
    print(f"vllm {vllm.__version__} {args.dtype}: {len(workload)} requests, {num_prompt} prompt + {num_output} "
          f"output tokens in {elapsed:.2f} s: {summary['requests_per_s']:.2f} req/s, "
          f"{summary['output_tokens_per_s']:.1f} out tok/s, {summary['total_tokens_per_s']:.1f} total tok/s, "
          f"prefix cache hit rate {summary['prefix_cache_hit_rate']:.3f}")
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {
            **machine_info(),
            "vllm_version": vllm.__version__,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
        },
        "results": {"vllm": summary},
    }
    if args.json:
        write_report(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
