"""The soak's final JSON report: what was served, what failed, what leaked, and the checks' verdicts."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.soak.checks import check_kv_blocks, check_prefix_counters, check_rss


def rss_mb(pid: int) -> float | None:
    status = Path(f"/proc/{pid}/status")
    return next((int(line.split()[1]) / 1024 for line in status.read_text().splitlines()
                 if line.startswith("VmRSS:")), None) if status.exists() else None


def build_report(args: argparse.Namespace, soak, samples: list[dict], rss_before: dict, rss_after: dict,
                 rss_peak: dict, elapsed_s: float, has_restarts: bool = False) -> dict:
    """samples: /metrics from before the traffic, during it, and once idle after it (last).
    `has_restarts`: a core was replaced, whose prefix counters started again from 0 (not checked)."""
    before, after = samples[0], samples[-1]
    num_queries = after.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
    num_hits = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    checks_failed = (check_kv_blocks(before, after)
                     + ([] if has_restarts else check_prefix_counters(samples, soak.usage, args.block_size,
                                                                      expect_hits=args.prefix_fraction > 0))
                     + check_rss(rss_before, rss_after, args.max_rss_growth_mb))
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
        "conversations_completed": soak.num_conversations,
        "kv_blocks_free_before": before["kv_blocks_free"],
        "kv_blocks_free_after": after["kv_blocks_free"],
        "kv_blocks_leaked": before["kv_blocks_free"] - after["kv_blocks_free"],
        "requests_left_running": after["num_requests_running"] + after["num_requests_waiting"],
        "server_finished_by_reason": {k.split(":")[1]: int(v - before.get(k, 0)) for k, v in after.items()
                                      if k.startswith("requests_finished_total:")},
        "engine_healthy": after["engine_healthy"],
        "rss_mb_before": rss_before,
        "rss_mb_after": rss_after,
        "rss_mb_peak": rss_peak,
        "kv_blocks_used_after": after.get("kv_blocks_used"),
        "prefix_cache": {
            "queries_tokens": int(num_queries),
            "hits_tokens": int(num_hits),
            "hit_rate": num_hits / num_queries if num_queries else None,
            "usage_reports": soak.usage.num_reports,
            "usage_prompt_tokens": soak.usage.num_prompt_tokens,
            "usage_cached_tokens": soak.usage.num_cached_tokens,
            "cached_blocks_after": after.get("prefix_cache_blocks"),
            "metrics_samples": len(samples),
        },
        "checks_failed": checks_failed,
    }
