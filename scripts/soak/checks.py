"""What scripts/soak/run.py checks once its traffic has stopped: pure functions over /metrics
snapshots (scrape_metrics' dicts) and what the clients saw, each returning the list of
failures, empty when the server passed.

The prefix-cache counters, as engine/core/scheduler.py defines them, count prompt tokens:
each time a request is admitted (again after a preemption) `prefix_cache_queries_total`
grows by its length and `prefix_cache_hits_total` by the tokens it found cached, a whole
number of blocks. A request's usage.prompt_tokens_details.cached_tokens is its first
admission's hits. So, with caching on:

    hits <= queries, both never decrease
    hits grow in whole blocks
    sum(usage cached_tokens) <= hits grown     (aborted and preempted requests add hits
                                                that no usage reports)
    sum(usage prompt_tokens) <= queries grown  (each served request was admitted)
    each usage's cached_tokens: whole blocks, below its prompt_tokens (the last prompt
                                token is always recomputed for its logits)

With caching off both counters stay put and every usage reports 0. "Used" KV blocks are
those a request holds; a cached block nobody holds counts as free, so once every request
has ended, used must be 0 and free what it was before the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

QUERIES = "prefix_cache_queries_total"
HITS = "prefix_cache_hits_total"


@dataclass
class UsageTally:
    """The usages the soak's clients got back (streams walked away from report none)."""

    num_reports: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    bad: list[str] = field(default_factory=list)  # the first few usages that break a per-request rule

    def add(self, usage: dict, block_size: int) -> None:
        num_prompt = usage.get("prompt_tokens", 0)
        num_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        self.num_reports += 1
        self.num_prompt_tokens += num_prompt
        self.num_cached_tokens += num_cached
        if (num_cached % block_size or num_cached >= max(num_prompt, 1)) and len(self.bad) < 5:
            self.bad.append(f"cached_tokens {num_cached} of prompt_tokens {num_prompt} (block size {block_size})")


def check_kv_blocks(before: dict, after: dict) -> list[str]:
    failures = []
    if after.get("kv_blocks_used", 0):
        failures.append(f"{after['kv_blocks_used']:.0f} KV blocks still used after every request ended")
    if after.get("kv_blocks_free") != before.get("kv_blocks_free"):
        failures.append(f"KV blocks free went from {before.get('kv_blocks_free')} to {after.get('kv_blocks_free')}")
    total = after.get("kv_blocks_free", 0) + after.get("kv_blocks_used", 0)
    if after.get("prefix_cache_blocks", 0) > total:
        failures.append(f"{after['prefix_cache_blocks']:.0f} cached blocks in a pool of {total:.0f}")
    return failures


def check_prefix_counters(samples: list[dict], tally: UsageTally, block_size: int, expect_hits: bool) -> list[str]:
    """`samples`: /metrics snapshots in time order, the one before the traffic first and
    the one after it last."""
    failures = []
    series = [(s.get(QUERIES, 0.0), s.get(HITS, 0.0)) for s in samples]
    for i, ((q0, h0), (q1, h1)) in enumerate(zip(series, series[1:]), start=1):
        if q1 < q0 or h1 < h0:
            failures.append(f"prefix counters went down at sample {i}: queries {q0:.0f}->{q1:.0f}, "
                            f"hits {h0:.0f}->{h1:.0f}")
            break
    over = [(i, q, h) for i, (q, h) in enumerate(series) if h > q]
    if over:
        failures.append(f"hits above queries at sample {over[0][0]}: {over[0][2]:.0f} > {over[0][1]:.0f}")
    num_queries = series[-1][0] - series[0][0]
    num_hits = series[-1][1] - series[0][1]
    if num_hits % block_size:
        failures.append(f"hits grew by {num_hits:.0f} tokens, not a whole number of {block_size}-token blocks")
    if tally.num_cached_tokens > num_hits:
        failures.append(f"usages report {tally.num_cached_tokens} cached tokens, the counters {num_hits:.0f}")
    if num_queries and tally.num_prompt_tokens > num_queries:
        failures.append(f"usages report {tally.num_prompt_tokens} prompt tokens, the counters looked up "
                        f"{num_queries:.0f}")
    if not num_queries and (num_hits or tally.num_cached_tokens):
        failures.append(f"no lookups (caching off) but {num_hits:.0f} hits, {tally.num_cached_tokens} cached in usages")
    if expect_hits and num_queries and not num_hits:
        failures.append(f"{num_queries:.0f} prompt tokens looked up during prefix-sharing traffic, none found cached")
    failures += [f"usage: {bad}" for bad in tally.bad]
    return failures


def check_rss(rss_before: dict[str, float | None], rss_after: dict[str, float | None],
              max_growth_mb: float) -> list[str]:
    failures = []
    for name, before in rss_before.items():
        after = rss_after.get(name)
        if before is not None and after is not None and after - before > max_growth_mb:
            failures.append(f"{name} RSS grew {after - before:.0f} MB ({before:.0f} -> {after:.0f}), "
                            f"over {max_growth_mb:.0f} MB")
    return failures
