"""scripts/soak/run.py with prefix caching: its end checks on fabricated /metrics, and a short real soak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts.lib.local_server import parse_metrics
from scripts.soak.checks import UsageTally, check_kv_blocks, check_prefix_counters, check_rss
from tests.helpers import REPO_ROOT

BLOCK = 16


def metrics(queries: float, hits: float, used: float = 0, free: float = 100, cached: float = 5) -> dict:
    return {"prefix_cache_queries_total": queries, "prefix_cache_hits_total": hits, "kv_blocks_used": used,
            "kv_blocks_free": free, "prefix_cache_blocks": cached}


def tally(*usages: tuple[int, int]) -> UsageTally:
    t = UsageTally()
    for prompt, cached in usages:
        t.add({"prompt_tokens": prompt, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": cached}},
              BLOCK)
    return t


def test_a_clean_run_passes():
    samples = [metrics(0, 0), metrics(200, 64), metrics(500, 160)]
    assert check_kv_blocks(samples[0], samples[-1]) == []
    assert check_prefix_counters(samples, tally((100, 64), (150, 96)), BLOCK, expect_hits=True) == []
    assert check_rss({"core0": 2000.0}, {"core0": 2100.0}, max_growth_mb=300) == []


def test_a_leaked_block_fails():
    before, after = metrics(0, 0, used=0, free=100), metrics(10, 0, used=3, free=97)
    failures = check_kv_blocks(before, after)
    assert any("3 KV blocks still used" in f for f in failures)
    assert any("free went from 100" in f for f in failures)


def test_cached_free_blocks_count_as_free():
    # 40 cached blocks nobody holds are free: no leak
    assert check_kv_blocks(metrics(0, 0, free=100, cached=0), metrics(0, 0, free=100, cached=40)) == []
    assert check_kv_blocks(metrics(0, 0), metrics(0, 0, free=100, cached=101)) != []


@pytest.mark.parametrize("samples, usage, expected", [
    ([metrics(0, 0), metrics(300, 64), metrics(250, 64)], tally(), "went down"),
    ([metrics(0, 0), metrics(300, 320)], tally(), "hits above queries"),
    ([metrics(0, 0), metrics(300, 40)], tally(), "whole number"),
    ([metrics(0, 0), metrics(300, 32)], tally((100, 32), (100, 16)), "usages report 48 cached"),
    ([metrics(0, 0), metrics(100, 32)], tally((100, 32), (100, 0)), "usages report 200 prompt"),
    ([metrics(0, 0), metrics(0, 0)], tally((100, 16)), "caching off"),
    ([metrics(0, 0), metrics(500, 0)], tally((100, 0)), "none found cached"),
    ([metrics(0, 0), metrics(500, 32)], tally((100, 20)), "usage: cached_tokens 20"),
    ([metrics(0, 0), metrics(500, 32)], tally((32, 32)), "usage: cached_tokens 32 of prompt_tokens 32"),
])  # fmt: skip
def test_inconsistent_prefix_counters_fail(samples, usage, expected):
    failures = check_prefix_counters(samples, usage, BLOCK, expect_hits=True)
    assert any(expected in f for f in failures), failures


def test_caching_off_with_no_prefix_traffic_passes():
    assert check_prefix_counters([metrics(0, 0), metrics(0, 0)], tally((100, 0)), BLOCK, expect_hits=False) == []


def test_rss_growth_over_the_bound_fails():
    assert check_rss({"core0": 2000.0, "frontend": None}, {"core0": 2400.0, "frontend": 90.0}, 300) != []


def test_parse_metrics_reads_tokenloom_and_vllm():
    text = "\n".join([
        "# HELP tokenloom_kv_blocks_used KV-cache blocks in use.",
        'tokenloom_kv_blocks_used{model_name="m"} 3',
        'tokenloom_prefix_cache_hits_total{model_name="m"} 64',
        'tokenloom_requests_finished_total{model_name="m",finish_reason="length"} 7',
        'tokenloom_time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 2',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 20.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9',
    ])  # fmt: skip
    assert parse_metrics(text) == {"kv_blocks_used": 3.0, "prefix_cache_hits_total": 64.0,
                                   "requests_finished_total:length": 7.0, "prefix_cache_queries_total": 120.0}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_with_prefix_caching_passes_its_checks():
    from tests.helpers.models import cached_default_model

    cached_default_model()
    result = subprocess.run(
        [sys.executable, "-m", "scripts.soak.run", "--duration", "8", "--concurrency", "4", "--prefix-fraction", "0.6",
         "--max-tokens", "4", "--metrics-interval", "1", "--seed", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=540)
    report = json.loads(result.stdout)
    assert result.returncode == 0, (report["checks_failed"], report["errors"], result.stderr[-2000:])
    assert report["checks_failed"] == [] and report["kv_blocks_used_after"] == 0
    cache = report["prefix_cache"]
    assert cache["hits_tokens"] > 0 and cache["usage_cached_tokens"] <= cache["hits_tokens"] <= cache["queries_tokens"]
