"""Speculative decoding under load, for scripts/bench/speculative.py: it must not cost batched throughput.

    offline     the reference offline workload (scripts.bench.offline's defaults: 64 requests, random
                prompts of 16-256 tokens, 16-256 out, greedy, EOS ignored), continuous batching, ngram
                on against off: total tokens/s
    serving     all-at-once serving (scripts.bench.serving, 48 requests at once) on our ngram server
                against the off one: total token throughput
    concurrent  --num-users editing requests at once (scripts/lib/editing_workload.py) on the off
                server, the ngram server, and the off server with each request's prediction: written
                tokens per second over the batch's wall time, and each user's decode tok/s

Each runs --batched-rounds rounds, the configurations' order alternating from round to round,
and reports each configuration's median and the ratios to off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import time
from pathlib import Path

import aiohttp

from scripts.lib.editing_workload import make_editing_requests
from scripts.lib.speculative_servers import TIMEOUT, start_servers, timed_chat
from scripts.lib.sse_client import served_model

logger = logging.getLogger("bench_speculative")


def alternated(names: list[str], round_index: int) -> list[str]:
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def medians(runs: dict[str, list[dict]], key: str) -> dict[str, float | None]:
    return {name: statistics.median(v) if (v := [r[key] for r in rs if r.get(key) is not None]) else None
            for name, rs in runs.items()}


def ratio_to_off(values: dict[str, float | None]) -> dict[str, float]:
    off = values.get("off")
    return {f"{name}_vs_off": round(v / off, 3) for name, v in values.items() if name != "off" and v and off}


def run_offline(args: argparse.Namespace) -> dict:
    from scripts.bench import offline
    from scripts.lib.workload import make_workload

    from engine.loader.model_files import resolve_model

    oargs = offline.parse_args(["--model", args.model, "--modes", "continuous",
                                "--num-requests", str(args.num_offline_requests), *shlex.split(args.offline_args)])
    vocab_size = json.loads((Path(resolve_model(oargs.model)) / "config.json").read_text())["vocab_size"]
    workload = make_workload(oargs.num_requests, oargs.input_len, oargs.output_len, oargs.distribution, oargs.seed,
                             vocab_size=vocab_size)
    specs = {"off": None, "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens})}
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for index in range(args.batched_rounds):
        for name in alternated(list(specs), index):
            oargs.speculative_config = specs[name]
            summary = offline.run_engine("continuous", workload, oargs).summary()
            runs[name].append(summary)
            logger.info("offline round %d %-6s %.1f total tok/s  %s", index, name, summary["total_tokens_per_s"],
                        summary.get("spec_decode", {}))
    values = medians(runs, "total_tokens_per_s")
    return {"median_total_tokens_per_s": values, "ratios": ratio_to_off(values), "runs": runs}


def run_serving(args: argparse.Namespace) -> dict:
    from scripts.bench import serving

    sargs = serving.parse_args(["--num-requests", str(args.num_serving_requests), "--tokenizer", args.model,
                                "--no-progress", *shlex.split(args.serving_args)])
    workload, _ = serving.load_workload(sargs)
    servers = start_servers(["ours-off", "ours-ngram"], args)
    urls = {"off": servers["ours-off"].url, "ngram": servers["ours-ngram"].url}
    runs: dict[str, list[dict]] = {name: [] for name in urls}
    for index in range(args.batched_rounds):
        for name in alternated(list(urls), index):
            summary = serving.run_once(sargs, urls[name], workload, None)["summary"]
            runs[name].append(summary)
            logger.info("serving round %d %-6s %.1f total tok/s", index, name, summary["total_token_throughput"])
    values = medians(runs, "total_token_throughput")
    return {"median_total_token_throughput": values, "ratios": ratio_to_off(values), "runs": runs}


async def _concurrent_rounds(args: argparse.Namespace, configs: dict, tokenizer) -> dict[str, list[dict]]:
    requests = make_editing_requests(args.batched_rounds * args.num_users, tokenizer, args.seed + 1,
                                     tuple(args.text_tokens))
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for server, _ in configs.values():
            server.model = server.model or await served_model(session, server.url)
        for index in range(args.batched_rounds):
            batch = requests[index * args.num_users:(index + 1) * args.num_users]
            for name in alternated(list(configs), index):
                server, sends_prediction = configs[name]
                start = time.perf_counter()
                users = await asyncio.gather(*(timed_chat(session, server, request, args.output_len,
                                                          sends_prediction, tokenizer) for request in batch))
                wall_s = time.perf_counter() - start
                num_tokens = sum(u["num_tokens"] for u in users)
                speeds = [u["decode_tok_s"] for u in users if u["decode_tok_s"] is not None]
                runs[name].append({"round": index, "wall_s": wall_s, "num_tokens": num_tokens,
                                   "tokens_per_s": num_tokens / wall_s,
                                   "mean_user_decode_tok_s": statistics.mean(speeds) if speeds else None,
                                   "accepted_prediction_tokens": [u["accepted_prediction_tokens"] for u in users]})
                logger.info("concurrent round %d %-10s %.1f tok/s over %d users", index, name,
                            num_tokens / wall_s, len(batch))
    return runs


def run_concurrent(args: argparse.Namespace, tokenizer) -> dict:
    servers = start_servers(["ours-off", "ours-ngram"], args)
    configs = {"off": (servers["ours-off"], False), "ngram": (servers["ours-ngram"], False),
               "prediction": (servers["ours-off"], True)}
    runs = asyncio.run(_concurrent_rounds(args, configs, tokenizer))
    values = medians(runs, "tokens_per_s")
    return {"num_users": args.num_users, "median_tokens_per_s": values, "ratios": ratio_to_off(values),
            "median_user_decode_tok_s": medians(runs, "mean_user_decode_tok_s"), "runs": runs}


def run_batched(args: argparse.Namespace, tokenizer) -> dict:
    results = {}
    if "offline" in args.batched:
        results["offline"] = run_offline(args)
    if "serving" in args.batched:
        results["serving"] = run_serving(args)
    if "concurrent" in args.batched:
        results["concurrent"] = run_concurrent(args, tokenizer)
    return {"results": results, "ratios": {kind: r["ratios"] for kind, r in results.items()}}
