"""Speculative decoding's speed (issue #46): one user's decode tok/s per configuration, and batched throughput.

    .venv/bin/python -m scripts.bench.speculative --json results/speculative.json
    .venv/bin/python -m scripts.bench.speculative --rounds 1 --output-len 16 --batched none   # a smoke run

One user. Every server is started once (free loopback ports) and stays up; an idle one takes
little CPU. A configuration is a server and a workload (scripts/lib/editing_workload.py):

    off          ours, no speculation                      editing: fix typos, rename, summarize (300-600 tokens)
    ngram        ours, --speculative-config ngram, K       editing
    prediction   ours (the `off` server), each request's `prediction` = the text it edits   editing
    off-chat     ours, no speculation                      free chat, nothing to copy
    self-int4    ours, --speculative-config draft self-int4   free chat
    llama-ngram  llama-server --spec-type ngram-mod, its defaults otherwise      editing
    llama-draft  llama-server -md (the Q4_1 GGUF as draft), its defaults otherwise   free chat

After one warm-up request each, --rounds rounds: in round i every configuration gets request i
of its workload (the same request for every configuration of a workload), one at a time, the
configurations' order rotated from round to round. Requests are streamed chat completions,
greedy, up to --output-len tokens. decode tok/s = (tokens written - 1) / (last chunk with text -
first chunk with text), tokens written being usage.completion_tokens less the prediction's
rejected tokens (which OpenAI bills as completion tokens). Per configuration: the median over
the rounds, and ratios: ngram and prediction over off, self-int4 over off-chat, ours over
llama.cpp's. Whether each round's text equals `off`'s (greedy speculation is exact) is recorded,
and so is each server's speculative decoding from /metrics (proposed, accepted, acceptance rate).
llama-server runs when its binary is there (--llama-server; scripts/peers/llamacpp.sh builds it).

Batched (--batched, scripts/bench/speculative_batched.py): the reference offline workload (64
requests), all-at-once serving (48 requests) with ngram on against off, and 4 users editing at
once (off, ngram, prediction), alternated over --batched-rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from scripts.lib.bench_report import machine_info, require_at_least_one, write_report
from scripts.lib.editing_workload import ChatRequest, make_editing_requests, make_free_requests
from scripts.lib.local_server import Server, scrape_metrics, spec_decode_delta, stop_server
from scripts.lib.speculative_servers import GGUF_DIR, LLAMA_BIN, TIMEOUT, start_servers, timed_chat
from scripts.lib.sse_client import served_model

logger = logging.getLogger("bench_speculative")

WARMUP_OUTPUT_LEN = 8
# configuration -> (server, workload, sends the prediction)
CONFIGS = {
    "off": ("ours-off", "edit", False),
    "ngram": ("ours-ngram", "edit", False),
    "prediction": ("ours-off", "edit", True),
    "off-chat": ("ours-off", "free", False),
    "self-int4": ("ours-draft", "free", False),
    "llama-ngram": ("llama-ngram", "edit", False),
    "llama-draft": ("llama-draft", "free", False),
}
DEFAULT_CONFIGS = "off,ngram,prediction,off-chat,self-int4,llama-ngram"
# ratio name -> (numerator, denominator)
RATIOS = {"ngram_vs_off": ("ngram", "off"), "prediction_vs_off": ("prediction", "off"),
          "self_int4_vs_off_chat": ("self-int4", "off-chat"), "ngram_vs_llama_ngram": ("ngram", "llama-ngram"),
          "self_int4_vs_llama_draft": ("self-int4", "llama-draft")}


@dataclass
class Config:
    name: str
    server: Server
    workload: str
    sends_prediction: bool
    runs: list[dict] = field(default_factory=list)


async def measure_single_user(configs: list[Config], workloads: dict[str, list[ChatRequest]],
                              args: argparse.Namespace, tokenizer) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for config in configs:
            config.server.model = config.server.model or await served_model(session, config.server.url)
            await timed_chat(session, config.server, workloads[config.workload][-1], WARMUP_OUTPUT_LEN,
                             config.sends_prediction, tokenizer)
        for config in configs:
            config.server.metrics_before = try_scrape(config.server.url)
        for index in range(args.rounds):
            shift = index % len(configs)
            for config in configs[shift:] + configs[:shift]:
                request = workloads[config.workload][index]
                run = await timed_chat(session, config.server, request, args.output_len, config.sends_prediction,
                                       tokenizer)
                config.runs.append({"round": index, "task": request.kind, "source": request.source, **run})
                logger.info("round %d %-12s %-10s %4d tokens  decode %6.1f tok/s  accepted %s", index, config.name,
                            request.kind, run["num_tokens"], run["decode_tok_s"] or 0.0,
                            run["accepted_prediction_tokens"])


def try_scrape(url: str) -> dict | None:
    try:
        return scrape_metrics(url)
    except OSError:
        return None  # llama-server serves /metrics only with --metrics


def summarize(config: Config, reference: Config | None) -> dict:
    speeds = [r["decode_tok_s"] for r in config.runs if r["decode_tok_s"] is not None]
    ttfts = [r["ttft_s"] for r in config.runs if r["ttft_s"] is not None]
    summary = {
        "server": config.server.name,
        "workload": config.workload,
        "median_decode_tok_s": statistics.median(speeds) if speeds else None,
        "decode_tok_s_runs": speeds,
        "median_ttft_ms": statistics.median(ttfts) * 1000 if ttfts else None,
        "num_tokens_runs": [r["num_tokens"] for r in config.runs],
        "runs": [{k: v for k, v in r.items() if k != "text"} for r in config.runs],
    }
    if reference is not None and reference is not config:
        summary["same_text_as_" + reference.name] = [
            r["text"] == ref["text"] for r, ref in zip(config.runs, reference.runs)]
    return summary


def ratios(results: dict[str, dict]) -> dict[str, float]:
    out = {}
    for name, (top, bottom) in RATIOS.items():
        a = results.get(top, {}).get("median_decode_tok_s")
        b = results.get(bottom, {}).get("median_decode_tok_s")
        if a and b:
            out[name] = round(a / b, 3)
    return out


def run_single_user(args: argparse.Namespace, tokenizer) -> dict:
    names = list(dict.fromkeys(CONFIGS[c][0] for c in args.configs))
    servers = start_servers(names, args)
    workloads = {"edit": make_editing_requests(args.rounds + 1, tokenizer, args.seed, tuple(args.text_tokens)),
                 "free": make_free_requests(args.rounds + 1, args.seed)}
    configs = [Config(name, servers[CONFIGS[name][0]], CONFIGS[name][1], CONFIGS[name][2]) for name in args.configs]
    asyncio.run(measure_single_user(configs, workloads, args, tokenizer))
    spec_decode = {s.name: spec_decode_delta(s.metrics_before, try_scrape(s.url)) for s in servers.values()}
    by_name = {c.name: c for c in configs}
    references = {"edit": by_name.get("off"), "free": by_name.get("off-chat")}
    results = {c.name: summarize(c, references[c.workload]) for c in configs}
    return {"results": results, "ratios": ratios(results), "spec_decode_by_server": spec_decode,
            "commands": {s.name: shlex.join(s.command) for s in servers.values()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, from {', '.join(CONFIGS)}; llama "
                   "ones are dropped when --llama-server is missing")
    p.add_argument("--rounds", type=int, default=5, help="single user: rounds (the median is over them)")
    p.add_argument("--output-len", type=int, default=512, help="max_tokens of each request")
    p.add_argument("--text-tokens", type=int, nargs=2, default=(300, 600), metavar=("LO", "HI"),
                   help="the edited text's length in tokens")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="ngram: the most tokens proposed per step")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="self-int4: the most tokens drafted per step")
    p.add_argument("--model", default="smollm2", help="what our servers load")
    p.add_argument("--ours-extra", default="", metavar="ARGS", help="more flags for every server of ours")
    p.add_argument("--llama-server", type=Path, default=LLAMA_BIN, help="llama.cpp's llama-server binary")
    p.add_argument("--gguf-dir", type=Path, default=GGUF_DIR)
    p.add_argument("--llama-gguf", default="smollm2-bf16.gguf", help="the model llama-server serves (in --gguf-dir)")
    p.add_argument("--llama-draft-gguf", default="smollm2-q4_1.gguf", help="llama-draft's draft model")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--batched", default="offline,serving,concurrent",
                   help="batched runs, comma-separated from offline, serving, concurrent; none: skip")
    p.add_argument("--batched-rounds", type=int, default=3, help="batched: off/ngram alternations")
    p.add_argument("--num-offline-requests", type=int, default=64)
    p.add_argument("--num-serving-requests", type=int, default=48)
    p.add_argument("--num-users", type=int, default=4, help="concurrent: editing users at once")
    p.add_argument("--offline-args", default="", metavar="ARGS",
                   help="more flags for scripts.bench.offline's workload (e.g. '--output-len 4 8' for a smoke run)")
    p.add_argument("--serving-args", default="", metavar="ARGS", help="more flags for scripts.bench.serving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    p.add_argument("--json", default="results/speculative.json", metavar="PATH")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("rounds", "output_len", "num_speculative_tokens", "num_draft_tokens",
                                   "batched_rounds", "num_users"))
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip() and c.strip() != "none"]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    llama = [c for c in args.configs if c.startswith("llama-")]
    if llama and not args.llama_server.is_file():
        logger.warning("no llama-server at %s: %s left out", args.llama_server, ", ".join(llama))
        args.configs = [c for c in args.configs if c not in llama]
    args.batched = [b.strip() for b in args.batched.split(",") if b.strip() and b.strip() != "none"]
    if set(args.batched) - {"offline", "serving", "concurrent"}:
        p.error("--batched takes offline, serving, concurrent (comma-separated) or none")
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    from engine.loader.model_files import resolve_model
    from ipc.text.tokenizer import Tokenizer
    from scripts.bench.speculative_batched import run_batched

    tokenizer = Tokenizer(resolve_model(args.model))
    load_before = os.getloadavg()[0]
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
              "load_average_1m_before": load_before, "machine": machine_info()}
    args.servers = {}  # name -> Server, every server started, stopped at the end
    try:
        if args.configs:
            report["single_user"] = run_single_user(args, tokenizer)
            print("single user, median decode tok/s:", json.dumps(
                {name: r["median_decode_tok_s"] for name, r in report["single_user"]["results"].items()}))
            print("ratios:", json.dumps(report["single_user"]["ratios"]))
        if args.batched:
            report["batched"] = run_batched(args, tokenizer)
            print("batched:", json.dumps(report["batched"]["ratios"]))
    finally:
        for server in args.servers.values():
            if server.process is not None:
                stop_server(server.process, timeout_s=60)
    write_report(args.json, report, logger=logger)
    return report


if __name__ == "__main__":
    main()
