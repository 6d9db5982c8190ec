"""The highest request rate one replica sustains within a latency SLO, by simulation.

    --slo ttft_p99=1000,tpot_p50=50      milliseconds; metrics ttft, tpot, itl, latency
                                          at mean, p50, p90, p95 or p99

For a rate, the same seeded Poisson arrivals as scripts/bench/serving.py run through
the simulator; past the capacity the queue grows for as long as requests arrive, so
TTFT climbs with the number of requests, and a few hundred make the edge sharp. The
search doubles the rate until the SLO fails, then bisects. Replicas for a target rate
are ceil(target / max rate): requests spread evenly, none shared.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable

from engine.simulator.simulator import SimulatedRequest, SimulationResult, Simulator

logger = logging.getLogger(__name__)

METRICS = ("ttft", "tpot", "itl", "latency")
STATS = ("mean", "p50", "p90", "p95", "p99")


def parse_slo(text: str) -> dict[str, float]:
    """"ttft_p99=1000,tpot_p50=50" -> {"ttft_p99": 1.0, "tpot_p50": 0.05} (seconds)."""
    slo = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        metric, _, stat = name.partition("_")
        if metric not in METRICS or stat not in STATS or not value:
            raise ValueError(f"SLO terms are METRIC_STAT=MS with METRIC in {METRICS} and STAT in {STATS}, got {item!r}")
        slo[name] = float(value) / 1000
    if not slo:
        raise ValueError("an empty SLO")
    return slo


def statistic(values: list[float], stat: str) -> float:
    """Percentiles interpolate linearly between ranks, as scripts/lib/bench_metrics.percentile."""
    if stat == "mean":
        return statistics.fmean(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(stat[1:]) - 1]


def latency_samples(result: SimulationResult) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, latency and every inter-token gap, as bench_metrics defines them."""
    samples = {metric: [] for metric in METRICS}
    for r in result.requests:
        samples["ttft"].append(r.ttft_s)
        samples["latency"].append(r.latency_s)
        if len(r.token_times) > 1:
            samples["tpot"].append((r.latency_s - r.ttft_s) / (len(r.token_times) - 1))
            samples["itl"].extend(b - a for a, b in zip(r.token_times, r.token_times[1:]))
    return samples


def measure_slo(result: SimulationResult, slo: dict[str, float]) -> dict[str, float]:
    samples = latency_samples(result)
    return {name: statistic(samples[name.split("_")[0]], name.split("_")[1]) for name in slo}


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """As scripts/bench/serving.py sends: the first at 0, then exponential gaps from Random(seed)."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num_requests):
        if i > 0 and rate != math.inf:
            now += rng.expovariate(rate)
        times.append(now)
    return times


@dataclass
class CapacityResult:
    max_rate: float  # requests/s within the SLO; 0 if even the lowest rate tried fails
    metrics: dict[str, float]  # the SLO's metrics at max_rate (seconds)
    num_evaluations: int

    def num_replicas(self, target_rate: float) -> int | None:
        return math.ceil(target_rate / self.max_rate) if self.max_rate > 0 else None


class CapacitySearch:
    def __init__(self, simulator: Simulator, lengths: list[tuple[int, int]], slo: dict[str, float], seed: int = 0,
                 on_evaluation: Callable[[float, bool, dict], None] | None = None) -> None:
        """`lengths`: each request's (prompt tokens, output tokens), sent in this order."""
        self.simulator = simulator
        self.lengths = lengths
        self.slo = slo
        self.seed = seed
        self.on_evaluation = on_evaluation
        self.num_evaluations = 0

    def evaluate(self, rate: float) -> tuple[bool, dict[str, float]]:
        arrivals = poisson_arrivals(len(self.lengths), rate, self.seed)
        requests = [SimulatedRequest(p, o, t) for (p, o), t in zip(self.lengths, arrivals)]
        metrics = measure_slo(self.simulator.run(requests), self.slo)
        is_met = all(metrics[name] <= bound for name, bound in self.slo.items())
        self.num_evaluations += 1
        logger.info("rate %.3f req/s: %s %s", rate, "meets" if is_met else "misses",
                    {k: round(v * 1000, 1) for k, v in metrics.items()})
        if self.on_evaluation:
            self.on_evaluation(rate, is_met, metrics)
        return is_met, metrics

    def run(self, start_rate: float = 1.0, relative_tolerance: float = 0.01, min_rate: float = 1e-3) -> CapacityResult:
        """Bracket the edge by doubling (or halving) from `start_rate`, then bisect it."""
        rate = start_rate
        is_met, metrics = self.evaluate(rate)
        low, low_metrics, high = (rate, metrics, None) if is_met else (None, {}, rate)
        while high is None:
            rate *= 2
            is_met, metrics = self.evaluate(rate)
            if is_met:
                low, low_metrics = rate, metrics
            else:
                high = rate
        while low is None:
            rate /= 2
            if rate < min_rate:
                return CapacityResult(0.0, metrics, self.num_evaluations)
            is_met, metrics = self.evaluate(rate)
            if is_met:
                low, low_metrics = rate, metrics
            else:
                high = rate
        while high - low > relative_tolerance * low:
            middle = (low + high) / 2
            is_met, metrics = self.evaluate(middle)
            if is_met:
                low, low_metrics = middle, metrics
            else:
                high = middle
        return CapacityResult(low, low_metrics, self.num_evaluations)
