"""The offline `LLM.generate` makes its text as the server does: stop strings end a
request (text cut, finish reason "stop", generation stopped), on a tiny random Llama
that carries the fake core's real tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from scripts.lib.fake_engine import write_fake_model
from tests.helpers.models import make_tiny_model

PROMPT = "Hello world, how are you"
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offline-text")
    tokenizer_folder = write_fake_model(folder / "tokenizer")
    vocab_size = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    path, _ = make_tiny_model(folder, "LlamaForCausalLM", vocab_size=vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, Path(path) / name)
    return LLM(path, block_size=4, dtype="float32")


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def full(llm):
    output = llm.generate(PROMPT, greedy(), use_tqdm=False)[0]
    assert len(output.text) >= 20 and output.finish_reason == "length"
    return output


def pick_stop(text: str) -> tuple[str, int]:
    """A 3-character stop string first found in the middle of `text`, and where."""
    for start in range(len(text) // 2, len(text) - 3):
        stop = text[start:start + 3]
        if text.find(stop) == start and stop.strip():
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_ends_the_request(llm, full, include):
    stop, start = pick_stop(full.text)
    output = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=include), use_tqdm=False)[0]
    assert output.text == full.text[:start] + (stop if include else "")
    assert output.finish_reason == "stop"
    # Generation stopped at the step that completed the stop string, as the server aborts it.
    assert len(output.token_ids) < len(full.token_ids)
    assert output.token_ids == full.token_ids[:len(output.token_ids)]
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_stop_strings_in_a_batch_end_only_their_request(llm, full):
    stop, start = pick_stop(full.text)
    plain, stopped = llm.generate([PROMPT, PROMPT], [greedy(), greedy(stop=["not in any text", stop])],
                                  use_tqdm=False)
    assert (plain.text, plain.finish_reason, plain.token_ids) == (full.text, "length", full.token_ids)
    assert stopped.text == full.text[:start] and stopped.finish_reason == "stop"


def test_stop_strings_need_a_tokenizer(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, dtype="float32")
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([1, 2, 3], greedy(stop=["x"]), use_tqdm=False)
