"""Benchmark pictures (matplotlib, Agg): batch occupancy over time and latency distributions.

`plot_occupancy` makes the case for continuous batching visible: under static batching
the running count decays as a batch's short sequences finish and nobody takes their
place ("often idle"); under continuous batching a finished sequence's slot is refilled
at the next step ("constantly busy").
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MODE_COLORS = {"continuous": "tab:green", "static": "tab:red", "hf": "tab:purple"}


def plot_occupancy(step_stats_by_mode: dict[str, list], path: str) -> None:
    """One row per mode, on a shared time axis: running sequences (left) and useful
    tokens per step (right, log scale) against time since the mode's first step.

    Each step record needs `start_time`, `end_time`, `num_seqs` and `num_tokens`
    (engine.core.step_stats.StepStats, or anything with those attributes)."""
    modes = [mode for mode, steps in step_stats_by_mode.items() if steps]
    if not modes:
        raise ValueError("no step stats to plot")
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 2.6 * len(modes) + 0.8), sharex=True, squeeze=False)
    max_seqs = max(s.num_seqs for mode in modes for s in step_stats_by_mode[mode])
    for (ax_seqs, ax_tokens), mode in zip(axes, modes):
        steps = step_stats_by_mode[mode]
        color = MODE_COLORS.get(mode)
        t0 = steps[0].start_time
        # Each step holds its value from its start to its end, then the line joins the next step.
        times = [t for s in steps for t in (s.start_time - t0, s.end_time - t0)]
        seqs = [s.num_seqs for s in steps for _ in range(2)]
        tokens = [s.num_tokens for s in steps for _ in range(2)]
        ax_seqs.plot(times, seqs, color=color, lw=1.0)
        ax_seqs.fill_between(times, seqs, color=color, alpha=0.25)
        ax_seqs.set_ylim(0, max_seqs * 1.3)
        ax_seqs.set_ylabel(f"{mode}\nrunning sequences")
        ax_seqs.text(0.99, 0.95, f"time-weighted mean {_time_weighted_mean(steps, 'num_seqs'):.1f}, "
                     f"{len(steps)} steps, {times[-1]:.2f} s", transform=ax_seqs.transAxes, ha="right", va="top")
        ax_tokens.plot(times, tokens, color=color, lw=0.8)
        ax_tokens.set_yscale("log")
        ax_tokens.set_ylabel("useful tokens per step")
        for ax in (ax_seqs, ax_tokens):
            ax.grid(alpha=0.3)
    axes[0][0].set_title("running sequences: static batches drain and wait, continuous refills")
    axes[0][1].set_title("useful tokens per step (log)")
    for ax in axes[-1]:
        ax.set_xlabel("time since first step (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_distributions(latencies_by_mode: dict[str, dict[str, list[float]]], path: str) -> None:
    """Empirical CDFs of TTFT and end-to-end latency per mode.

    `latencies_by_mode[mode]` has lists under "ttft" and "latency", in seconds."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in zip(axes, ("ttft", "latency"), ("time to first token", "end-to-end latency")):
        for mode, latencies in latencies_by_mode.items():
            values = sorted(latencies.get(key, []))
            if not values:
                continue
            fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
            ax.step([values[0]] + values, fractions, where="post", color=MODE_COLORS.get(mode), label=mode)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _time_weighted_mean(steps: list, name: str) -> float:
    total_time = sum(s.end_time - s.start_time for s in steps)
    if total_time <= 0:
        return sum(getattr(s, name) for s in steps) / len(steps)
    return sum(getattr(s, name) * (s.end_time - s.start_time) for s in steps) / total_time
