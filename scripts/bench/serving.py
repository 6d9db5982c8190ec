"""Online load generator for an OpenAI `/v1/completions` endpoint (tokenloom's or `vllm serve`'s).

    python -m scripts.bench.serving --base-url http://127.0.0.1:8000 --num-requests 64 \
        --request-rate 4 --json results/bench_serving.json

Every request is streamed (`stream_options.include_usage`), greedy, with `ignore_eos`, so
it gets exactly its `max_tokens`. Requests leave on a Poisson process at --request-rate
per second (inf: all at once), optionally capped at --max-concurrency in flight.
TTFT, TPOT and ITL follow vLLM's definitions (see bench_metrics), so the figures compare
with `vllm bench serve` on the same workload. Prompts come from scripts/lib/workload.py: token-id
lists in the `prompt` field (OpenAI completions accept a list of ints), or text with
--real-prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from scripts.bench.serving_multi_turn import cached_share_by_turn, run_conversations
from scripts.lib.bench_metrics import RequestTrace, summarize_traces
from scripts.lib.bench_report import write_report
from frontend.spec_decode_metrics import format_spec_decode
from scripts.lib.local_server import reset_prefix_cache, scrape_metrics, spec_decode_delta, start_server, stop_server
from scripts.lib.sse_client import StreamStatusError, served_model, stream_chunks
from scripts.lib.workload import (
    add_prefix_workload_args,
    add_random_workload_args,
    WorkloadRequest,
    make_multi_turn_workload,
    make_shared_prefix_workload,
    make_workload,
)


TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
PREFIX_CACHING_FLAGS = {"on": [], "off": ["--no-enable-prefix-caching"]}
WARMUP_PROMPT_LEN = 256  # 4 of them fill one 1,024-token step: the largest prefill shape is warm
WARMUP_SEED = 987654  # unrelated to any workload's seed, so the warm-up shares no prefix with it


async def send_request(session: aiohttp.ClientSession, url: str, model: str, request: WorkloadRequest,
                       use_text: bool) -> RequestTrace:
    """One streamed completion; `use_text` sends request.prompt instead of its token ids."""
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
        async for now, chunk in stream_chunks(session, url, payload):
            if chunk.get("choices"):
                trace.chunk_times.append(now)
                trace.text += chunk["choices"][0].get("text") or ""
                num_chunk_tokens += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
    except StreamStatusError as e:
        trace.is_success = False
        trace.error = str(e)
        return trace
    except Exception as e:  # noqa: BLE001 - any failure counts against this request, not the run
        trace.is_success = False
        trace.error = f"{type(e).__name__}: {e}"
        return trace
    # The server's usage is the truth; a chunk may carry several tokens (or none).
    if usage is not None:
        # completion_tokens bills a prediction's rejected tokens too (docs/request_fields.md): not written
        rejected = (usage.get("completion_tokens_details") or {}).get("rejected_prediction_tokens") or 0
        trace.num_output_tokens = usage.get("completion_tokens", num_chunk_tokens) - rejected
        trace.num_prompt_tokens = usage.get("prompt_tokens", trace.num_prompt_tokens)
        trace.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        trace.num_output_tokens = num_chunk_tokens
    if not trace.chunk_times:
        trace.is_success = False
        trace.error = "the stream carried no tokens"
    return trace


async def benchmark(args, base_url: str, workload: list[WorkloadRequest], conversations=None
                    ) -> tuple[list[RequestTrace], float, list | None]:
    """Sends the workload (or, for multi_turn, runs the conversations); returns every
    trace, the wall time and, for multi_turn, the traces per conversation."""
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    num_requests = sum(len(c.user_turns) for c in conversations) if conversations else len(workload)
    progress = tqdm(total=num_requests, desc="requests", unit="req", disable=args.no_progress)

    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await served_model(session, base_url)

        async def send(request: WorkloadRequest) -> RequestTrace:
            use_text = request.prompt is not None
            if semaphore is None:
                return await send_request(session, url, model, request, use_text)
            async with semaphore:
                return await send_request(session, url, model, request, use_text)

        async def one(request: WorkloadRequest) -> RequestTrace:
            trace = await send(request)
            progress.update(1)
            return trace

        start = time.perf_counter()
        by_conversation = None
        if conversations:
            by_conversation = await run_conversations(conversations, send, args.tokenizer_obj, args.request_rate,
                                                      args.seed, on_done=lambda: progress.update(1))
            traces = [t for c in by_conversation for t in c]
        else:
            tasks = []
            for i, request in enumerate(workload):
                if i > 0 and args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
                tasks.append(asyncio.create_task(one(request)))
            traces = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    progress.close()
    return traces, duration, by_conversation


async def warm_up(args, base_url: str) -> None:
    """--num-warmup short requests of tokens no workload uses, all at once."""
    url = base_url.rstrip("/") + "/v1/completions"
    warmup = make_workload(args.num_warmup, (WARMUP_PROMPT_LEN, WARMUP_PROMPT_LEN), (4, 4), seed=WARMUP_SEED,
                           vocab_size=args.vocab_size)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        model = args.model or await served_model(session, base_url)
        traces = await asyncio.gather(*(send_request(session, url, model, r, False) for r in warmup))
    failed = [t.error for t in traces if not t.is_success]
    if failed:
        raise SystemExit(f"the warm-up failed: {failed[0]}")


def print_summary(summary: dict) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.2f}"

    lines = [
        ("Successful requests", summary["num_successful"]),
        ("Failed requests", summary["num_failed"]),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", summary["num_prompt_tokens"]),
        ("Total generated tokens", summary["num_output_tokens"]),
        ("Cached prompt tokens (usage)", "-" if summary["num_cached_tokens"] is None else summary["num_cached_tokens"]),
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


def load_workload(args) -> tuple[list[WorkloadRequest], list | None]:
    """The requests, and for multi_turn the conversations (the requests are then built
    turn by turn from the replies). Sets args.vocab_size and args.tokenizer_obj."""
    from transformers import AutoTokenizer

    from engine.loader.model_files import resolve_model

    folder = Path(resolve_model(args.tokenizer))
    args.tokenizer_obj = AutoTokenizer.from_pretrained(folder)  # multi_turn re-tokenizes the replies
    args.vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    if args.workload == "shared_prefix":
        return make_shared_prefix_workload(args.num_requests, args.num_groups, args.prefix_len, args.question_len,
                                           args.shared_output_len, args.seed, args.vocab_size), None
    if args.workload == "multi_turn":
        return [], make_multi_turn_workload(args.num_conversations, args.num_turns, args.turn_len,
                                            args.shared_output_len, args.seed, args.vocab_size)
    return make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.distribution,
                         args.seed, vocab_size=args.vocab_size, real_prompts=args.real_prompts,
                         tokenizer=args.tokenizer_obj), None


def prefix_cache_delta(before: dict | None, after: dict | None) -> dict:
    """The run's prefix-cache counters from /metrics (prompt tokens); None where unavailable."""
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total")
    if not before or not after or any(n not in before or n not in after for n in names):
        return {"num_queries": None, "num_hits": None, "hit_rate": None}
    queries, hits = (after[n] - before[n] for n in names)
    return {"num_queries": int(queries), "num_hits": int(hits), "hit_rate": hits / queries if queries else None}


def try_scrape(url: str) -> dict | None:
    try:
        return scrape_metrics(url)
    except OSError:
        return None


def run_once(args, base_url: str, workload: list[WorkloadRequest], conversations) -> dict:
    """One measured run against `base_url`: warm-up, cache reset, the workload, /metrics around it."""
    if args.num_warmup:
        asyncio.run(warm_up(args, base_url))
    is_reset = reset_prefix_cache(base_url)  # False: the server has no such route, the run may start warm
    time.sleep(1.5)  # the cores' stats reach /metrics with their next step or heartbeat (1 s)
    before = try_scrape(base_url)
    traces, duration, by_conversation = asyncio.run(benchmark(args, base_url, workload, conversations))
    time.sleep(1.5)
    summary = summarize_traces(traces, duration)
    after = try_scrape(base_url)
    summary["prefix_cache"] = {**prefix_cache_delta(before, after), "reset_before_run": is_reset}
    spec_decode = spec_decode_delta(before, after)
    if spec_decode:  # speculation ran
        summary["spec_decode"] = spec_decode
    if by_conversation is not None:
        summary["cached_share_by_turn"] = cached_share_by_turn(by_conversation)
    print_summary(summary)
    if spec_decode:
        print(format_spec_decode(spec_decode))
    errors = [t.error for t in traces if not t.is_success]
    if errors:
        print(f"first error: {errors[0]}")
    return {"summary": summary, "errors": errors[:20]}


def compare(on: dict, off: dict) -> dict:
    """Caching on against off: throughput ratios (on / off, above 1 means caching helps)
    and TTFT ratios (off / on, above 1 means caching helps)."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    return {
        "total_token_throughput_on_vs_off": ratio(on["total_token_throughput"], off["total_token_throughput"]),
        "request_throughput_on_vs_off": ratio(on["request_throughput"], off["request_throughput"]),
        "ttft_median_off_vs_on": ratio(off["ttft_s"]["median"], on["ttft_s"]["median"]),
        "ttft_p99_off_vs_on": ratio(off["ttft_s"]["p99"], on["ttft_s"]["p99"]),
        "latency_median_off_vs_on": ratio(off["latency_s"]["median"], on["latency_s"]["median"]),
        "hit_rate_on": on["prefix_cache"]["hit_rate"],
        "cached_share_on": on["cached_share"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, unless --prefix-caching starts ours")
    p.add_argument("--model", default=None, help="the served model name; default: the first in /v1/models")
    p.add_argument("--tokenizer", default="smollm2", help="model name or folder for the vocabulary and text prompts")
    add_random_workload_args(p)
    p.add_argument("--real-prompts", action="store_true", help="send text instead of token-id lists (random workload)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (multi_turn: new conversations) per second, Poisson arrivals; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    add_prefix_workload_args(p)
    p.add_argument("--num-warmup", type=int, default=4, help="short unrelated requests before each measured run")
    p.add_argument("--prefix-caching", default=None,
                   help="on, off or on,off: start our server once per setting (not --base-url) and compare")
    p.add_argument("--server-model", default="smollm2", help="--prefix-caching: the model our server loads")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="--prefix-caching: an extra flag for our server (repeat: --server-arg=--dtype "
                        "--server-arg=float32)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.num_warmup < 0:
        p.error("--num-warmup must not be negative")
    if args.real_prompts and args.workload != "random":
        p.error("--real-prompts is for the random workload only")
    if args.prefix_caching is not None:
        args.prefix_caching = [v.strip() for v in args.prefix_caching.split(",") if v.strip()]
        if not args.prefix_caching or set(args.prefix_caching) - set(PREFIX_CACHING_FLAGS):
            p.error(f"--prefix-caching takes on, off or on,off, got {args.prefix_caching}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workload, conversations = load_workload(args)
    runs: dict[str, dict] = {}
    if args.prefix_caching is None:
        runs["as_served"] = run_once(args, args.base_url, workload, conversations)
    else:
        for setting in args.prefix_caching:
            name = f"prefix_caching_{setting}"
            print(f"--- {name}: starting our server")
            process, url, log_path = start_server(args.server_model, [*args.server_arg, *PREFIX_CACHING_FLAGS[setting]],
                                                  log_name=f"bench-serving-{setting}")
            try:
                runs[name] = {**run_once(args, url, workload, conversations), "server_log": str(log_path)}
            finally:
                stop_server(process)
    report = {
        "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()
                   if k not in ("json", "no_progress", "tokenizer_obj")},
        "summary": next(iter(runs.values()))["summary"],  # the first run's, where scripts expect one
        "runs": runs,
    }
    if "prefix_caching_on" in runs and "prefix_caching_off" in runs:
        report["on_vs_off"] = compare(runs["prefix_caching_on"]["summary"], runs["prefix_caching_off"]["summary"])
        print("on vs off:", json.dumps(report["on_vs_off"], indent=1))
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
