"""One output path: the offline `LLM` and the served API give the same text for the same requests.

Both make their text with `ipc.text` (tokenizer, chat template, output processor), so on
the default model a greedy request, a request cut by a stop string and a chat request
must match exactly between `LLM.generate` / `LLM.chat` and `/v1/completions` /
`/v1/chat/completions`. Each side runs the requests one at a time, in the same order, so
both see the same batch shapes and the same prefix-cache hits.
"""

from __future__ import annotations

import pytest
import requests

from ipc.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
NUM_TOKENS = 32
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def llm(default_model_path):
    from engine.llm import LLM

    return LLM(default_model_path)  # the server's defaults: same dtype, block size, batch limits


def complete(server, **body) -> dict:
    response = requests.post(f"{server.url}/v1/completions", timeout=300,
                             json={"model": "smollm2", "temperature": 0, "max_tokens": NUM_TOKENS, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, messages, **body) -> dict:
    response = requests.post(f"{server.url}/v1/chat/completions", timeout=300,
                             json={"model": "smollm2", "messages": messages, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, **kwargs)


def pick_stop(text: str) -> tuple[str, int]:
    """A 4-character stop string first found in the second half of `text`, and where."""
    for start in range(len(text) // 2, len(text) - 4):
        stop = text[start:start + 4]
        if text.find(stop) == start and stop.strip():
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_greedy_and_stop_string_text_match(server, llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0]
    served = complete(server, prompt=PROMPT)
    choice = served["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (full.text, full.finish_reason)
    assert served["usage"]["completion_tokens"] == len(full.token_ids)
    assert served["usage"]["prompt_tokens"] == len(full.prompt_token_ids)

    stop, start = pick_stop(full.text)
    for include in (False, True):
        offline = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=include), use_tqdm=False)[0]
        choice = complete(server, prompt=PROMPT, stop=[stop], include_stop_str_in_output=include)["choices"][0]
        assert offline.text == full.text[:start] + (stop if include else "")  # the stop string was hit
        assert (choice["text"], choice["finish_reason"]) == (offline.text, offline.finish_reason) \
            == (offline.text, "stop")
        assert len(offline.token_ids) < len(full.token_ids)  # and generation stopped there


def test_chat_matches_the_chat_route(server, llm):
    offline = llm.chat(CHAT, greedy(), use_tqdm=False)[0]
    served = chat(server, CHAT, max_tokens=NUM_TOKENS)
    choice = served["choices"][0]
    assert choice["message"]["content"] == offline.text and "Paris" in offline.text
    assert choice["finish_reason"] == offline.finish_reason
    assert served["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert served["usage"]["completion_tokens"] == len(offline.token_ids)


def test_chat_takes_a_list_of_conversations(llm):
    conversations = [CHAT, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outputs) == 2
    for conversation, output in zip(conversations, outputs):
        assert output.prompt == llm.tokenizer.apply_chat_template(conversation)
        assert output.prompt_token_ids == llm.apply_chat_template(conversation) == \
            llm.tokenizer.encode_chat(conversation)
        assert len(output.token_ids) == 2
