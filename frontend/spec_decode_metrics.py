"""Speculative decoding's counts, as the frontend and the benchmarks show them.

Each core sends `SchedulerStats.spec_decode`: one cumulative `SpecDecodeStats` per method
that has drafted (n-gram lookup, a draft model, a request's `prediction`). Here they are
summed over cores (`sum_spec_decode`), differenced over a measured run (`subtract_spec_decode`)
and summarized per method (`spec_decode_summary`): the acceptance rate is accepted over
proposed tokens, and tokens per draft is what one verification row yields (accepted + the
one sampled token): the speed-up's upper bound at equal step cost.
"""

from __future__ import annotations

from typing import Iterable

from ipc.messages import SpecDecodeStats, SpecMethod

COUNT_FIELDS = ("num_drafts", "num_proposed_tokens", "num_accepted_tokens", "num_emitted_tokens")


def method_name(method: SpecMethod) -> str:
    return method.name.lower()  # "ngram", "draft", "prediction": the names of --speculative-config and the API


def sum_spec_decode(per_core: Iterable[list[SpecDecodeStats]]) -> list[SpecDecodeStats]:
    """One record per method seen on any core, counts summed, in SpecMethod order."""
    totals: dict[SpecMethod, SpecDecodeStats] = {}
    for stats_list in per_core:
        for stats in stats_list:
            total = totals.setdefault(stats.method, SpecDecodeStats(stats.method))
            for name in COUNT_FIELDS:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
    return [totals[method] for method in sorted(totals)]


def subtract_spec_decode(after: list[SpecDecodeStats], before: list[SpecDecodeStats]) -> list[SpecDecodeStats]:
    """What a run added: `after` minus `before`, per method (a method absent before counts from 0)."""
    earlier = {stats.method: stats for stats in before}
    result = []
    for stats in after:
        base = earlier.get(stats.method, SpecDecodeStats(stats.method))
        result.append(SpecDecodeStats(stats.method, *(getattr(stats, n) - getattr(base, n) for n in COUNT_FIELDS)))
    return result


def acceptance_rate(stats: SpecDecodeStats) -> float:
    """Accepted over proposed tokens; 0 before anything was proposed."""
    return stats.num_accepted_tokens / stats.num_proposed_tokens if stats.num_proposed_tokens else 0.0


def spec_decode_summary(stats_list: list[SpecDecodeStats]) -> dict[str, dict]:
    """{method: counts, acceptance_rate, tokens_per_draft} for each method that drafted; {} when none did."""
    summary = {}
    for stats in stats_list:
        if not stats.num_drafts:
            continue
        summary[method_name(stats.method)] = {
            **{name: getattr(stats, name) for name in COUNT_FIELDS},
            "acceptance_rate": round(acceptance_rate(stats), 4),
            "tokens_per_draft": round(stats.num_emitted_tokens / stats.num_drafts, 3),
        }
    return summary


def format_spec_decode(summary: dict[str, dict]) -> str:
    """One line per method for a benchmark's printout."""
    return "\n".join(
        f"speculative decoding, {method}: {s['num_proposed_tokens']} proposed, {s['num_accepted_tokens']} accepted "
        f"({s['acceptance_rate']:.1%}), {s['num_emitted_tokens']} emitted in {s['num_drafts']} drafts "
        f"({s['tokens_per_draft']:.2f} tokens per draft)"
        for method, s in summary.items())
