"""The soak's view of the server's /metrics: one read, samples while the traffic runs, waiting for idle."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from scripts.lib.local_server import parse_metrics
from scripts.lib.sse_client import served_model
from scripts.soak.report import rss_mb


async def read_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        return parse_metrics(await response.text())


async def sample_metrics(url: str, interval_s: float, samples: list[dict], pids: dict[str, int],
                         rss_peak: dict[str, float], stop: asyncio.Event) -> None:
    """/metrics and each process's RSS every `interval_s` while the traffic runs."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not stop.is_set():
            try:
                samples.append(await read_metrics(session, url))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # a busy server may answer late; the next sample will do
            for name, pid in pids.items():
                rss = rss_mb(pid)
                if rss is not None:
                    rss_peak[name] = max(rss_peak.get(name, 0.0), rss)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


async def wait_until_idle(url: str, timeout_s: float) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = await read_metrics(session, url)
            busy = metrics["num_requests_running"] + metrics["num_requests_waiting"] + metrics["kv_blocks_used"]
            if not busy or time.monotonic() > deadline:
                return metrics
            await asyncio.sleep(0.5)


async def first_served_model(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        return await served_model(session, url)
