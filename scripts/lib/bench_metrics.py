"""Latency arithmetic for the benchmark scripts: pure functions, no I/O, no numpy.

Definitions follow vLLM's `benchmarks/serve.py` so figures compare with `vllm bench serve`:
  TTFT     request sent -> first streamed chunk
  latency  request sent -> last streamed chunk
  TPOT     (latency - TTFT) / (output tokens - 1), for requests with more than one token
  ITL      the gaps between successive streamed chunks (a chunk may carry several tokens)

            send          chunk 0        chunk 1     chunk 2
    time ---|-------------|--------------|-----------|---->
            |<--- TTFT -->|<--- ITL ---->|<-- ITL -->|
            |<---------------- latency ------------->|
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestTrace:
    """What a client saw of one streamed request; times in seconds on one clock."""

    send_time: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried choices
    num_output_tokens: int = 0  # the server's usage count, or the sum of tokens per chunk
    num_prompt_tokens: int = 0
    is_success: bool = True
    error: str = ""
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    text: str = ""  # the completion, for clients that send it back (multi-turn chat)


@dataclass
class RequestMetrics:
    ttft: float
    latency: float
    tpot: float | None  # None for single-token outputs
    itls: list[float]
    num_output_tokens: int


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def request_metrics(trace: RequestTrace) -> RequestMetrics:
    """TTFT, latency, TPOT and ITLs of one successful request with at least one chunk."""
    if not trace.chunk_times:
        raise ValueError("a request without streamed chunks has no latency metrics")
    ttft = trace.chunk_times[0] - trace.send_time
    latency = trace.chunk_times[-1] - trace.send_time
    tpot = (latency - ttft) / (trace.num_output_tokens - 1) if trace.num_output_tokens > 1 else None
    itls = [b - a for a, b in zip(trace.chunk_times, trace.chunk_times[1:])]
    return RequestMetrics(ttft, latency, tpot, itls, trace.num_output_tokens)


def summarize(values: list[float]) -> dict[str, float | None]:
    """Mean, median and p99; None for each when there are no values."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": sum(values) / len(values), "median": percentile(values, 50), "p99": percentile(values, 99)}


def summarize_traces(traces: list[RequestTrace], duration: float) -> dict:
    """The serving benchmark's result: counts, throughputs and TTFT/TPOT/ITL/latency summaries."""
    ok = [t for t in traces if t.is_success and t.chunk_times]
    metrics = [request_metrics(t) for t in ok]
    num_output_tokens = sum(m.num_output_tokens for m in metrics)
    num_prompt_tokens = sum(t.num_prompt_tokens for t in ok)
    cached = [t.num_cached_tokens for t in ok if t.num_cached_tokens is not None]
    num_cached_tokens = sum(cached) if cached else None  # None: the server reports no cached tokens
    return {
        "num_successful": len(ok),
        "num_failed": len(traces) - len(ok),
        "duration_s": duration,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "num_cached_tokens": num_cached_tokens,
        "cached_share": num_cached_tokens / num_prompt_tokens if cached and num_prompt_tokens else None,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": num_output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (num_prompt_tokens + num_output_tokens) / duration if duration > 0 else 0.0,
        "ttft_s": summarize([m.ttft for m in metrics]),
        "tpot_s": summarize([m.tpot for m in metrics if m.tpot is not None]),
        "itl_s": summarize([gap for m in metrics for gap in m.itls]),
        "latency_s": summarize([m.latency for m in metrics]),
    }
