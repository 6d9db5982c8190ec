"""Benchmark helpers without a model: workload generation, latency arithmetic, plots."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from scripts.lib.bench_metrics import RequestTrace, percentile, request_metrics, summarize, summarize_traces
from scripts.lib.workload import FIRST_SAFE_TOKEN_ID, make_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class CharTokenizer:
    """One token per character: enough to check that real prompts are cut to length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


# --- workload ---------------------------------------------------------------------------


def test_workload_is_deterministic_for_a_seed():
    a = make_workload(20, (4, 50), (3, 40), seed=7, vocab_size=1000)
    b = make_workload(20, (4, 50), (3, 40), seed=7, vocab_size=1000)
    c = make_workload(20, (4, 50), (3, 40), seed=8, vocab_size=1000)
    assert a == b
    assert a != c


@pytest.mark.parametrize("distribution", ["uniform", "long_tail"])
def test_workload_lengths_and_token_ids_in_range(distribution):
    requests = make_workload(200, (4, 50), (3, 40), distribution, seed=1, vocab_size=1000)
    assert len(requests) == 200
    for r in requests:
        assert 4 <= r.num_prompt_tokens <= 50
        assert 3 <= r.max_tokens <= 40
        assert all(FIRST_SAFE_TOKEN_ID <= t < 1000 for t in r.prompt_token_ids)
        assert r.prompt is None


def test_uniform_workload_spreads_lengths():
    requests = make_workload(200, (4, 50), (3, 40), seed=1, vocab_size=1000)
    assert len({r.max_tokens for r in requests}) > 20
    assert len({r.num_prompt_tokens for r in requests}) > 20


def test_long_tail_is_nine_short_to_one_long_and_shuffled():
    requests = make_workload(50, (4, 50), (8, 512), "long_tail", seed=3, vocab_size=1000)
    lens = [r.max_tokens for r in requests]
    assert lens.count(8) == 45
    assert lens.count(512) == 5
    assert lens != sorted(lens) and lens != sorted(lens, reverse=True)
    other = [r.max_tokens for r in make_workload(50, (4, 50), (8, 512), "long_tail", seed=4, vocab_size=1000)]
    assert other != lens and sorted(other) == sorted(lens)


def test_long_tail_has_a_long_request_even_when_small():
    lens = [r.max_tokens for r in make_workload(4, (4, 8), (2, 100), "long_tail", seed=0, vocab_size=1000)]
    assert sorted(lens) == [2, 2, 2, 100]


def test_real_prompts_are_text_cut_to_length():
    tokenizer = CharTokenizer()
    requests = make_workload(10, (5, 300), (3, 9), seed=2, real_prompts=True, tokenizer=tokenizer)
    assert requests == make_workload(10, (5, 300), (3, 9), seed=2, real_prompts=True, tokenizer=tokenizer)
    for r in requests:
        assert 5 <= r.num_prompt_tokens <= 300
        assert r.prompt == tokenizer.decode(r.prompt_token_ids)
        assert r.prompt.strip()


@pytest.mark.parametrize("kwargs", [
    dict(input_len=(0, 5)),
    dict(output_len=(9, 3)),
    dict(distribution="bimodal"),
    dict(real_prompts=True),  # no tokenizer
])
def test_workload_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        make_workload(4, **kwargs)


# --- metrics ----------------------------------------------------------------------------


def test_percentile_interpolates_linearly_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 25) == 1.75
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpy_on_random_lists():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 1, 33.3, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_request_metrics_on_a_hand_made_trace():
    # Sent at 10; chunks (one token each) at 10.5, 10.75, 11.25, 12.
    trace = RequestTrace(send_time=10.0, chunk_times=[10.5, 10.75, 11.25, 12.0], num_output_tokens=4)
    m = request_metrics(trace)
    assert m.ttft == 0.5
    assert m.latency == 2.0
    assert m.tpot == 0.5  # (2.0 - 0.5) / (4 - 1)
    assert m.itls == [0.25, 0.5, 0.75]


def test_tpot_counts_tokens_not_chunks():
    # Two chunks carrying 7 tokens: TPOT spreads the decode time over 6 tokens, ITL has one gap.
    m = request_metrics(RequestTrace(send_time=0.0, chunk_times=[1.0, 4.0], num_output_tokens=7))
    assert m.ttft == 1.0
    assert m.tpot == 0.5
    assert m.itls == [3.0]


def test_single_token_request_has_no_tpot():
    m = request_metrics(RequestTrace(send_time=0.0, chunk_times=[0.25], num_output_tokens=1))
    assert (m.ttft, m.latency, m.tpot, m.itls) == (0.25, 0.25, None, [])


def test_summarize_and_summarize_traces():
    assert summarize([1.0, 2.0, 3.0, 6.0]) == {"mean": 3.0, "median": 2.5, "p99": pytest.approx(5.91)}
    assert summarize([]) == {"mean": None, "median": None, "p99": None}
    traces = [
        RequestTrace(send_time=0.0, chunk_times=[0.5, 0.75, 1.25, 2.0], num_output_tokens=4, num_prompt_tokens=10),
        RequestTrace(send_time=1.0, chunk_times=[1.25, 1.5], num_output_tokens=2, num_prompt_tokens=6),
        RequestTrace(send_time=1.0, is_success=False, error="HTTP 500", num_prompt_tokens=99),
    ]
    s = summarize_traces(traces, duration=4.0)
    assert (s["num_successful"], s["num_failed"]) == (2, 1)
    assert (s["num_prompt_tokens"], s["num_output_tokens"]) == (16, 6)
    assert s["request_throughput"] == 0.5
    assert s["output_throughput"] == 1.5
    assert s["total_token_throughput"] == 5.5
    assert s["ttft_s"] == {"mean": 0.375, "median": 0.375, "p99": pytest.approx(0.4975)}
    assert s["tpot_s"]["mean"] == 0.375  # (0.5 + 0.25) / 2
    assert s["itl_s"]["mean"] == 0.4375  # gaps 0.25, 0.5, 0.75 and 0.25, pooled
    assert s["itl_s"]["median"] == 0.375
    assert s["latency_s"]["mean"] == 1.25  # (2.0 + 0.5) / 2


# --- plots ------------------------------------------------------------------------------


def _steps(num_seqs: list[int], num_tokens: list[int], step_s: float = 0.1) -> list:
    return [SimpleNamespace(start_time=5 + i * step_s, end_time=5 + (i + 1) * step_s, num_seqs=s, num_tokens=t)
            for i, (s, t) in enumerate(zip(num_seqs, num_tokens))]


def test_plot_occupancy_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts.lib.plots import plot_occupancy

    path = tmp_path / "occupancy.png"
    plot_occupancy({
        "continuous": _steps([4, 4, 4, 4, 3, 1], [120, 4, 4, 4, 3, 1]),
        "static": _steps([4, 4, 2, 1, 4, 3, 1], [100, 4, 2, 1, 60, 3, 1]),
        "hf": [],  # a mode without steps is left out
    }, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_latency_distributions_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts.lib.plots import plot_latency_distributions

    path = tmp_path / "latency.png"
    plot_latency_distributions({
        "continuous": {"ttft": [0.1, 0.2, 0.3], "latency": [1.0, 1.5, 2.0]},
        "static": {"ttft": [0.1, 2.0, 4.0], "latency": [1.0, 3.0, 5.0]},
    }, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC
