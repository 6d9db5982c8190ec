"""Soak test: minutes of mixed traffic with random aborts and bad requests, then a leak check.

    python -m scripts.soak.run --duration 120                       # starts a server on the default model
    python -m scripts.soak.run --base-url http://127.0.0.1:8000 --duration 600

--concurrency workers each loop until --duration is over, one request at a time: streamed
and plain completions, chat, /generate (all with ignore_eos, so every token count is
exact), streams the client walks away from mid-way, and bad requests that must get a 4xx.
When the traffic stops it waits for the engines to go idle and reads /metrics: every KV
block free before must be free again. It prints one JSON object (requests served,
outcomes, errors by kind, KV blocks leaked, RSS) and exits 1 on any error or leak.
Loopback only: it refuses a --base-url on another host. Not part of CI.

Prefix caching (on by default in the server): --prefix-fraction of the served requests
share prefixes, half "shared_prefix" (one of --num-system-prompts long system prompts,
then a short question, as a completion or a chat) and half "multi_turn" (a chat of 2-5
turns, each resending the history with the model's replies); some walked-away streams
start from a system prompt too, to abort requests that hold or wait on shared blocks.
/metrics is sampled every --metrics-interval seconds, and at the end scripts/soak/checks.py
checks: no KV block used once idle, the hit counters monotone with hits <= queries and
consistent with the usages' cached_tokens, and each process's RSS grown by at most
--max-rss-growth-mb. Ten minutes with caching on:

    python -m scripts.soak.run --duration 600 --prefix-fraction 0.5

--all-routes mixes in Responses, Messages, embeddings and `prediction` (scripts/soak/routes.py);
--kill-core-every S kills the core on a timer under --restart-engine and counts every answer
against those kills (scripts/soak/chaos.py): docs/reliability.md has the ten-minute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import random
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import aiohttp

from scripts.lib.local_server import start_server
from scripts.soak.chaos import HttpTally, KillWindow, chaos_report, core_pids, kill_core_every, num_fds
from scripts.soak.checks import UsageTally
from scripts.soak.metrics import first_served_model, sample_metrics, wait_until_idle
from scripts.soak.report import build_report, rss_mb
from scripts.soak.routes import NewRoutes

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
SYSTEM_PROMPT_WORDS = 300  # ~ 20 blocks of 16 tokens: a hit saves most of the prompt
REQUEST_START: contextvars.ContextVar[float] = contextvars.ContextVar("request_start")  # per worker task
UNAVAILABLE_BACKOFF_S = 0.5  # after a 503 (a core restarting), as a client would back off


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
        self.usage = UsageTally()
        self.num_conversations = 0  # multi-turn chats that got every reply
        self.system_prompts = [" ".join(self.rng.choice(WORDS) for _ in range(SYSTEM_PROMPT_WORDS))
                               for _ in range(args.num_system_prompts)]
        self.new_routes = NewRoutes(self)
        self.tally = HttpTally()
        self.error_spans: list[tuple[str, float, float]] = []  # (kind, its request's start, now)
        self.kill_windows: list[KillWindow] = []
        self.backoff_until = 0.0  # shared by the workers: a restarting core is not hammered

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.first_errors.setdefault(kind, detail[:300])
        now = time.monotonic()
        self.error_spans.append((kind, REQUEST_START.get(now), now))
        if "503" in kind or kind.startswith("exception"):
            self.backoff_until = now + UNAVAILABLE_BACKOFF_S

    async def run(self, model: str, frontend_pid: int | None = None) -> None:
        deadline = time.monotonic() + self.args.duration
        killer = None
        if self.args.kill_core_every and frontend_pid is not None:
            killer = asyncio.create_task(kill_core_every(self.url, frontend_pid, self.args.kill_core_every, deadline,
                                                         self.kill_windows))
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT, trace_configs=[self.tally.trace_config()]) as session:
            await asyncio.gather(*(self.worker(session, model, deadline) for _ in range(self.args.concurrency)))
        if killer is not None:
            await killer

    async def worker(self, session: aiohttp.ClientSession, model: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            start = time.monotonic()
            REQUEST_START.set(start)
            try:
                if self.args.all_routes and self.rng.random() < self.args.new_routes_fraction:
                    await self.new_routes.run_one(session, model)
                elif roll < self.args.bad_fraction:
                    await self.bad_request(session)
                elif roll < self.args.bad_fraction + self.args.abort_fraction:
                    await self.completion(session, model, stream=True, walk_away=True)
                elif self.rng.random() < self.args.prefix_fraction:
                    if self.rng.random() < 0.5:
                        await self.multi_turn(session, model)
                    elif self.rng.random() < 0.5:
                        await self.chat(session, model, system=self.rng.choice(self.system_prompts))
                    else:
                        await self.completion(session, model, stream=self.rng.random() < 0.5, walk_away=False,
                                              system=self.rng.choice(self.system_prompts))
                else:
                    kind = self.rng.choice(["stream", "plain", "chat", "generate"])
                    if kind == "chat":
                        await self.chat(session, model)
                    elif kind == "generate":
                        await self.generate(session)
                    else:
                        await self.completion(session, model, stream=kind == "stream", walk_away=False)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:  # cut answers too
                self.error(f"exception:{type(e).__name__}", repr(e))
            self.latencies_s.append(time.monotonic() - start)
            if self.backoff_until > time.monotonic():
                await asyncio.sleep(self.backoff_until - time.monotonic())

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

    async def completion(self, session: aiohttp.ClientSession, model: str, stream: bool, walk_away: bool,
                         system: str | None = None) -> None:
        asked = self.args.max_tokens * 8 if walk_away else self.max_tokens()
        if walk_away and self.args.prefix_fraction and self.rng.random() < 0.5:
            system = self.rng.choice(self.system_prompts)
        prompt = self.prompt() if system is None else f"{system}\n{self.prompt()}"
        body = {"model": model, "prompt": prompt, "max_tokens": asked, "ignore_eos": True, "stream": stream,
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "seed": self.rng.randrange(1 << 30)}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with session.post(self.url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return self.error(f"status_{response.status}", await response.text())
            kind = "plain" if system is None else "shared_prefix"
            if not stream:
                return self.check_usage(kind, asked, (await response.json())["usage"])
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
            self.check_usage("stream" if system is None else "shared_prefix_stream", asked, usage)

    async def chat(self, session: aiohttp.ClientSession, model: str, system: str | None = None,
                   messages: list[dict] | None = None) -> str | None:
        """One chat completion; returns the reply's text (None on an error)."""
        asked = self.max_tokens()
        messages = messages or [{"role": "user", "content": self.prompt()}]
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        body = {"model": model, "messages": messages, "max_tokens": asked, "ignore_eos": True}
        async with session.post(self.url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                self.error(f"status_{response.status}", await response.text())
                return None
            answer = await response.json()
            kind = "chat" if system is None and len(messages) == 1 else "shared_prefix_chat"
            self.check_usage(kind, asked, answer["usage"])
            return answer["choices"][0]["message"]["content"]

    async def multi_turn(self, session: aiohttp.ClientSession, model: str) -> None:
        """A chat whose every turn resends the history; the next turn waits for the reply."""
        system = self.rng.choice(self.system_prompts + [None])
        messages = []
        for _ in range(self.rng.randint(2, 5)):
            messages.append({"role": "user", "content": self.prompt()})
            reply = await self.chat(session, model, system=system, messages=messages)
            if reply is None:
                return
            messages.append({"role": "assistant", "content": reply})
        self.num_conversations += 1

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

    def check_usage(self, kind: str, asked: int, usage: dict | None) -> None:
        if usage is not None:
            self.usage.add(usage, self.args.block_size)
        self.check_count(kind, asked, usage["completion_tokens"] if usage else None)

    def check_count(self, kind: str, asked: int, got: int | None) -> None:
        if got == asked:
            self.outcomes[f"served_{kind}"] += 1
            self.num_tokens += got
        else:
            self.error("wrong_token_count", f"{kind}: asked for {asked}, got {got}")


def soak_and_report(args: argparse.Namespace, url: str, pids: dict[str, int]) -> dict:
    before = asyncio.run(wait_until_idle(url, 60))
    rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
    frontend_pid = pids.get("frontend")
    fds_before = num_fds(frontend_pid) if frontend_pid else None
    soak = Soak(args, url)
    samples: list[dict] = [before]
    rss_peak: dict[str, float] = {}

    async def traffic(model: str) -> None:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(url, args.metrics_interval, samples, pids, rss_peak, stop))
        try:
            await soak.run(model, frontend_pid)
        finally:
            stop.set()
            await sampler

    start = time.monotonic()
    asyncio.run(traffic(asyncio.run(first_served_model(url))))
    elapsed_s = time.monotonic() - start
    after = asyncio.run(wait_until_idle(url, 120))
    samples.append(after)
    rss_after = {name: rss_mb(pid) for name, pid in pids.items()}
    report = build_report(args, soak, samples, rss_before, rss_after, rss_peak, elapsed_s,
                          has_restarts=bool(soak.kill_windows))
    report["http"] = soak.tally.summary(soak.kill_windows)
    if frontend_pid:
        report["frontend"] = {"rss_mb_start": rss_before["frontend"], "rss_mb_end": rss_after["frontend"],
                              "fds_start": fds_before, "fds_end": num_fds(frontend_pid)}
    if args.kill_core_every:
        report["chaos"] = chaos_report(soak.kill_windows, soak.error_spans, start)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    pids: dict[str, int] = {}
    if args.base_url:
        url = args.base_url.rstrip("/")
    else:
        server_args = args.server_arg + (["--restart-engine"] if args.kill_core_every else [])
        process, url, log_path = start_server(args.model, server_args, log_name="tokenloom-soak")
        pids["frontend"] = process.pid
        if not args.kill_core_every:  # a killed core's successor is a new process: only the frontend is followed
            pids.update({f"core{i}": pid for i, pid in enumerate(core_pids(process.pid))})
    try:
        report = soak_and_report(args, url, pids)
    finally:
        if process is not None:
            process.terminate()
            exit_code = process.wait(120)
    if process is not None:
        report.update(server_exit_code=exit_code, server_log=str(log_path))
    print(json.dumps(report, indent=2))
    errors = report["chaos"]["errors_outside_kill_windows"] if "chaos" in report else report["errors"]
    is_clean = (not errors and report["http"]["5xx_outside_kill_windows"] == 0 and report["kv_blocks_leaked"] == 0
                and not report["requests_left_running"] and not report["checks_failed"])
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
    p.add_argument("--prefix-fraction", type=float, default=0.0,
                   help="share of served requests that share prefixes (system prompts, multi-turn chats)")
    p.add_argument("--num-system-prompts", type=int, default=4, help="the shared system prompts")
    p.add_argument("--block-size", type=int, default=16, help="the server's KV block size (for the usage checks)")
    p.add_argument("--metrics-interval", type=float, default=2.0, metavar="S", help="seconds between /metrics samples")
    p.add_argument("--max-rss-growth-mb", type=float, default=300.0, help="most any process's RSS may grow")
    p.add_argument("--all-routes", action="store_true",
                   help="mix in Responses, Messages, embeddings and chat with `prediction` (scripts/soak/routes.py)")
    p.add_argument("--new-routes-fraction", type=float, default=0.4, help="with --all-routes: their share")
    p.add_argument("--kill-core-every", type=float, default=0.0, metavar="S",
                   help="SIGKILL the engine core every S seconds (the server gets --restart-engine; "
                        "scripts/soak/chaos.py)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.kill_core_every and args.base_url:
        p.error("--kill-core-every needs the server's pid: let the soak start the server")
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        p.error("--base-url must be on loopback (127.0.0.1, localhost or ::1)")
    if args.concurrency < 1 or args.duration <= 0 or args.max_tokens < 1:
        p.error("--concurrency, --duration and --max-tokens must be positive")
    if not 0 <= args.prefix_fraction <= 1 or args.num_system_prompts < 1:
        p.error("--prefix-fraction must be in [0, 1] and --num-system-prompts positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
