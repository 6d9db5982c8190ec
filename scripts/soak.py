"""Soak test: minutes of mixed traffic with random aborts and bad requests, then a leak check.

    python scripts/soak.py --duration 120                       # starts a server on the default model
    python scripts/soak.py --base-url http://127.0.0.1:8000 --duration 600

--concurrency workers each loop until --duration is over, one request at a time: streamed
and plain completions, chat, /generate (all with ignore_eos, so every token count is
exact), streams the client walks away from mid-way, and bad requests that must get a 4xx.
When the traffic stops it waits for the engines to go idle and reads /metrics: every KV
block free before must be free again. It prints one JSON object (requests served,
outcomes, errors by kind, KV blocks leaked, RSS) and exits 1 on any error or leak.
Loopback only: it refuses a --base-url on another host. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300)
BAD_COMPLETIONS = [b'{"prompt": "x", ', b"[1, 2, 3]", b'{"prompt": "caf\xe9"}', b'{"max_tokens": 4}',
                   b'{"prompt": "", "max_tokens": 4}', b'{"prompt": "x", "max_tokens": 0}',
                   b'{"prompt": "x", "max_tokens": 100000000}', b'{"prompt": "x", "temperature": -1}',
                   b'{"prompt": "x", "top_p": 1.5}', b'{"prompt": "x", "top_k": -7}', b'{"prompt": "x", "n": 100000}',
                   b'{"prompt": "x", "model": "no-such-model"}']
BAD_REQUESTS = [("/v1/completions", body) for body in BAD_COMPLETIONS] + [  # (path, raw body): each must get 4xx
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
    ("/generate", b'{"prompt": "x", "use_beam_search": true}'),
]
WORDS = "the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly".split()


class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str):
        self.args = args
        self.url = base_url.rstrip("/")
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.first_errors: dict[str, str] = {}
        self.num_tokens = 0
        self.latencies_s: list[float] = []

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.first_errors.setdefault(kind, detail[:300])

    async def run(self, model: str) -> None:
        deadline = time.monotonic() + self.args.duration
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
            await asyncio.gather(*(self.worker(session, model, deadline) for _ in range(self.args.concurrency)))

    async def worker(self, session: aiohttp.ClientSession, model: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            start = time.monotonic()
            try:
                if roll < self.args.bad_fraction:
                    await self.bad_request(session)
                elif roll < self.args.bad_fraction + self.args.abort_fraction:
                    await self.completion(session, model, stream=True, walk_away=True)
                else:
                    kind = self.rng.choice(["stream", "plain", "chat", "generate"])
                    if kind == "chat":
                        await self.chat(session, model)
                    elif kind == "generate":
                        await self.generate(session)
                    else:
                        await self.completion(session, model, stream=kind == "stream", walk_away=False)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.error(f"exception:{type(e).__name__}", repr(e))
            self.latencies_s.append(time.monotonic() - start)

    def prompt(self) -> str:
        start = self.rng.randrange(len(WORDS))
        return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(self.rng.randint(1, self.args.max_prompt_words)))

    def max_tokens(self) -> int:
        return self.rng.randint(1, self.args.max_tokens)

    async def bad_request(self, session: aiohttp.ClientSession) -> None:
        path, body = self.rng.choice(BAD_REQUESTS)
        async with session.post(self.url + path, data=body, headers={"Content-Type": "application/json"}) as response:
            text = await response.text()
            if 400 <= response.status < 500 and "error" in json.loads(text):
                self.outcomes["bad_request_rejected"] += 1
            else:
                self.error(f"bad_request_got_{response.status}", f"{path} {body!r}: {text}")

    async def completion(self, session: aiohttp.ClientSession, model: str, stream: bool, walk_away: bool) -> None:
        asked = self.args.max_tokens * 8 if walk_away else self.max_tokens()
        body = {"model": model, "prompt": self.prompt(), "max_tokens": asked, "ignore_eos": True, "stream": stream,
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "seed": self.rng.randrange(1 << 30)}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with session.post(self.url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return self.error(f"status_{response.status}", await response.text())
            if not stream:
                return self.check_count("plain", asked, (await response.json())["usage"]["completion_tokens"])
            num_events, usage = 0, None
            walk_away_after = self.rng.randint(1, 4)
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return self.error("stream_error_event", event["error"]["message"])
                num_events += 1
                usage = event.get("usage") or usage
                if walk_away and num_events >= walk_away_after:
                    response.close()
                    self.outcomes["aborted_by_client"] += 1
                    return None
            self.check_count("stream", asked, usage["completion_tokens"] if usage else None)

    async def chat(self, session: aiohttp.ClientSession, model: str) -> None:
        asked = self.max_tokens()
        body = {"model": model, "messages": [{"role": "user", "content": self.prompt()}], "max_tokens": asked,
                "ignore_eos": True}
        async with session.post(self.url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return self.error(f"status_{response.status}", await response.text())
            self.check_count("chat", asked, (await response.json())["usage"]["completion_tokens"])

    async def generate(self, session: aiohttp.ClientSession) -> None:
        prompt = self.prompt()
        body = {"prompt": prompt, "max_tokens": self.max_tokens(), "ignore_eos": True}
        async with session.post(self.url + "/generate", json=body) as response:
            if response.status != 200:
                return self.error(f"status_{response.status}", await response.text())
            text = (await response.json())["text"]
            if len(text) == 1 and text[0].startswith(prompt):
                self.outcomes["served_generate"] += 1
            else:
                self.error("generate_bad_text", repr(text))

    def check_count(self, kind: str, asked: int, got: int | None) -> None:
        if got == asked:
            self.outcomes[f"served_{kind}"] += 1
            self.num_tokens += got
        else:
            self.error("wrong_token_count", f"{kind}: asked for {asked}, got {got}")


async def read_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = {}  # name, or name:finish_reason for requests_finished_total
    for line in text.splitlines():
        if line.startswith("tokenloom_") and "{" in line and "_bucket" not in line:
            name = line.split("{", 1)[0][len("tokenloom_"):]
            if 'finish_reason="' in line:
                name += ":" + line.split('finish_reason="', 1)[1].split('"', 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def wait_until_idle(url: str, timeout_s: float) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = await read_metrics(session, url)
            busy = metrics["num_requests_running"] + metrics["num_requests_waiting"] + metrics["kv_blocks_used"]
            if not busy or time.monotonic() > deadline:
                return metrics
            await asyncio.sleep(0.5)


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, \
            session.get(url + "/v1/models") as response:
        return (await response.json())["data"][0]["id"]


def rss_mb(pid: int) -> float | None:
    status = Path(f"/proc/{pid}/status")
    return next((int(line.split()[1]) / 1024 for line in status.read_text().splitlines()
                 if line.startswith("VmRSS:")), None) if status.exists() else None


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = Path(tempfile.gettempdir()) / f"tokenloom-soak-{port}.log"
    command = [sys.executable, "-m", "frontend.api_server", "--model", args.model, "--port", str(port),
               "--log-level", "warning", *args.server_arg]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url, log_path
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not become healthy; see {log_path}")


def soak_and_report(args: argparse.Namespace, url: str, pids: dict[str, int]) -> dict:
    before = asyncio.run(wait_until_idle(url, 60))
    rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
    soak = Soak(args, url)
    start = time.monotonic()
    asyncio.run(soak.run(asyncio.run(served_model(url))))
    elapsed_s = time.monotonic() - start
    after = asyncio.run(wait_until_idle(url, 120))
    latencies = sorted(soak.latencies_s)
    return {
        "traffic_s": args.duration,
        "elapsed_s": round(elapsed_s, 1),  # traffic, plus the requests in flight at its end
        "latency_s": {name: round(latencies[int(q * (len(latencies) - 1))], 2)
                      for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
        "requests": sum(soak.outcomes.values()) + sum(soak.errors.values()),
        "requests_served": sum(n for kind, n in soak.outcomes.items() if kind.startswith("served_")),
        "outcomes": dict(sorted(soak.outcomes.items())),
        "errors": dict(sorted(soak.errors.items())),
        "first_error_of_each_kind": soak.first_errors,
        "tokens_checked": soak.num_tokens,
        "kv_blocks_free_before": before["kv_blocks_free"],
        "kv_blocks_free_after": after["kv_blocks_free"],
        "kv_blocks_leaked": before["kv_blocks_free"] - after["kv_blocks_free"],
        "requests_left_running": after["num_requests_running"] + after["num_requests_waiting"],
        "server_finished_by_reason": {k.split(":")[1]: int(v - before.get(k, 0)) for k, v in after.items()
                                      if k.startswith("requests_finished_total:")},
        "engine_healthy": after["engine_healthy"],
        "rss_mb_before": rss_before,
        "rss_mb_after": {name: rss_mb(pid) for name, pid in pids.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    pids: dict[str, int] = {}
    if args.base_url:
        url = args.base_url.rstrip("/")
    else:
        process, url, log_path = start_server(args)
        pids["frontend"] = process.pid
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        if children.exists():
            pids.update({f"core{i}": int(pid) for i, pid in enumerate(children.read_text().split())})
    try:
        report = soak_and_report(args, url, pids)
    finally:
        if process is not None:
            process.terminate()
            exit_code = process.wait(120)
    if process is not None:
        report.update(server_exit_code=exit_code, server_log=str(log_path))
    print(json.dumps(report, indent=2))
    is_clean = not report["errors"] and report["kv_blocks_leaked"] == 0 and not report["requests_left_running"]
    return 0 if is_clean else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="soak a running server (loopback only) instead of starting one")
    p.add_argument("--model", default="smollm2", help="model for the server this script starts")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the started server (repeat: --server-arg=--max-num-seqs --server-arg=32)")
    p.add_argument("--duration", type=float, default=120.0, metavar="S", help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=16, help="clients, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens a served request asks for")
    p.add_argument("--max-prompt-words", type=int, default=60)
    p.add_argument("--abort-fraction", type=float, default=0.15, help="share of streams the client walks away from")
    p.add_argument("--bad-fraction", type=float, default=0.15, help="share of requests that are bad on purpose")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        p.error("--base-url must be on loopback (127.0.0.1, localhost or ::1)")
    if args.concurrency < 1 or args.duration <= 0 or args.max_tokens < 1:
        p.error("--concurrency, --duration and --max-tokens must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
