"""A live server for tests and what they do with it: start one on the real engine core, read
/metrics, wait for a condition, look at process state, run many streams at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from scripts.lib.fake_engine import FAKE_ENGINE_ARGV, FrontendServer

REAL_ENGINE = f"{sys.executable} -m engine.loop.core_process"
REAL_ENGINE_ARGS = ("--engine-command", REAL_ENGINE, "--served-model-name", "smollm2")


def fake_core(*args: str) -> tuple[str, str]:
    """FrontendServer's arguments for a fake engine core (scripts/lib/fake_engine.py) given `args`."""
    return "--engine-command", " ".join([*FAKE_ENGINE_ARGV, *args])


def metric(url: str, name: str, label: str = "") -> float:
    """A sample's value from /metrics; `label` (e.g. 'finish_reason="abort"') picks one series."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tokenloom_{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in /metrics")


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.1, what: str | None = None):
    """Poll `predicate` until it returns something truthy, and return that; a failed HTTP request
    counts as "not yet". At the deadline: None, or, given `what`, an AssertionError naming it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (requests.RequestException, OSError):
            value = None
        if value:
            return value
        time.sleep(interval_s)
    if what is not None:
        raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")
    return None


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def health(url: str) -> int:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code
    except requests.ConnectionError:
        return 0


@dataclass
class StreamResult:
    status: int
    num_tokens: int | None = None  # from the final usage chunk
    finish_reason: str | None = None
    error: str | None = None  # an error event in the stream, or the exception that ended it


async def stream_completion(session, url: str, max_tokens: int, prompt: str, disconnect_after: int | None = None,
                            **extra) -> StreamResult:
    """One streamed /v1/completions; with disconnect_after, hang up after that many events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    result = StreamResult(status=0)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = (await response.json())["error"]["message"]
                return result
            num_events = 0
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                num_events += 1
                if "error" in event:
                    result.error = event["error"]["message"]
                if event.get("choices"):
                    result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason
                if event.get("usage"):
                    result.num_tokens = event["usage"]["completion_tokens"]
                if disconnect_after is not None and num_events >= disconnect_after:
                    response.close()
                    return result
    except Exception as e:  # noqa: BLE001 - the caller checks
        result.error = repr(e)
    return result


async def run_streams(url: str, specs: list[dict], timeout_s: float = 600) -> list[StreamResult]:
    """Run every spec (stream_completion's keyword arguments) at once on its own connection."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(stream_completion(session, url, **spec) for spec in specs))


@contextlib.contextmanager
def real_server(model_path: str, *args: str, ready_timeout_s: float = 300.0):
    """A frontend with one real engine core on the default model (served as "smollm2")."""
    server = FrontendServer(Path(model_path), *REAL_ENGINE_ARGS, *args).start(ready_timeout_s)
    try:
        yield server
    except BaseException:
        server.stop()  # keeps the log for a look
        raise
    server.__exit__(None, None, None)


def post_completion(url: str, max_tokens: int, prompt: str = "Hi", timeout_s: float = 120,
                    **extra) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra},
                         timeout=timeout_s)
