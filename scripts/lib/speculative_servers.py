"""The servers scripts/bench/speculative.py measures, and one timed streamed chat on one of them.

Both halves of the benchmark use these: the single-user rounds (scripts/bench/speculative.py)
and the batched ones (scripts/bench/speculative_batched.py), which reuse the servers already up.
A server is named by what it runs:

    ours-off      frontend.cli serve --model M, no speculation
    ours-ngram    ... --speculative-config {"method": "ngram", "num_speculative_tokens": K}
    ours-draft    ... --speculative-config {"method": "draft", "model": "self-int4", ...}
    llama-ngram   llama-server --spec-type ngram-mod
    llama-draft   llama-server -md DRAFT_GGUF
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import aiohttp

from scripts.lib.editing_workload import ChatRequest
from scripts.lib.local_server import REPO_ROOT, Server, free_port, launch_server
from scripts.lib.sse_client import StreamStatusError, stream_chunks

logger = logging.getLogger("bench_speculative")

LLAMA_BIN = REPO_ROOT / ".peers" / "llama.cpp" / "bin" / "llama-server"
GGUF_DIR = REPO_ROOT / ".peers" / "gguf"
TIMEOUT = aiohttp.ClientTimeout(total=3600)


def spec_flag(method: dict) -> list[str]:
    return ["--speculative-config", json.dumps(method)]


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """Server `name`'s command line on `port`, and the payload fields only it takes."""
    if name.startswith("llama-"):
        gguf = Path(args.gguf_dir) / args.llama_gguf
        command = [str(args.llama_server), "-m", str(gguf), "-t", str(args.threads), "-np", "1",
                   "--host", "127.0.0.1", "--port", str(port)]
        if name == "llama-ngram":
            command += ["--spec-type", "ngram-mod"]  # its n-gram lookup of choice (drafts up to 64 tokens)
        else:
            command += ["-md", str(Path(args.gguf_dir) / args.llama_draft_gguf)]
        return command, {"cache_prompt": False}
    flags = {"ours-off": [],
             "ours-ngram": spec_flag({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}),
             "ours-draft": spec_flag({"method": "draft", "model": "self-int4",
                                      "num_speculative_tokens": args.num_draft_tokens})}[name]
    command = [sys.executable, "-m", "frontend.cli", "serve", "--model", args.model, "--port", str(port),
               "--log-level", "warning", *flags, *shlex.split(args.ours_extra)]
    return command, {}


def start_servers(names: list[str], args: argparse.Namespace) -> dict[str, Server]:
    """Start the servers of `names` not yet in args.servers (where each is listed before it starts, so
    that main stops every one, a failed start included); return them all by name."""
    servers = args.servers
    for name in names:
        if name in servers:
            continue
        port = free_port()
        command, extra = server_command(name, args, port)
        server = Server(name, command, extra, f"http://127.0.0.1:{port}",
                        log_path=Path(args.log_dir) / f"speculative-{name}.log")
        servers[name] = server  # listed before it starts, so a failed start still stops the others
        start = time.monotonic()
        logger.info("starting %s: %s", name, shlex.join(command))
        server.process = launch_server(command, server.url, server.log_path)
        logger.info("%s up after %.1f s", name, time.monotonic() - start)
    return servers


async def timed_chat(session: aiohttp.ClientSession, server: Server, request: ChatRequest, max_tokens: int,
                     sends_prediction: bool, tokenizer) -> dict:
    """One streamed chat completion: its TTFT, decode speed, text and prediction counts."""
    payload = {"model": server.model, "messages": request.messages, "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, **server.payload_extra}
    if sends_prediction:
        payload["prediction"] = {"type": "content", "content": request.prediction}
    text_times, parts, usage = [], [], None
    send_time = time.perf_counter()
    try:
        async for now, chunk in stream_chunks(session, server.url + "/v1/chat/completions", payload):
            choices = chunk.get("choices") or []
            text = (choices[0].get("delta") or {}).get("content") if choices else None
            if text:
                text_times.append(now)
                parts.append(text)
            usage = chunk.get("usage") or usage
    except StreamStatusError as error:
        raise SystemExit(f"{server.name}: {error}") from None
    text = "".join(parts)
    details = (usage or {}).get("completion_tokens_details") or {}
    rejected = details.get("rejected_prediction_tokens") or 0
    if usage and "completion_tokens" in usage:
        num_tokens = usage["completion_tokens"] - rejected
    else:  # the same vocabulary: count the text's tokens
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    decode_s = text_times[-1] - text_times[0] if len(text_times) > 1 else 0.0
    return {
        "ttft_s": text_times[0] - send_time if text_times else None,
        "decode_tok_s": (num_tokens - 1) / decode_s if decode_s > 0 else None,
        "num_tokens": num_tokens,
        "num_text_chunks": len(text_times),
        "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
        "rejected_prediction_tokens": rejected,
        "text": text,
    }
