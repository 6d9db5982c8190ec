"""The record of one offline mode's run, its summary, and how bench_offline reports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.step_stats import padding_of
from scripts.lib.bench_metrics import percentile
from scripts.lib.workload import WorkloadRequest


@dataclass
class ModeResult:
    mode: str
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_useful_positions: int  # sum of prompt + output - 1 over requests
    num_computed_positions: int  # token positions run through the model, padding included
    ttfts: list[float]
    latencies: list[float]
    step_stats: list = field(default_factory=list)  # start_time, end_time, num_seqs, num_tokens per step
    dtype: str = ""  # what the mode actually ran in, "auto" resolved
    kv_cache_dtype: str = ""  # our engine's KV cache, resolved; "": not our engine
    quantization: str | None = None  # "int8": --quantization; None: weights in dtype
    compile_mode: str = "eager"  # "inductor": the engine's forward ran under torch.compile
    startup_s: float = 0.0  # building the engine or loading the model, compilation included
    prefix_caching: bool | None = None  # None: not our engine
    num_prefix_cache_queries: int = 0  # prompt tokens looked up, measured run only
    num_prefix_cache_hits: int = 0
    # static-padded's waste (engine.baselines.padded_static_scheduler), and every mode's batch size
    num_padding_tokens: int = 0  # left padding computed
    num_finished_row_tokens: int = 0  # finished rows' pad-token decodes computed
    max_batch_rows: int = 0  # most rows in one step: running sequences, finished padded rows included
    mean_batch_rows: float = 0.0  # time-weighted over the steps
    num_preemptions: int = 0
    spec_decode: dict = field(default_factory=dict)  # frontend.spec_decode_metrics.spec_decode_summary of the run
    steal_share: float | None = None  # CPU time stolen by the hypervisor over wall x cores

    def summary(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s,
            "useful_share": self.num_useful_positions / self.num_computed_positions,
            "mean_ttft_s": sum(self.ttfts) / len(self.ttfts),
            "median_ttft_s": percentile(self.ttfts, 50),
            "p99_ttft_s": percentile(self.ttfts, 99),
            "mean_latency_s": sum(self.latencies) / len(self.latencies),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_computed_positions": self.num_computed_positions,
            "num_steps": len(self.step_stats),
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization,
            "compile_mode": self.compile_mode,
            "startup_s": self.startup_s,
            "prefix_caching": self.prefix_caching,
            "prefix_cache_hit_rate": self.num_prefix_cache_hits / max(1, self.num_prefix_cache_queries),
            "num_prefix_cache_hit_tokens": self.num_prefix_cache_hits,
            "num_padding_tokens": self.num_padding_tokens,
            "num_finished_row_tokens": self.num_finished_row_tokens,
            "max_batch_rows": self.max_batch_rows,
            "mean_batch_rows": self.mean_batch_rows,
            "num_preemptions": self.num_preemptions,
            "steal_share": self.steal_share,
            **({"spec_decode": self.spec_decode} if self.spec_decode else {}),  # when speculation ran
        }


def step_counts(steps: list) -> dict:
    """The ModeResult fields read off a run's StepStats: positions computed (padding
    included), padding by kind, and rows per step (a finished padded row decodes one token)."""
    padding = [padding_of(s) for s in steps]  # (left padding, finished rows' decodes)
    rows = [s.num_seqs + finished for s, (_, finished) in zip(steps, padding)]
    durations = [s.end_time - s.start_time for s in steps]
    return dict(
        num_computed_positions=sum(s.num_tokens + left + finished for s, (left, finished) in zip(steps, padding)),
        num_padding_tokens=sum(left for left, _ in padding),
        num_finished_row_tokens=sum(finished for _, finished in padding),
        max_batch_rows=max(rows, default=0),
        mean_batch_rows=sum(r * d for r, d in zip(rows, durations)) / max(sum(durations), 1e-12),
    )


def useful_positions(workload: list[WorkloadRequest]) -> int:
    return sum(r.num_prompt_tokens + r.max_tokens - 1 for r in workload)


def print_table(summaries: dict[str, dict]) -> None:
    columns = [
        ("mode", "{}", None),
        ("dtype", "{}", "dtype"),
        ("compile", "{}", "compile_mode"),
        ("start s", "{:.1f}", "startup_s"),
        ("elapsed s", "{:.2f}", "elapsed_s"),
        ("req/s", "{:.2f}", "requests_per_s"),
        ("out tok/s", "{:.1f}", "output_tokens_per_s"),
        ("total tok/s", "{:.1f}", "total_tokens_per_s"),
        ("useful", "{:.3f}", "useful_share"),
        ("mean TTFT s", "{:.3f}", "mean_ttft_s"),
        ("mean lat s", "{:.3f}", "mean_latency_s"),
        ("hit rate", "{:.3f}", "prefix_cache_hit_rate"),
        ("rows max/mean", "{}", "batch_rows"),
        ("vs cont.", "{:.2f}x", "total_tokens_per_s_vs_continuous"),
    ]
    rows = [[name for name, _, _ in columns]]
    for mode, s in summaries.items():
        s = {**s, "batch_rows": f"{s.get('max_batch_rows', 0)}/{s.get('mean_batch_rows', 0.0):.1f}"}
        rows.append([mode] + [fmt.format(s[key]) if s.get(key) is not None else "-" for _, fmt, key in columns[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


def step_columns(steps: list) -> dict[str, list]:
    t0 = steps[0].start_time if steps else 0.0
    return {
        "start_s": [round(s.start_time - t0, 6) for s in steps],
        "end_s": [round(s.end_time - t0, 6) for s in steps],
        "num_seqs": [s.num_seqs for s in steps],
        "num_tokens": [s.num_tokens for s in steps],
        "num_padding_tokens": [padding_of(s)[0] for s in steps],
        "num_finished_row_tokens": [padding_of(s)[1] for s in steps],
    }
