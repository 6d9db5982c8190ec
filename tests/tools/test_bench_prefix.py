"""The prefix-sharing benchmark workloads and bench_offline's prefix-caching options, without a model."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from scripts.bench import offline as bench_offline
from scripts.lib.workload import FIRST_SAFE_TOKEN_ID, make_multi_turn_workload, make_shared_prefix_workload
from tests.helpers import REPO_ROOT


def test_shared_prefix_workload_has_the_must_show_shape():
    requests = make_shared_prefix_workload(num_requests=64, num_groups=4, prefix_len=1024, question_len=32, output_len=32)
    assert len(requests) == 64 and {r.num_prompt_tokens for r in requests} == {1056} and {r.max_tokens for r in requests} == {32}
    groups = Counter(tuple(r.prompt_token_ids[:1024]) for r in requests)
    assert sorted(groups.values()) == [16, 16, 16, 16]
    assert len({tuple(r.prompt_token_ids[1024:]) for r in requests}) == 64  # every question its own
    assert [tuple(r.prompt_token_ids[:1024]) for r in requests[:8]] != [tuple(requests[0].prompt_token_ids[:1024])] * 8
    assert make_shared_prefix_workload(seed=3) == make_shared_prefix_workload(seed=3)
    assert all(FIRST_SAFE_TOKEN_ID <= t < 49152 for r in requests for t in r.prompt_token_ids)


def test_multi_turn_workload_shape():
    conversations = make_multi_turn_workload(num_conversations=16, num_turns=6, turn_len=64, output_len=32)
    assert len(conversations) == 16 and all(len(c.user_turns) == 6 and c.max_tokens == 32 for c in conversations)
    assert {len(turn) for c in conversations for turn in c.user_turns} == {64}


def test_generate_conversations_resends_the_history():
    class EchoLLM:  # "generates" the prompt's last two tokens
        def generate(self, prompts, params, use_tqdm=False):
            return [type("Out", (), {"token_ids": p[-2:]})() for p in prompts]

    conversations = make_multi_turn_workload(num_conversations=2, num_turns=3, turn_len=4, output_len=2)
    outputs, sent = bench_offline.generate_conversations(EchoLLM(), conversations)
    assert len(outputs) == len(sent) == 6
    first, second, third = sent[0], sent[2], sent[4]  # conversation 0, turns 0..2
    user = conversations[0].user_turns
    assert first.prompt_token_ids == user[0]
    assert second.prompt_token_ids == user[0] + user[0][-2:] + user[1]
    assert third.prompt_token_ids[: len(second.prompt_token_ids)] == second.prompt_token_ids


def test_prefix_caching_option():
    args = bench_offline.parse_args(["--workload", "shared_prefix", "--prefix-caching", "on,off", "--modes", "continuous"])
    assert args.prefix_caching == ["on", "off"] and args.workload == "shared_prefix"
    assert bench_offline.parse_args([]).prefix_caching == ["on"]
    assert bench_offline.result_name("continuous", False) == "continuous_no_prefix_caching"
    with pytest.raises(SystemExit):
        bench_offline.parse_args(["--prefix-caching", "maybe"])
    with pytest.raises(SystemExit):
        bench_offline.parse_args(["--workload", "multi_turn", "--modes", "continuous,hf"])


# ---- bench_serving, bench_vllm_offline and peers_table: the prefix-caching parts ----


def test_bench_serving_prefix_options_and_ratios():
    from scripts.bench import serving as bench_serving

    args = bench_serving.parse_args(["--workload", "multi_turn", "--prefix-caching", "on,off"])
    assert args.prefix_caching == ["on", "off"] and args.workload == "multi_turn"
    assert bench_serving.parse_args([]).prefix_caching is None  # against --base-url, as before
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--prefix-caching", "sometimes"])
    assert bench_serving.prefix_cache_delta({"prefix_cache_queries_total": 100, "prefix_cache_hits_total": 16},
                                            {"prefix_cache_queries_total": 300, "prefix_cache_hits_total": 116}) == {
        "num_queries": 200, "num_hits": 100, "hit_rate": 0.5}
    assert bench_serving.prefix_cache_delta({}, None)["hit_rate"] is None  # a server without those counters

    def run(tok_s, ttft):
        return {"total_token_throughput": tok_s, "request_throughput": tok_s / 10, "cached_share": 0.5,
                "ttft_s": {"median": ttft, "p99": 2 * ttft}, "latency_s": {"median": 3 * ttft},
                "prefix_cache": {"hit_rate": 0.5}}

    ratios = bench_serving.compare(run(300.0, 0.1), run(100.0, 0.4))
    assert ratios["total_token_throughput_on_vs_off"] == 3.0 and ratios["ttft_median_off_vs_on"] == 4.0


def test_serving_multi_turn_resends_the_history_and_waits_for_each_reply():
    import asyncio

    from scripts.lib.bench_metrics import RequestTrace
    from scripts.bench.serving_multi_turn import cached_share_by_turn, run_conversations

    class SplitTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [int(word) for word in text.split()]

    sent = []

    async def send(request):
        sent.append(request.prompt_token_ids)
        await asyncio.sleep(0)
        return RequestTrace(send_time=0.0, chunk_times=[1.0], num_output_tokens=2,
                            num_prompt_tokens=request.num_prompt_tokens,
                            num_cached_tokens=4 if request.num_prompt_tokens > 4 else 0,
                            text=" 7 8")

    conversations = make_multi_turn_workload(num_conversations=2, num_turns=3, turn_len=4, output_len=2)
    traces = asyncio.run(run_conversations(conversations, send, SplitTokenizer(), float("inf"), 0))
    assert [len(c) for c in traces] == [3, 3]
    user = conversations[0].user_turns
    assert user[0] in sent and user[0] + [7, 8] + user[1] in sent and user[0] + [7, 8] + user[1] + [7, 8] + user[2] in sent
    assert cached_share_by_turn(traces)[0] == 0.0 and cached_share_by_turn(traces)[2] > 0


def test_bench_vllm_offline_takes_the_shared_prefix_workload():
    from scripts.peers import vllm_offline as bench_vllm_offline

    args = bench_vllm_offline.parse_args(["--model", "m", "--workload", "shared_prefix", "--prefix-len", "1024"])
    assert args.workload == "shared_prefix" and args.enable_prefix_caching and args.max_model_len >= 1024 + 32 + 32
    assert not bench_vllm_offline.parse_args(["--model", "m", "--no-enable-prefix-caching"]).enable_prefix_caching


def test_peers_table_shows_the_shared_prefix_workload(tmp_path):
    import json
    import subprocess

    def write(name, results):
        (tmp_path / name).write_text(json.dumps({"results": results}))

    write("ours_offline_shared_prefix_defaults.json", {
        "continuous": {"total_tokens_per_s": 3000.0, "prefix_cache_hit_rate": 0.9},
        "continuous_no_prefix_caching": {"total_tokens_per_s": 1000.0, "prefix_cache_hit_rate": 0.0}})
    write("vllm_offline_shared_prefix_defaults.json", {"vllm": {"total_tokens_per_s": 2000.0, "prefix_cache_hit_rate": 0.9}})
    result = subprocess.run([sys.executable, "-m", "scripts.peers.table", str(tmp_path), "--configs", "defaults",
                             "--rates", "2", "--workloads", "random", "shared_prefix"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ours, vllm = json.loads((tmp_path / "summary.json").read_text())
    assert ours["engine"] == "ours" and ours["shared_prefix_caching_on_vs_off"] == 3.0
    assert ours["shared_prefix_offline_vs_vllm"] == 1.5 and vllm["shared_prefix_hit_rate"] == 0.9


def test_peers_table_takes_the_median_of_the_serving_repeats(tmp_path):
    import json
    import subprocess

    def write(engine, rep, ttft_p99, out_tok_s):
        report = {"median_ttft_ms": 100.0, "p99_ttft_ms": ttft_p99, "median_tpot_ms": 20.0,
                  "output_throughput": out_tok_s, "failed": 0}
        (tmp_path / f"{engine}_serving_defaults_rate2_rep{rep}.json").write_text(json.dumps(report))

    for rep, (ours, theirs) in enumerate([(300.0, 400.0), (200.0, 500.0), (260.0, 300.0)], start=1):
        write("ours", rep, ours, 100.0 * rep)
        write("vllm", rep, theirs, 50.0 * rep)
    # A single run's file from an older layout is ignored when numbered repeats exist.
    (tmp_path / "ours_serving_defaults_rate2.json").write_text(json.dumps({"p99_ttft_ms": 1.0}))
    result = subprocess.run([sys.executable, "-m", "scripts.peers.table", str(tmp_path), "--configs", "defaults",
                             "--rates", "2", "--workloads"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ours, vllm = json.loads((tmp_path / "summary.json").read_text())
    assert ours["rate2_ttft_p99_ms"] == 260.0 and vllm["rate2_ttft_p99_ms"] == 400.0
    assert ours["rate2_ttft_p99_ms_runs"] == [300.0, 200.0, 260.0]
    assert ours["rate2_ttft_p99_ms_vs_vllm"] == 260.0 / 400.0
    assert ours["rate2_out_tok_s_vs_vllm"] == 2.0 and "rate2_out_tok_s_vs_vllm" not in vllm
    assert "_runs" not in result.stdout  # the table shows the medians only
