"""Several users at once against llama.cpp's `llama-server -np N` (issue #59): total output tok/s.

    flock /tmp/bench.lock .venv/bin/python -m scripts.bench.multi_user --users 4 --servers ours-bf16 \
        --model F.gguf --llama-gguf F.gguf --llama-server PATH --threads 2 --repeats 3 --json results/multi_user.json

scripts/bench/single_user.py's servers, flags and method (every server up at once, the order
rotated from round to round, the same random token-id prompts for every server), with --users
streamed requests sent together in each round instead of one; llama-server gets `-np USERS`,
so each user has a slot of its own, as each has a sequence of ours. Each user's prompt differs
(no prefix is shared). Per round and server:

    output tok/s    the users' completion tokens / (first request sent -> last chunk with text)
    TTFT, decode    each user's, as single_user.py measures them (medians over users and rounds)

and per server the median over the rounds of the output tok/s, with the ratio to ours-bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics

import aiohttp

from scripts.bench import single_user
from scripts.lib.bench_report import write_report
from scripts.lib.sse_client import served_model
from scripts.lib.workload import make_workload

logger = logging.getLogger("bench_multi_user")


def make_server(name: str, args: argparse.Namespace, port: int) -> single_user.Server:
    """single_user's server, with llama-server's parallel slots set to --users."""
    server = single_user.make_server(name, args, port)
    if "-np" in server.command:
        server.command[server.command.index("-np") + 1] = str(args.users)
    return server


async def one_round(session: aiohttp.ClientSession, server, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt sent at once to `server`; the round's output tok/s and each user's figures."""
    runs = await asyncio.gather(*(single_user.timed_request(session, server, p, output_len) for p in prompts))
    wall_s = max(run["latency_s"] for run in runs)  # each from its own send; the sends leave together
    for run in runs:
        if run["num_completion_tokens"] != output_len:
            raise SystemExit(f"{server.name}: {run['num_completion_tokens']} tokens, not {output_len}")
    return {"output_tok_s": sum(run["num_completion_tokens"] for run in runs) / wall_s, "wall_s": wall_s,
            "users": runs}


async def measure(servers: list, args: argparse.Namespace, rates: single_user.HostRates) -> None:
    requests = make_workload((args.repeats + 1) * args.users, (args.prompt_len, args.prompt_len),
                             (args.output_len, args.output_len), seed=args.seed, vocab_size=single_user.VOCAB_SIZE)
    prompts = [r.prompt_token_ids for r in requests]
    rounds = [prompts[i * args.users:(i + 1) * args.users] for i in range(args.repeats + 1)]
    async with aiohttp.ClientSession(timeout=single_user.TIMEOUT,
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        for server in servers:
            server.model = await served_model(session, server.url)
            warm = await one_round(session, server, rounds[0], single_user.WARMUP_OUTPUT_LEN)
            logger.info("%s warmed up (%.1f tok/s)", server.name, warm["output_tok_s"])
        for index, round_prompts in enumerate(rounds[1:]):
            rates.take(index)
            shift = index % len(servers)
            for server in servers[shift:] + servers[:shift]:
                result = await one_round(session, server, round_prompts, args.output_len)
                server.runs.append({"round": index, **result})
                users = result["users"]
                logger.info("round %d %-12s %6.1f tok/s out  TTFT median %7.1f ms  decode median %5.1f tok/s  "
                            "other CPU max %3.0f%%", index, server.name, result["output_tok_s"],
                            statistics.median(u["ttft_s"] for u in users) * 1000,
                            statistics.median(u["decode_tok_s"] for u in users),
                            max(u["other_cpu_share"] for u in users) * 100)


def summarize(server) -> dict:
    users = [u for r in server.runs for u in r["users"]]
    return {"command": " ".join(server.command), "log": str(server.log_path),
            "median_output_tok_s": statistics.median(r["output_tok_s"] for r in server.runs),
            "output_tok_s_runs": [r["output_tok_s"] for r in server.runs],
            "median_ttft_ms": statistics.median(u["ttft_s"] for u in users) * 1000,
            "median_user_decode_tok_s": statistics.median(u["decode_tok_s"] for u in users),
            "max_other_cpu_share": max(u["other_cpu_share"] for u in users), "runs": server.runs}


def markdown_table(results: dict[str, dict], reference: str | None) -> str:
    lines = ["| server | output tok/s (median) | runs | TTFT median (ms) | a user's decode (tok/s) | max other CPU |"
             + (f" vs {reference} |" if reference else ""), "|---|---:|---|---:|---:|---:|" + ("---:|" if reference else "")]
    for name, r in results.items():
        row = (f"| {name} | {r['median_output_tok_s']:.1f} | {', '.join(f'{v:.1f}' for v in r['output_tok_s_runs'])} "
               f"| {r['median_ttft_ms']:.0f} | {r['median_user_decode_tok_s']:.1f} | {r['max_other_cpu_share']:.0%} |")
        if reference:
            row += f" {r['median_output_tok_s'] / results[reference]['median_output_tok_s']:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    report = single_user.run_servers(args, make_server, measure)
    results = {server.name: summarize(server) for server in report.pop("servers")}
    reference = "ours-bf16" if "ours-bf16" in results else None
    return {"results": results, "table": markdown_table(results, reference), **report}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = single_user.argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=4, help="requests in flight at once (llama-server -np)")
    p.set_defaults(json="results/multi_user.json")
    args = single_user.check_args(p, p.parse_args(argv))
    if args.users < 1:
        p.error("--users must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = run(args)
    write_report(args.json, report, logger=logger)
    print(report["table"])
    return report


if __name__ == "__main__":
    main()
