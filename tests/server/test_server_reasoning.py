"""`--reasoning-parser` through the server: deepseek_r1 on the fake core (whose script never
writes `</think>`, so all of it is reasoning), qwen3 on the real default model (which does not
think, so its answers stay content and grammars stay where a prompt puts them), and an
unknown name refused at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import requests

from ipc.text.tokenizer import Tokenizer
from scripts.lib.fake_engine import REPO_ROOT, FrontendServer, expected_text, subprocess_env
from tests.helpers.server import REAL_ENGINE
from tests.server.test_server_structured_outputs import ASK_WEATHER, SCHEMAS, chat
from tests.unit.test_text_tokenizer import THINKING_TEMPLATE, folder_with_template

NUM_TOKENS = 12


def sse_deltas(response: requests.Response) -> list[dict]:
    deltas = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            deltas += [choice["delta"] for choice in json.loads(line[6:])["choices"]]
    return deltas


def joined(deltas: list[dict], key: str) -> str:
    return "".join(delta.get(key) or "" for delta in deltas)


@pytest.fixture(scope="module")
def r1_server(model_folder):
    with FrontendServer(model_folder, "--reasoning-parser", "deepseek_r1") as s:
        yield s


def test_deepseek_r1_reads_an_answer_without_an_end_tag_as_all_reasoning(r1_server, model_folder):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": NUM_TOKENS}
    message = requests.post(f"{r1_server.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None,
                       "reasoning_content": expected_text(model_folder, NUM_TOKENS)}
    with requests.post(f"{r1_server.url}/v1/chat/completions", json={**body, "stream": True}, stream=True) as response:
        deltas = sse_deltas(response)
    assert joined(deltas, "reasoning_content") == expected_text(model_folder, NUM_TOKENS)
    assert joined(deltas, "content") == ""
    assert sum("reasoning_content" in delta for delta in deltas) > 1  # streamed as it comes, not at the end


def test_include_reasoning_false_leaves_the_reasoning_out(r1_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": NUM_TOKENS, "include_reasoning": False}
    message = requests.post(f"{r1_server.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] is None
    with requests.post(f"{r1_server.url}/v1/chat/completions", json={**body, "stream": True}, stream=True) as response:
        deltas = sse_deltas(response)
    assert joined(deltas, "reasoning_content") == joined(deltas, "content") == ""


def test_completions_are_not_parsed(r1_server, model_folder):
    body = {"prompt": "hi", "max_tokens": NUM_TOKENS}
    choice = requests.post(f"{r1_server.url}/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == expected_text(model_folder, NUM_TOKENS) and "reasoning_content" not in choice


def test_an_unknown_reasoning_parser_stops_the_server_at_start_up(model_folder):
    result = subprocess.run([sys.executable, "-m", "frontend.api_server", "--model", str(model_folder),
                             "--reasoning-parser", "nope"], capture_output=True, text=True, timeout=60,
                            env=subprocess_env(), cwd=REPO_ROOT)
    assert result.returncode == 2
    assert "argument --reasoning-parser: invalid choice: 'nope'" in result.stderr
    assert "deepseek_r1" in result.stderr and "qwen3" in result.stderr


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The fake core behind a folder whose template has Qwen3's enable_thinking switch."""
    folder = folder_with_template(tmp_path_factory.mktemp("thinking-model"), THINKING_TEMPLATE)
    with FrontendServer(folder, "--reasoning-parser", "qwen3") as server:
        yield server, folder


def test_chat_template_kwargs_reach_the_template(thinking_server):
    server, folder = thinking_server
    messages = [{"role": "user", "content": "hi"}]
    counts = {}
    for enable_thinking in (True, False):
        kwargs = {"enable_thinking": enable_thinking}
        body = {"messages": messages, "chat_template_kwargs": kwargs}
        tokens = requests.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
        assert tokens == Tokenizer(folder).encode_chat(messages, template_kwargs=kwargs)
        counts[enable_thinking] = len(tokens)
        body = {**body, "max_tokens": NUM_TOKENS}
        response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
        assert response["usage"]["prompt_tokens"] == len(tokens)
        assert response["choices"][0]["message"]["content"] == expected_text(folder, NUM_TOKENS)
    assert counts[False] > counts[True]  # the closed, empty <think></think>


def test_chat_template_kwargs_may_not_replace_the_messages(thinking_server):
    server, _ = thinking_server
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "chat_template_kwargs may not set messages" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def qwen3_client(default_model_path):
    import openai

    with FrontendServer(Path(default_model_path), "--engine-command", REAL_ENGINE, "--served-model-name", "smollm2",
                        "--reasoning-parser", "qwen3") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.mark.slow
def test_qwen3_leaves_a_model_that_does_not_think_all_content(qwen3_client):
    message = chat(qwen3_client, ASK_WEATHER, max_tokens=30, temperature=0).choices[0].message
    assert message.content and message.reasoning_content is None
    stream = chat(qwen3_client, ASK_WEATHER, max_tokens=30, temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == message.content
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)


@pytest.mark.slow
def test_qwen3_applies_a_grammar_at_once_when_the_prompt_ended_the_reasoning(qwen3_client):
    """As Qwen3's template writes `<think>\\n\\n</think>` for enable_thinking false: the prompt's
    last tag closes the reasoning, so the schema holds from the answer's first token."""
    schema = SCHEMAS["enum"]
    messages = [{"role": "user", "content": "Pick a color for the sky as JSON. <think>\n\n</think>"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}
    message = chat(qwen3_client, messages, response_format=response_format, temperature=0).choices[0].message
    jsonschema.validate(json.loads(message.content), schema)
    assert message.reasoning_content is None
