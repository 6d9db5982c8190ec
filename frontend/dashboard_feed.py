"""The dashboard's server-sent-events feed: `GET /dashboard/events`, a few snapshots a second.

Each event is one JSON object: per engine core its latest `SchedulerStats` (as the
core sent it with its last step), its tokens out per second and the occupancy
columns (`frontend.step_timeline`) recorded since the previous event; over all cores
the prompt and generated tokens per second. Everything is read from what the
frontend already holds; while a feed is open the cores count each step's batch for
the strip (nothing when none is), and an idle feed costs one small JSON object per tick.

    data: {"time": 12.5, "model": "smollm2", "num_in_flight": 3,
           "prompt_tokens_per_s": 410.0, "generation_tokens_per_s": 95.5,
           "totals": {"num_running": 3, ..., "spec_decode": {"ngram": {"num_proposed_tokens": 40,
                      "num_accepted_tokens": 31, "acceptance_rate": 0.775, ...}}},
           "engines": [{"index": 0, "is_alive": true, "num_kv_blocks": 4096,
                        "num_running": 3, ..., "tokens_out_per_s": 95.5,
                        "steps": [[num_prefill, num_decode], ...], "num_steps_dropped": 0}]}

Rates are taken over the last RATE_WINDOW_S, so they fall back to 0 that long after
the last token. With --api-key the feed wants `Authorization: Bearer KEY` like the
API (the page reads it with fetch, since EventSource cannot send headers); the feed
ends once the server drains, so an open dashboard never holds up a shutdown.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import AsyncIterator, Callable

from frontend.engine_client import AsyncEngineClient
from frontend.spec_decode_metrics import spec_decode_summary
from ipc.messages import SchedulerStats

EVENT_INTERVAL_S = 0.25  # four updates a second: smooth enough to watch, nothing to the server
RATE_WINDOW_S = 2.0
MAX_COLUMNS_PER_EVENT = 512  # a core stepping faster than this per tick skips columns (counted)


class DashboardFeed:
    """One open dashboard's view: which step columns it has seen and its rate samples."""

    def __init__(self, client: AsyncEngineClient, interval_s: float = EVENT_INTERVAL_S,
                 window_s: float = RATE_WINDOW_S):
        self.client = client
        self.interval_s = interval_s
        self.window_s = window_s
        timeline = client.timeline
        self._next_step = list(timeline.num_steps)  # a fresh page starts with an empty strip
        self._samples: deque[tuple[float, int, int, list[int]]] = deque()  # (time, prompt, generated, per core out)

    async def events(self, should_stop: Callable[[], bool]) -> AsyncIterator[str]:
        """SSE text, one event per tick, until `should_stop()` (the server drains). While it runs,
        the cores count their steps for the occupancy strip."""
        self.client.watch_steps(True)
        try:
            while not should_stop():
                yield f"data: {json.dumps(self.snapshot(), separators=(',', ':'))}\n\n"
                await asyncio.sleep(self.interval_s)
        finally:
            self.client.watch_steps(False)

    def snapshot(self) -> dict:
        client, timeline = self.client, self.client.timeline
        now = time.monotonic()
        metrics = client.metrics
        sample = (now, metrics.num_prompt_tokens, metrics.num_generation_tokens, list(timeline.num_tokens_out))
        self._samples.append(sample)
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        first = self._samples[0]
        elapsed = now - first[0]

        def rate(new: int, old: int) -> float:
            return round((new - old) / elapsed, 1) if elapsed > 0 else 0.0

        engines = []
        for engine in client.engines:
            i = engine.index
            if i >= len(self._next_step):
                self._next_step.append(0)
            old_out = first[3][i] if i < len(first[3]) else 0
            columns = timeline.columns_since(i, self._next_step[i], MAX_COLUMNS_PER_EVENT)
            num_dropped = (columns[0].step_index - self._next_step[i]) if columns else 0
            self._next_step[i] = timeline.num_steps[i]
            engines.append({
                "index": i,
                "is_alive": engine.is_alive,
                "num_kv_blocks": engine.ready.num_kv_blocks if engine.ready else 0,
                **_stats_dict(engine.stats),
                "tokens_out_per_s": rate(timeline.num_tokens_out[i], old_out),
                "steps": [[c.num_prefill, c.num_decode] for c in columns],
                "num_steps_dropped": num_dropped,
            })
        return {
            "time": round(now, 3),
            "model": client.model_name,
            "num_in_flight": client.num_in_flight,
            "prompt_tokens_per_s": rate(sample[1], first[1]),
            "generation_tokens_per_s": rate(sample[2], first[2]),
            "totals": _stats_dict(client.stats()),
            "engines": engines,
        }


def _stats_dict(stats: SchedulerStats) -> dict:
    """The stats as JSON: the counts as they are, speculative decoding as {method: summary}."""
    fields = {name: getattr(stats, name) for name in stats.__struct_fields__ if name != "spec_decode"}
    return {**fields, "spec_decode": spec_decode_summary(stats.spec_decode)}
