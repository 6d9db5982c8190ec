"""Single-user speed against llama.cpp's `llama-server` (issue #28): TTFT and decode tok/s, one request at a time.

    scripts/peers/llamacpp.sh            # once: builds .peers/llama.cpp/bin, writes .peers/gguf/*.gguf
    .venv/bin/python -m scripts.bench.single_user --repeats 3 --json results/single_user.json
    .venv/bin/python -m scripts.bench.single_user --servers llama-q8_0,ours-int8 --ours-extra "--no-compile"

Every server in --servers is started once (each on a free loopback port) and all stay up
while measuring; an idle one takes little CPU. Each gets one warm-up request, then
--repeats rounds: in each round every server gets the same request, one at a time, the
servers' order rotated from round to round so that none always goes first and all see the
same host speed. A request is a streamed `/v1/completions` of --prompt-len random token ids
(the same ids for every server; fresh ids each round, so no prompt cache helps), greedy,
--output-len tokens with EOS ignored. Per request:

    TTFT            request sent -> first chunk with text
    decode tok/s    (completion tokens - 1) / (last chunk with text - first chunk with text)

and per server the median over the rounds. A server that runs a GGUF's own blocks (ours at its
defaults on --model F.gguf, llama-server on any file) also gets each run's weight GB/s (decode
tok/s x the bytes one step reads of the file) and its share of the two-thread stream rate taken
before that round (scripts/lib/weight_stream.py; issue #59's bar). Each request also records
`other_cpu_share`: the host's busy CPU time during the request less that of the server's
processes and this one, over wall time x cores. A run where it is high (another job on the machine, or an idle server
that is not idle) is suspect: llama.cpp's threads spin at barriers, so a rival process on one
of two cores can slow it several-fold. llama-server runs with `-t THREADS -np 1` and its
defaults otherwise, on the bf16, Q8_0 and Q4_1 GGUFs of scripts/peers/llamacpp.sh (all three
hold the same weights: the bf16 file is the Q4_1 one dequantized, as our converted folder is);
its prompt cache is turned off per request (`cache_prompt: false`). Ours runs
`frontend.cli serve --model smollm2` at its defaults (bf16), with `--quantization int8` and `int4`, and,
given --ours-extra, with those extra flags as `ours-extra`. `ours-int8-q8_0` and `ours-int4-q4_1`
(not in the default list) serve llama.cpp's own Q8_0 and Q4_1 files with their blocks as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import aiohttp

from scripts.lib.bench_report import machine_info, read_rate_gb_s, require_at_least_one, write_report
from scripts.lib.cpu_share import cpu_snapshot, other_cpu_share
from scripts.lib.local_server import REPO_ROOT, Server, free_port, launch_server, stop_server
from scripts.lib.sse_client import StreamStatusError, served_model, stream_chunks
from scripts.lib.weight_stream import StreamProbe, decode_weight_bytes, weight_rates
from scripts.lib.workload import make_workload

logger = logging.getLogger("bench_single_user")

LLAMA_BIN = REPO_ROOT / ".peers" / "llama.cpp" / "bin" / "llama-server"
GGUF_DIR = REPO_ROOT / ".peers" / "gguf"
LLAMA_GGUFS = {"llama-bf16": "smollm2-bf16.gguf", "llama-q8_0": "smollm2-q8_0.gguf", "llama-q4_1": "smollm2-q4_1.gguf"}
OURS_FLAGS = {"ours-bf16": [], "ours-int8": ["--quantization", "int8"], "ours-int4": ["--quantization", "int4"],
              "ours-int8-q8_0": ["--quantization", "int8"], "ours-int4-q4_1": ["--quantization", "int4"]}
# Ours on llama.cpp's own files: the GGUF's blocks as they are (engine/loader/gguf_blocks.py), the very weights it runs.
OURS_GGUFS = {"ours-int8-q8_0": "smollm2-q8_0.gguf", "ours-int4-q4_1": "smollm2-q4_1.gguf"}
DEFAULT_SERVERS = "llama-bf16,llama-q8_0,llama-q4_1,ours-bf16,ours-int8,ours-int4"
VOCAB_SIZE = 49152  # SmolLM2's
TIMEOUT = aiohttp.ClientTimeout(total=3600)
WARMUP_OUTPUT_LEN = 16
PROMPT_SEED = 128


def make_server(name: str, args: argparse.Namespace, port: int) -> Server:
    """The command line of server `name` on `port`."""
    if name in LLAMA_GGUFS or name == "llama-file":
        gguf = Path(args.llama_gguf) if name == "llama-file" else Path(args.gguf_dir) / LLAMA_GGUFS[name]
        if not gguf.is_file():
            raise SystemExit(f"{gguf} is missing; run scripts/peers/llamacpp.sh")
        command = [str(args.llama_server), "-m", str(gguf), "-t", str(args.threads), "-np", "1",
                   "--host", "127.0.0.1", "--port", str(port)]
        return Server(name, command, {"cache_prompt": False}, f"http://127.0.0.1:{port}")
    flags = OURS_FLAGS.get(name)
    if name == "ours-extra":
        flags = shlex.split(args.ours_extra)
    model = str(Path(args.gguf_dir) / OURS_GGUFS[name]) if name in OURS_GGUFS else args.model
    command = [sys.executable, "-m", "frontend.cli", "serve", "--model", model, "--port", str(port), *flags]
    return Server(name, command, {}, f"http://127.0.0.1:{port}")


async def timed_request(session: aiohttp.ClientSession, server: Server, prompt_token_ids: list[int],
                        max_tokens: int) -> dict:
    """One streamed completion; its TTFT, decode speed and the server's own counts."""
    payload = {"model": server.model, "prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
               **server.payload_extra}
    text_times: list[float] = []
    num_text_chunks, usage, timings = 0, None, None
    cpu_before = cpu_snapshot(server.process.pid)
    send_time = time.perf_counter()
    try:
        async for now, chunk in stream_chunks(session, server.url + "/v1/completions", payload):
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                text_times.append(now)
                num_text_chunks += 1
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server's own figures
    except StreamStatusError as error:
        raise SystemExit(f"{server.name}: {error}") from None
    if len(text_times) < 2:
        raise SystemExit(f"{server.name}: the stream carried {len(text_times)} chunks with text")
    end_time = time.perf_counter()
    cpu_after = cpu_snapshot(server.process.pid)
    num_tokens = (usage or {}).get("completion_tokens", num_text_chunks)
    run = {
        "ttft_s": text_times[0] - send_time,
        "decode_tok_s": (num_tokens - 1) / (text_times[-1] - text_times[0]),
        "latency_s": text_times[-1] - send_time,
        "num_completion_tokens": num_tokens,
        "num_prompt_tokens": (usage or {}).get("prompt_tokens"),
        "num_text_chunks": num_text_chunks,
        "other_cpu_share": other_cpu_share(cpu_before, cpu_after, end_time - send_time),
    }
    if timings:
        run["server_timings"] = timings
    return run


def served_gguf(name: str, args: argparse.Namespace) -> Path | None:
    """The GGUF whose blocks server `name` runs as they are, or None (a folder, or requantized)."""
    if name == "llama-file":
        return Path(args.llama_gguf)
    if name in LLAMA_GGUFS or name in OURS_GGUFS:
        return Path(args.gguf_dir) / {**LLAMA_GGUFS, **OURS_GGUFS}[name]
    return Path(args.model) if name == "ours-bf16" and str(args.model).endswith(".gguf") else None


class HostRates:
    """The host's memory before each round, to read that round's figures against: one core's
    read, and where some server runs a GGUF's own blocks, the stream rate (`StreamProbe`)."""

    def __init__(self, probe: StreamProbe | None) -> None:
        self.probe = probe
        self.read_gb_s: list[float] = []
        self.stream_gb_s: list[float] = []

    def take(self, index: int) -> None:
        self.read_gb_s.append(read_rate_gb_s())
        if self.probe is not None:
            self.stream_gb_s.append(self.probe.measure())
        logger.info("round %d: memory read %.1f GB/s (one core)%s", index, self.read_gb_s[-1],
                    f", stream {self.stream_gb_s[-1]:.1f} GB/s ({self.probe.threads} threads)" if self.stream_gb_s else "")


async def measure(servers: list[Server], args: argparse.Namespace, rates: HostRates) -> None:
    """Warm each server up, then the rounds: one request per server per round, order rotated;
    the host's memory rates taken before each round (`rates`)."""
    requests = make_workload(args.repeats + 1, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len),
                             seed=args.seed, vocab_size=VOCAB_SIZE)
    warmup, rounds = requests[0], requests[1:]
    # A fresh connection per request: llama-server closes an idle kept-alive one while the other
    # servers take their turn, and the next request's write then failed ("Can not write request body").
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(force_close=True)) as session:
        for server in servers:
            server.model = await served_model(session, server.url)
            run = await timed_request(session, server, warmup.prompt_token_ids, WARMUP_OUTPUT_LEN)
            logger.info("%s warmed up (TTFT %.0f ms)", server.name, run["ttft_s"] * 1000)
        for index, request in enumerate(rounds):
            rates.take(index)
            shift = index % len(servers)
            for server in servers[shift:] + servers[:shift]:
                run = await timed_request(session, server, request.prompt_token_ids, args.output_len)
                if run["num_completion_tokens"] != args.output_len:
                    raise SystemExit(f"{server.name}: {run['num_completion_tokens']} tokens, not {args.output_len}")
                server.runs.append({"round": index, **run})
                logger.info("round %d %-12s TTFT %7.1f ms  decode %6.1f tok/s  other CPU %3.0f%%", index,
                            server.name, run["ttft_s"] * 1000, run["decode_tok_s"], run["other_cpu_share"] * 100)


def summarize(server: Server, weight_bytes: int | None, stream_gb_s: list[float]) -> dict:
    """The server's medians; given the bytes its decode step reads, each run's weight rate and its
    share of its round's stream rate (issue #59's bar)."""
    ttfts = [r["ttft_s"] for r in server.runs]
    speeds = [r["decode_tok_s"] for r in server.runs]
    summary = {
        "command": shlex.join(server.command),
        "log": str(server.log_path),
        "median_ttft_ms": statistics.median(ttfts) * 1000,
        "median_decode_tok_s": statistics.median(speeds),
        "ttft_ms_runs": [t * 1000 for t in ttfts],
        "decode_tok_s_runs": speeds,
        "num_prompt_tokens": sorted({r["num_prompt_tokens"] for r in server.runs}, key=str),
        "max_other_cpu_share": max(r["other_cpu_share"] for r in server.runs),
        "runs": server.runs,
    }
    if weight_bytes is not None and stream_gb_s:
        for run in server.runs:
            run.update(weight_rates(run["decode_tok_s"], weight_bytes, stream_gb_s[run["round"]]))
        summary.update(weight_bytes=weight_bytes,
                       median_weight_gb_s=statistics.median(r["weight_gb_s"] for r in server.runs),
                       median_share_of_stream=statistics.median(r["share_of_stream"] for r in server.runs),
                       share_of_stream_runs=[r["share_of_stream"] for r in server.runs])
    return summary


def markdown_table(results: dict[str, dict], reference: str | None) -> str:
    lines = ["| server | TTFT median (ms) | decode median (tok/s) | decode runs (tok/s) | weights GB/s (share "
             "of stream) | max other CPU |" + (f" decode vs {reference} |" if reference else ""),
             "|---|---:|---:|---|---:|---:|" + ("---:|" if reference else "")]
    for name, result in results.items():
        runs = ", ".join(f"{v:.1f}" for v in result["decode_tok_s_runs"])
        weights = (f"{result['median_weight_gb_s']:.1f} ({result['median_share_of_stream']:.2f})"
                   if "median_weight_gb_s" in result else "")
        row = (f"| {name} | {result['median_ttft_ms']:.1f} | {result['median_decode_tok_s']:.1f} | {runs} "
               f"| {weights} | {result['max_other_cpu_share']:.0%} |")
        if reference:
            row += f" {result['median_decode_tok_s'] / results[reference]['median_decode_tok_s']:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def llama_version(binary: Path) -> str:
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as error:
        return f"unavailable: {error}"
    return " ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if "version" in line
                    or "built with" in line)


def git_revision() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=REPO_ROOT)
    return done.stdout.strip()


def run_servers(args: argparse.Namespace, make: Callable, measure_all: Callable) -> dict:
    """Start every server (`make(name, args, port)`), `measure_all(servers, args, rates)`, stop
    them; returns the servers, with their runs, each one's decode weight bytes (a GGUF's, or None),
    and the run's facts (config, versions, load, the host's memory rates by round)."""
    load_before = os.getloadavg()[0]
    servers = [make(name, args, free_port()) for name in args.servers]
    weight_bytes = {}
    for server in servers:
        gguf = served_gguf(server.name, args)
        weight_bytes[server.name] = decode_weight_bytes(gguf) if gguf is not None else None
    # The probe's 2 GB are allocated and touched before the servers start, not while they serve.
    rates = HostRates(StreamProbe(threads=args.threads) if any(weight_bytes.values()) else None)
    try:
        for server in servers:
            server.log_path = Path(args.log_dir) / f"{Path(sys.argv[0]).stem}-{server.name}.log"
            start = time.monotonic()
            logger.info("starting %s: %s", server.name, shlex.join(server.command))
            server.process = launch_server(server.command, server.url, server.log_path)
            logger.info("%s up after %.1f s", server.name, time.monotonic() - start)
        asyncio.run(measure_all(servers, args, rates))
    finally:
        for server in servers:
            if server.process is not None:
                stop_server(server.process, timeout_s=60)
    return {
        "servers": servers,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
        "llama_server_version": llama_version(args.llama_server),
        "tokenloom_revision": git_revision(),
        "load_average_1m_before": load_before,
        "read_gb_s_by_round": rates.read_gb_s,
        "stream_gb_s_by_round": rates.stream_gb_s,
        "stream_threads": args.threads,
        "weight_bytes": weight_bytes,
        "machine": machine_info(),
    }


def run(args: argparse.Namespace) -> dict:
    report = run_servers(args, make_server, measure)
    results = {server.name: summarize(server, report["weight_bytes"][server.name], report["stream_gb_s_by_round"])
               for server in report.pop("servers")}
    reference = "ours-bf16" if "ours-bf16" in results else None
    return {"results": results, "table": markdown_table(results, reference), **report}


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The flags this script and its siblings (multi_user.py) share."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--servers", default=DEFAULT_SERVERS,
                   help=f"comma-separated, from {', '.join([*LLAMA_GGUFS, *OURS_FLAGS, 'ours-extra'])} "
                        "(ours-extra is added when --ours-extra is given)")
    p.add_argument("--ours-extra", default=None, metavar="ARGS", help="flags for a further `ours-extra` server")
    p.add_argument("--llama-gguf", type=Path, default=None, metavar="PATH",
                   help="a GGUF for a further `llama-file` server (llama-server on it; give ours the same file "
                        "with --model and --servers ours-bf16, which then serves it at our defaults)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; each server gets one request per round")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--model", default="smollm2", help="what our servers load")
    p.add_argument("--llama-server", type=Path, default=LLAMA_BIN)
    p.add_argument("--gguf-dir", type=Path, default=GGUF_DIR)
    p.add_argument("--seed", type=int, default=PROMPT_SEED, help="for the prompts' token ids")
    p.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    p.add_argument("--json", default="results/single_user.json", metavar="PATH")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The shared flags checked (p.error on a bad one), --servers as a list."""
    require_at_least_one(p, args, ("repeats", "prompt_len", "threads"))
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (decode speed needs two tokens)")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.ours_extra is not None and "ours-extra" not in args.servers:
        args.servers.append("ours-extra")
    if args.llama_gguf is not None and "llama-file" not in args.servers:
        args.servers.append("llama-file")
    unknown = set(args.servers) - {*LLAMA_GGUFS, *OURS_FLAGS, "ours-extra", "llama-file"}
    if unknown:
        p.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if "ours-extra" in args.servers and args.ours_extra is None:
        p.error("ours-extra needs --ours-extra")
    if "llama-file" in args.servers and (args.llama_gguf is None or not args.llama_gguf.is_file()):
        p.error("llama-file needs --llama-gguf naming a file")
    if len(set(args.servers)) != len(args.servers) or not args.servers:
        p.error("--servers: at least one, each once")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__.split("\n\n")[0])
    return check_args(p, p.parse_args(argv))


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = run(args)
    write_report(args.json, report, logger=logger)
    print(report["table"])
    return report


if __name__ == "__main__":
    main()
