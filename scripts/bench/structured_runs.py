"""The grammar's cost, run by run: constrained / unconstrained median TPOT, several runs in a row, at several loads.

    python -m scripts.bench.structured_runs --json results/bench_structured_runs.json   # 5 runs at 8, 32, 64
    python -m scripts.bench.structured_runs --concurrency 32 --fresh-server                # every run on a new server
    python -m scripts.bench.structured_runs --url http://127.0.0.1:8000 --concurrency 32 --runs 1

Issue #58's workload, through the `openai` client: N concurrent streamed chat requests
("Invent person number i as JSON.", greedy, --max-tokens 60), once unconstrained ("free") and
once with one `json_schema` shared by all (a person: name, age, email), on one server at its
defaults. Each run pairs a free round with a grammar round, their order alternating run by run
(F G, G F, ...) so a shared machine's drift hits both; its ratio is grammar TPOT / free TPOT,
each the median over the round's requests of (last chunk - first chunk) / (output tokens - 1).
With --fresh-server each run starts a server of its own, so its grammar round also meets the
checker's start and the schema's first compile, as the first constrained requests on a new
server do. The table gives every run's ratio, since the cost this measures was bimodal (issue
#58): a median over runs would hide one run in three at 1.4x. scripts/bench/structured.py is the longer
six-field profile with rounds pooled per arm.

With --trace FILE the servers write the core's step trace there (TOKENLOOM_STEP_TRACE,
engine/loop/step_trace.py) and each round gets its steps' summary beside its TPOT (the
forward, the rest of the step, the fill and its share inside the forward, the mask, and the
torch threads the governor stepped with and the readings that chose them): a slow run says
whether its steps were slow in the forward, outside it, or on fewer threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from scripts.lib.bench_report import machine_info, write_report
from scripts.lib.step_summary import summarize_steps
from scripts.lib.local_server import start_server, stop_server

TARGET_RATIO = 1.15  # issue #58: each run's grammar TPOT within 1.15x of the free one's
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
    "required": ["name", "age", "email"],
}


def response_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}


async def one_request(client, model: str, index: int, max_tokens: int, is_grammar: bool) -> dict:
    """One streamed chat request: its chunk times, token count and text."""
    extra = {"response_format": response_format()} if is_grammar else {}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Invent person number {index} as JSON."}],
        max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True}, **extra)
    times, text, num_tokens = [], "", 0
    async for chunk in stream:
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                times.append(time.perf_counter())
                text += choice.delta.content
    return {"times": times, "num_tokens": num_tokens, "text": text}


async def run_round(base_url: str, model: str | None, concurrency: int, max_tokens: int, is_grammar: bool) -> dict:
    """`concurrency` requests at once; the median TPOT over those with two tokens or more."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                           timeout=600) as client:
        model = model or (await client.models.list()).data[0].id
        results = await asyncio.gather(*(one_request(client, model, i, max_tokens, is_grammar)
                                         for i in range(concurrency)))
    tpots = [(r["times"][-1] - r["times"][0]) / (r["num_tokens"] - 1)
             for r in results if r["num_tokens"] > 1 and len(r["times"]) > 1]
    return {
        "tpot_ms": statistics.median(tpots) * 1e3 if tpots else None,
        "num_tokens_median": statistics.median(r["num_tokens"] for r in results),
        "num_json": sum(parses_as_json(r["text"]) for r in results),
        "num_requests": concurrency,
    }


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run_runs(args: argparse.Namespace, base_url: str | None, concurrency: int) -> dict:
    """--runs free/grammar pairs on the server at `base_url`, or (--fresh-server) each on a server of its own."""
    if not args.fresh_server:
        asyncio.run(run_round(base_url, args.model, min(concurrency, 4), 8, True))  # the schema's compile
    runs = []
    for index in range(args.runs):
        url, process = base_url, None
        if args.fresh_server:  # the grammar round meets the checker's start and the schema's first compile
            process, url, _ = start_server(args.server_model, args.server_arg, log_name="bench-structured-runs")
        try:
            asyncio.run(run_round(url, args.model, min(concurrency, 4), 8, False))  # warm, no grammar
            rounds = {}
            for is_grammar in ((False, True) if index % 2 == 0 else (True, False)):
                start = time.perf_counter()
                rounds["grammar" if is_grammar else "free"] = result = asyncio.run(
                    run_round(url, args.model, concurrency, args.max_tokens, is_grammar))
                if args.trace:
                    result["steps"] = round_steps(args.trace, start, time.perf_counter())
        finally:
            if process is not None:
                stop_server(process)
        free, grammar = rounds["free"]["tpot_ms"], rounds["grammar"]["tpot_ms"]
        runs.append({"free": rounds["free"], "grammar": rounds["grammar"],
                     "ratio": grammar / free if free and grammar else None})
        print(f"{concurrency} concurrent, run {index + 1}/{args.runs}: free {fmt(free, '.1f')} ms, grammar "
              f"{fmt(grammar, '.1f')} ms, {fmt(runs[-1]['ratio'], '.3f')}x", flush=True)
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    return {"concurrency": concurrency, "runs": runs, "ratios": ratios,
            "max_ratio": max(ratios) if ratios else None,
            "meets_target": len(ratios) == args.runs and max(ratios) <= TARGET_RATIO}


def round_steps(trace: str, start: float, end: float) -> dict:
    """The round's steps from the core's trace (perf_counter is one clock for all processes)."""
    summary = summarize_steps(Path(trace), start, end)
    print(f"  {'grammar' if summary['num_grammar_steps'] else 'free'} round: step {summary['step_ms']} ms, "
          f"forward {summary['forward_ms']} ms, rest {summary['rest_ms']} ms, fill {summary['fill_ms']} ms "
          f"(overlap {summary['fill_overlap']}), mask {summary['apply_ms']} ms, threads {summary['threads']}, "
          f"governor others {summary['governor_others_cores']} busy {summary['governor_busy_share']}", flush=True)
    return summary


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[dict]) -> None:
    print("| concurrent | run | free TPOT ms | grammar TPOT ms | ratio | grammar JSON |")
    print("|---|---|---|---|---|---|")
    for result in results:
        for index, run in enumerate(result["runs"]):
            print(f"| {result['concurrency']} | {index + 1} | {fmt(run['free']['tpot_ms'], '.1f')} | "
                  f"{fmt(run['grammar']['tpot_ms'], '.1f')} | {fmt(run['ratio'], '.3f')}x | "
                  f"{run['grammar']['num_json']}/{run['grammar']['num_requests']} |")
    for result in results:
        print(f"{result['concurrency']} concurrent: worst run {fmt(result['max_ratio'], '.3f')}x, target <= {TARGET_RATIO}: "
              f"{'met' if result['meets_target'] else 'MISSED'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server; default: start one (frontend.api_server)")
    p.add_argument("--model", default=None, help="the served model name; default: the first in /v1/models")
    p.add_argument("--server-model", default="smollm2", help="the model our server loads")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="an extra flag for our server")
    p.add_argument("--concurrency", default="8,32,64", help="comma-separated concurrent requests per round")
    p.add_argument("--runs", type=int, default=5, help="free/grammar pairs per concurrency")
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--fresh-server", action="store_true",
                   help="each run on a server of its own, the grammar unseen: its check and first compile in the run")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="the servers' step trace (TOKENLOOM_STEP_TRACE): each round's steps in the report")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.trace and args.url:
        p.error("--trace needs servers this script starts: leave out --url")
    if args.fresh_server and args.url:
        p.error("--fresh-server starts its own servers: leave out --url")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if not args.concurrency or min(args.concurrency) < 1 or args.runs < 1:
        p.error("--concurrency and --runs must be at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2: TPOT needs two tokens")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.trace:
        os.environ["TOKENLOOM_STEP_TRACE"] = args.trace  # the servers' environment is this one
    process = log_path = None
    base_url = args.url
    if base_url is None and not args.fresh_server:
        process, base_url, log_path = start_server(args.server_model, args.server_arg, log_name="bench-structured-runs")
    try:
        results = [run_runs(args, base_url, c) for c in args.concurrency]
    finally:
        if process is not None:
            stop_server(process)
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "url": base_url,
              "server_log": None if log_path is None else str(log_path), "schema": PERSON_SCHEMA,
              "results": results, "machine": machine_info()}
    print_table(results)
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
