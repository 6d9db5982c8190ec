"""The client side of an OpenAI-style streamed request: the chunks of its server-sent events, as they arrive.

    try:
        async for now, chunk in stream_chunks(session, url, {"model": m, "prompt": p, "stream": True}):
            ...  # chunk: one parsed `data:` line; now: time.perf_counter() at its arrival
    except StreamStatusError as e:
        trace.error = str(e)  # "HTTP 400: {...}"

Both serving benches (completions and chat) time their requests from these arrivals.
served_model(session, url) names the first model the server lists, for when --model is not given.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp

SSE_PREFIX = "data: "
ERROR_BODY_CHARS = 300  # enough of an error body to tell what went wrong, without flooding a report


class StreamStatusError(Exception):
    """The server answered with a status other than 200; the message holds it and the body's start."""


async def stream_chunks(session: aiohttp.ClientSession, url: str, payload: dict
                        ) -> AsyncIterator[tuple[float, dict]]:
    """POSTs `payload` to `url`; yields (arrival time, parsed chunk) per `data:` event until [DONE]."""
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            raise StreamStatusError(f"HTTP {response.status}: {(await response.text())[:ERROR_BODY_CHARS]}")
        async for raw_line in response.content:
            line = raw_line.decode("utf-8").strip()
            if not line.startswith(SSE_PREFIX):
                continue  # blank separators and SSE comments (keep-alives)
            data = line[len(SSE_PREFIX):]
            if data == "[DONE]":
                break
            now = time.perf_counter()
            yield now, json.loads(data)


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server at `base_url` lists on /v1/models."""
    async with session.get(base_url.rstrip("/") + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]
