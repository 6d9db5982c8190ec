"""Online load generator for an OpenAI `/v1/completions` endpoint (tokenloom's or `vllm serve`'s).

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 64 \
        --request-rate 4 --json results/bench_serving.json

Every request is streamed (`stream_options.include_usage`), greedy, with `ignore_eos`, so
it gets exactly its `max_tokens`. Requests leave on a Poisson process at --request-rate
per second (inf: all at once), optionally capped at --max-concurrency in flight.
TTFT, TPOT and ITL follow vLLM's definitions (see bench_metrics), so the figures compare
with `vllm bench serve` on the same workload. Prompts come from workload.py: token-id
lists in the `prompt` field (OpenAI completions accept a list of ints), or text with
--real-prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import aiohttp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_metrics import RequestTrace, summarize_traces  # noqa: E402
from workload import DISTRIBUTIONS, WorkloadRequest, make_workload  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
SSE_PREFIX = "data: "


async def send_request(session: aiohttp.ClientSession, url: str, model: str, request: WorkloadRequest,
                       use_text: bool) -> RequestTrace:
    payload = {
        "model": model,
        "prompt": request.prompt if use_text else request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    trace = RequestTrace(send_time=time.perf_counter(), num_prompt_tokens=request.num_prompt_tokens)
    num_chunk_tokens = 0
    usage = None
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                trace.is_success = False
                trace.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return trace
            async for raw_line in response.content:
                line = raw_line.decode("utf-8").strip()
                if not line.startswith(SSE_PREFIX):
                    continue  # blank separators and SSE comments (keep-alives)
                data = line[len(SSE_PREFIX):]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("choices"):
                    trace.chunk_times.append(now)
                    num_chunk_tokens += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as e:  # noqa: BLE001 - any failure counts against this request, not the run
        trace.is_success = False
        trace.error = f"{type(e).__name__}: {e}"
        return trace
    # The server's usage is the truth; a chunk may carry several tokens (or none).
    if usage is not None:
        trace.num_output_tokens = usage.get("completion_tokens", num_chunk_tokens)
        trace.num_prompt_tokens = usage.get("prompt_tokens", trace.num_prompt_tokens)
    else:
        trace.num_output_tokens = num_chunk_tokens
    if not trace.chunk_times:
        trace.is_success = False
        trace.error = "the stream carried no tokens"
    return trace


async def benchmark(args, workload: list[WorkloadRequest]) -> tuple[list[RequestTrace], float]:
    url = args.base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = tqdm(total=len(workload), desc="requests", unit="req", disable=args.no_progress)

    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model = args.model or await served_model(session, args.base_url)

        async def one(request: WorkloadRequest) -> RequestTrace:
            if semaphore is None:
                trace = await send_request(session, url, model, request, args.real_prompts)
            else:
                async with semaphore:
                    trace = await send_request(session, url, model, request, args.real_prompts)
            progress.update(1)
            return trace

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(workload):
            if i > 0 and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(one(request)))
        traces = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(traces), duration


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists, for when --model is not given."""
    async with session.get(base_url.rstrip("/") + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def print_summary(summary: dict) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.2f}"

    lines = [
        ("Successful requests", summary["num_successful"]),
        ("Failed requests", summary["num_failed"]),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", summary["num_prompt_tokens"]),
        ("Total generated tokens", summary["num_output_tokens"]),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("latency_s", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            lines.append((f"{stat.capitalize()} {name} (ms)", ms(summary[key][stat])))
    width = max(len(name) for name, _ in lines) + 2
    print("=" * (width + 12))
    for name, value in lines:
        print(f"{name + ':':<{width}}{value:>12}")
    print("=" * (width + 12))


def load_workload(args) -> list[WorkloadRequest]:
    from engine.model_files import resolve_model

    folder = Path(resolve_model(args.tokenizer))
    tokenizer = None
    if args.real_prompts:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    return make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.distribution,
                         args.seed, vocab_size=vocab_size, real_prompts=args.real_prompts, tokenizer=tokenizer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model name; default: the first in /v1/models")
    p.add_argument("--tokenizer", default="smollm2", help="model name or folder for the vocabulary and text prompts")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-prompts", action="store_true", help="send text instead of token-id lists")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workload = load_workload(args)
    traces, duration = asyncio.run(benchmark(args, workload))
    summary = summarize_traces(traces, duration)
    print_summary(summary)
    errors = [t.error for t in traces if not t.is_success]
    if errors:
        print(f"first error: {errors[0]}")
    if args.json:
        report = {
            "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()
                       if k not in ("json", "no_progress")},
            "summary": summary,
            "errors": errors[:20],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return summary


if __name__ == "__main__":
    main()
