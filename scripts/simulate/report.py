"""What scripts/simulate/run.py writes: the benchmarks' own JSON fields, built by their own
code (offline_result.ModeResult, bench_metrics.summarize_traces) from simulated times,
and the benchmarks' occupancy picture, measured and simulated side by side."""

from __future__ import annotations

from types import SimpleNamespace

from scripts.lib.bench_metrics import RequestTrace, summarize_traces
from scripts.lib.offline_result import ModeResult, step_columns, step_counts


def summary_fields(result, batching: str, dtype: str, prefix_caching: bool) -> dict:
    """bench_offline's summary and bench_serving's, merged at the top level (they share
    only the token counts, which agree)."""
    requests = result.requests
    mode = ModeResult(
        mode=batching,
        elapsed_s=result.elapsed_s,
        num_requests=len(requests),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_output_tokens=sum(len(r.token_times) for r in requests),
        num_useful_positions=sum(r.num_prompt_tokens + len(r.token_times) - 1 for r in requests),
        ttfts=[r.ttft_s for r in requests],
        latencies=[r.latency_s for r in requests],
        step_stats=result.step_stats,
        dtype=dtype,
        compile_mode="simulated",
        prefix_caching=prefix_caching,
        num_preemptions=result.num_preemptions,
        **step_counts(result.step_stats),
    )
    traces = [RequestTrace(send_time=r.arrival_s, chunk_times=r.token_times, num_output_tokens=len(r.token_times),
                           num_prompt_tokens=r.num_prompt_tokens) for r in requests]
    return {**mode.summary(), **summarize_traces(traces, result.elapsed_s)}


def build_report(result, batching: str, dtype: str, prefix_caching: bool, extra: dict) -> dict:
    steps = result.step_stats
    columns = step_columns(steps)
    columns["num_kv_blocks_used"] = [s.num_kv_blocks_used for s in steps]
    return {
        **summary_fields(result, batching, dtype, prefix_caching),
        "simulated": True,
        "num_kv_blocks": result.num_kv_blocks,
        "max_model_len": result.max_model_len,
        "num_preemptions": result.num_preemptions,
        "kv_blocks_used": {"time_s": columns["end_s"], "num_blocks": columns["num_kv_blocks_used"]},
        **extra,
        "ttfts_s": [r.ttft_s for r in result.requests],
        "latencies_s": [r.latency_s for r in result.requests],
        "step_stats": columns,
    }


def steps_from_columns(columns: dict) -> list:
    """bench_offline's step_stats columns back into records that plots.plot_occupancy reads."""
    num_blocks = columns.get("num_kv_blocks_used") or [None] * len(columns["start_s"])  # simulations record it
    return [SimpleNamespace(start_time=a, end_time=b, num_seqs=s, num_tokens=t, num_kv_blocks_used=k)
            for a, b, s, t, k in zip(columns["start_s"], columns["end_s"], columns["num_seqs"], columns["num_tokens"],
                                     num_blocks)]


def plot_kv_blocks(step_stats_by_label: dict[str, list], num_kv_blocks: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.2))
    for label, steps in step_stats_by_label.items():
        ax.step([s.end_time for s in steps], [s.num_kv_blocks_used for s in steps], where="post", label=label)
    ax.axhline(num_kv_blocks, color="gray", ls="--", lw=0.8, label=f"pool: {num_kv_blocks} blocks")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks used")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
