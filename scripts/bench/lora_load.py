"""Loading an adapter while others stream (issue #56): how long a rank-16 adapter takes to load on
the default model while 8 streams run, and the longest gap between two tokens of those streams meanwhile.

    .venv/bin/python -m scripts.bench.lora_load --json results/bench_lora_load.json

A server runs with --enable-lora --allow-runtime-lora-updating. Each round, 8 streamed completions
(greedy, ignore_eos) run on the base; once every one has its first tokens, a fresh adapter (PEFT's
files with random A and B, scripts/lib/lora_adapters.py) is registered with POST
/v1/load_lora_adapter and one request names it at once. The frontend only checks the files; the
core reads the weights on its reader thread (engine/lora/adapter_reader.py) while the streams step,
and copies them into a pool slot in the step that first schedules the request. So the load
time is the POST's time plus that request's time to first token (its prefill is a few tokens), and
it is set beside the same short request's TTFT on an adapter already in its slot. A stream's gap is
the time between two of its chunks; reported are the gaps during the load (from the POST to the
adapter request's first token, plus the next step) and before it. Shared-machine timings are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from scripts.lib.bench_report import machine_info, run_and_report
from scripts.lib.local_server import start_server, stop_server
from scripts.lib.lora_adapters import write_adapter
from scripts.lib.sse_client import stream_chunks

logger = logging.getLogger("bench_lora_load")
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


async def stream(session, url: str, model: str, max_tokens: int, arrivals: list[float]) -> None:
    payload = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True}
    async for now, _ in stream_chunks(session, url + "/v1/completions", payload):
        arrivals.append(now)


async def first_token_s(session, url: str, model: str) -> float:
    start = time.perf_counter()
    arrivals: list[float] = []
    await stream(session, url, model, 4, arrivals)
    return arrivals[0] - start


async def post(session, url: str, path: str, body: dict) -> None:
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise SystemExit(f"{path}: HTTP {response.status}: {await response.text()}")


def gaps_in(arrivals: list[list[float]], start: float, end: float) -> list[float]:
    """Every stream's gaps between chunks that arrived in [start, end]."""
    return [b - a for times in arrivals for a, b in zip(times, times[1:]) if start <= b <= end]


async def one_round(session, url: str, base: str, adapter_path: str, name: str, args) -> dict:
    arrivals: list[list[float]] = [[] for _ in range(args.num_streams)]
    streams = [asyncio.create_task(stream(session, url, base, args.stream_tokens, times)) for times in arrivals]
    while min(len(times) for times in arrivals) < 8:  # every stream past its prefill, decoding
        if any(task.done() for task in streams):
            raise SystemExit(f"a stream ended before the load: raise --stream-tokens ({args.stream_tokens})")
        await asyncio.sleep(0.01)
    before_start = time.perf_counter()
    await asyncio.sleep(args.settle_s)
    load_start = time.perf_counter()
    await post(session, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_path})
    post_s = time.perf_counter() - load_start
    cold_ttft_s = await first_token_s(session, url, name)
    warm_start = time.perf_counter()
    warm_ttft_s = await first_token_s(session, url, name)  # the same request, the adapter now in its slot
    if any(task.done() for task in streams):
        raise SystemExit(f"a stream ended during the load: raise --stream-tokens ({args.stream_tokens})")
    await asyncio.sleep(0.3)  # the step after the load lands in the window too
    window_end = time.perf_counter()
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    during = gaps_in(arrivals, load_start, window_end)  # the warm request's steps are in it too
    before = gaps_in(arrivals, before_start, load_start)
    # The cold request's window (its read, its slot's fill, its prefill) apart from the warm one's (its
    # prefill alone): what the load itself costs the streams beyond any new request's prefill.
    cold = gaps_in(arrivals, load_start, warm_start + 0.1)
    warm = gaps_in(arrivals, warm_start + 0.1, window_end)
    return {"post_s": round(post_s, 4), "first_request_ttft_s": round(cold_ttft_s, 4),
            "load_s": round(post_s + cold_ttft_s, 4), "warm_adapter_ttft_s": round(warm_ttft_s, 4),
            "max_gap_during_load_ms": round(1000 * max(during), 1),
            "median_gap_during_load_ms": round(1000 * statistics.median(during), 1),
            "max_gap_cold_request_ms": round(1000 * max(cold), 1), "max_gap_warm_request_ms": round(1000 * max(warm), 1),
            "max_gap_before_ms": round(1000 * max(before), 1),
            "median_gap_before_ms": round(1000 * statistics.median(before), 1)}


async def measure(url: str, base: str, model_path: str, args) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-load-"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await first_token_s(session, url, base)  # warm the server
        rounds = []
        for i in range(args.rounds):
            path = write_adapter(folder / f"a{i}", model_path, args.rank, seed=i)
            rounds.append(await one_round(session, url, base, path, f"loaded{i}", args))
            logger.info("round %d: %s", i, rounds[-1])
    return rounds


def run(args: argparse.Namespace) -> dict:
    from engine.loader.model_files import resolve_model

    model_path = resolve_model(args.model)
    process, url, log_path = start_server(args.model, [
        "--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", str(args.rank),
        "--max-loras", str(args.max_loras)], log_name="bench-lora-load")
    try:
        rounds = asyncio.run(measure(url, args.model, model_path, args))
    finally:
        stop_server(process)

    def median(key):
        return round(statistics.median(r[key] for r in rounds), 4)

    return {"benchmark": "lora_load", "model": args.model, "rank": args.rank, "num_streams": args.num_streams,
            "rounds": rounds, "median_load_s": median("load_s"),
            "median_warm_adapter_ttft_s": median("warm_adapter_ttft_s"),
            "max_gap_during_load_ms": max(r["max_gap_during_load_ms"] for r in rounds),
            "max_gap_before_ms": max(r["max_gap_before_ms"] for r in rounds),
            "max_gap_cold_request_ms": max(r["max_gap_cold_request_ms"] for r in rounds),
            "max_gap_warm_request_ms": max(r["max_gap_warm_request_ms"] for r in rounds),
            "server_log": str(log_path), "machine": machine_info()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rank", type=int, default=16, choices=(8, 16, 32, 64))
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--num-streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=1024, help="each stream's length: it must outlast the load")
    p.add_argument("--settle-s", type=float, default=1.0, help="streams' gaps measured this long before the load")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
