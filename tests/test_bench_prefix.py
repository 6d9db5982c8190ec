"""The prefix-sharing benchmark workloads and bench_offline's prefix-caching options, without a model."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_offline  # noqa: E402
from workload import FIRST_SAFE_TOKEN_ID, make_multi_turn_workload, make_shared_prefix_workload  # noqa: E402


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
