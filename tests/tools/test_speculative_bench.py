"""scripts/bench/speculative.py's pieces that need no server: its workloads, flags and ratios."""

from __future__ import annotations

import pytest

from scripts.bench.speculative import CONFIGS, parse_args, ratios
from scripts.lib.editing_workload import TASKS, add_typos, make_editing_requests, make_free_requests, most_common_name
from scripts.lib.speculative_servers import server_command


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from ipc.text.tokenizer import Tokenizer

    return Tokenizer(model_folder)


def test_editing_requests_cycle_the_tasks_over_texts_of_the_asked_length(tokenizer):
    requests = make_editing_requests(6, tokenizer, seed=3, token_range=(300, 600))
    assert [r.kind for r in requests] == [*TASKS, *TASKS]
    for request in requests:
        num_tokens = len(tokenizer.encode(request.prediction, add_special_tokens=False))
        assert 250 <= num_tokens <= 650, (request.source, num_tokens)  # whole lines: near the range
        content = request.messages[0]["content"]
        if request.kind == "fix_typos":
            assert request.prediction not in content  # the code in the prompt has the typos
        else:
            assert request.prediction in content
    again = make_editing_requests(6, tokenizer, seed=3, token_range=(300, 600))
    assert [r.messages for r in again] == [r.messages for r in requests]


def test_typos_and_names():
    import random

    text = "the scheduler schedules requests; the scheduler frees blocks\n" * 20
    typed = add_typos(text, random.Random(0), share=0.5)
    assert typed != text and len(typed) == len(text) and sorted(typed) == sorted(text)
    assert most_common_name(text) == "scheduler"


def test_free_requests_copy_nothing():
    requests = make_free_requests(10, seed=1)
    assert all(r.prediction is None and r.kind == "free" for r in requests)
    assert len({r.messages[0]["content"] for r in requests[:8]}) == 8


def test_flags_drop_llama_without_its_binary(tmp_path):
    args = parse_args(["--llama-server", str(tmp_path / "nothing"), "--batched", "none"])
    assert args.configs == ["off", "ngram", "prediction", "off-chat", "self-int4"] and args.batched == []
    with pytest.raises(SystemExit):
        parse_args(["--configs", "off,turbo"])
    command, extra = server_command("ours-ngram", args, 1234)
    assert '{"method": "ngram", "num_speculative_tokens": 8}' in command and extra == {}
    binary = tmp_path / "llama-server"
    binary.write_text("")
    args = parse_args(["--llama-server", str(binary), "--configs", "off,llama-ngram,llama-draft"])
    command, extra = server_command("llama-ngram", args, 1234)
    assert command[:2] == [str(binary), "-m"] and "ngram-mod" in command and extra == {"cache_prompt": False}
    assert "-md" in server_command("llama-draft", args, 1234)[0]
    assert set(CONFIGS) >= set(args.configs)


def test_ratios_need_both_sides():
    results = {"off": {"median_decode_tok_s": 50.0}, "ngram": {"median_decode_tok_s": 100.0},
               "prediction": {"median_decode_tok_s": None}}
    assert ratios(results) == {"ngram_vs_off": 2.0}
