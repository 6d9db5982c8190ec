"""The HTTP API through a live frontend (subprocess) with fake engine cores behind it.

The fake core emits a fixed script, so every expected text is known exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest
import requests

from scripts.lib.fake_engine import FrontendServer, expected_text, read_event_log
from tests.helpers.server import fake_core, metric, wait_for

pytestmark = pytest.mark.timeout(120)
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def server(model_folder, event_log):
    # 2 ms per step: fast, yet a 1000-token request runs long enough to be aborted.
    core = fake_core("--step-delay", "0.002", "--event-log", str(event_log))
    with FrontendServer(model_folder, *core, "--served-model-name", "fake") as server:
        yield server


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")


def test_seed_client_generate_unchanged(server, model_folder):
    # The seed's client: three plain requests.post calls to vLLM's /generate.
    for max_tokens in (30, 150, 50):
        response = requests.post(f"{server.url}/generate",
                                  json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        assert response.status_code == 200
        assert response.json() == {"text": [PROMPT + expected_text(model_folder, max_tokens)]}


def test_generate_streams_nul_separated_objects(server, model_folder):
    body = '{"prompt": "Hi", "max_tokens": 12, "stream": true, "n": 2, "seed": 5}'  # and no Content-Type, like vLLM's curl
    response = requests.post(f"{server.url}/generate", data=body, stream=True)
    assert response.status_code == 200
    chunks = [json.loads(c) for c in response.iter_lines(delimiter=b"\0") if c]
    assert len(chunks) >= 12
    assert chunks[-1]["text"] == ["Hi" + expected_text(model_folder, 12, 5), "Hi" + expected_text(model_folder, 12, 6)]


def test_completions_streamed_equals_non_streamed(oai, model_folder):
    kwargs = dict(model="fake", prompt=PROMPT, max_tokens=40, temperature=0, seed=3)
    full = oai.completions.create(**kwargs)
    assert full.choices[0].text == expected_text(model_folder, 40, 3)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 40 and full.usage.prompt_tokens > 0
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_streamed_equals_non_streamed(oai, model_folder):
    kwargs = dict(model="fake", messages=[{"role": "user", "content": "Hi there"}], max_completion_tokens=25)
    full = oai.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected_text(model_folder, 25)
    assert full.usage.completion_tokens == 25
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_stop_n_seed_and_logprobs(oai, model_folder):
    stopped = oai.completions.create(model="fake", prompt=PROMPT, max_tokens=100, stop=["fox", "lazy"])
    assert stopped.choices[0].text == "The quick brown " and stopped.choices[0].finish_reason == "stop"
    many = oai.completions.create(model="fake", prompt=[PROMPT, "Bye"], max_tokens=6, n=2, seed=10, logprobs=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [expected_text(model_folder, 6, s) for s in (10, 11, 10, 11)]
    assert many.usage.completion_tokens == 24
    logprobs = many.choices[0].logprobs
    assert len(logprobs.tokens) == 6 and all(len(top) == 2 for top in logprobs.top_logprobs)
    chat = oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 for t in content)


def test_hundred_concurrent_requests(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        sizes = [i % 37 + 1 for i in range(100)]
        results = await asyncio.gather(*(
            client.completions.create(model="fake", prompt=f"request {i}", max_tokens=n) for i, n in enumerate(sizes)))
        await client.close()
        return sizes, results

    sizes, results = asyncio.run(main())
    assert [r.usage.completion_tokens for r in results] == sizes
    assert all(r.choices[0].finish_reason == "length" for r in results)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}, "maximum context length"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 3.0}, "presence_penalty must be in"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{}]}, "functions"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
    ("/generate", {"prompt": PROMPT, "use_beam_search": True}, "use_beam_search"),
    ("/generate", {"max_tokens": 3}, "prompt"),
])
def test_bad_input_gets_400_with_a_message(server, path, body, message):
    response = requests.post(f"{server.url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400


def test_malformed_json_gets_400(server):
    for path in ("/generate", "/v1/completions"):
        response = requests.post(f"{server.url}{path}", data="{not json", headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()


def test_models_health_schema_and_metrics(server, oai):
    assert [m.id for m in oai.models.list().data] == ["fake"]
    assert requests.get(f"{server.url}/health").status_code == 200
    paths = requests.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(paths)
    text = requests.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free",
                 "prompt_tokens_total", "generation_tokens_total", "requests_finished_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count"):
        assert f"tokenloom_{name}" in text
    assert metric(server.url, "kv_blocks_free", 'model_name="fake"') > 0


def test_streaming_client_disconnect_aborts(server, event_log):
    num_aborts = metric(server.url, "requests_finished_total", 'finish_reason="abort"')
    response = requests.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000, "stream": True},
                             stream=True)
    next(response.iter_lines())
    response.close()
    wait_for(lambda: len(read_event_log(event_log, "abort")) >= 1, 5, 0.05, what="the abort")
    wait_for(lambda: metric(server.url, "requests_finished_total", 'finish_reason="abort"') == num_aborts + 1,
             5, 0.05, what="the abort's count")


def test_non_streaming_client_disconnect_aborts(server, event_log):
    num_aborted = len(read_event_log(event_log, "abort"))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1000}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
    wait_for(lambda: len(read_event_log(event_log, "abort")) == num_aborted + 1, 5, 0.05, what="the abort")


def test_api_key(model_folder):
    with FrontendServer(model_folder, "--api-key", "sekret") as server:
        body = {"prompt": PROMPT, "max_tokens": 2}
        denied = requests.post(f"{server.url}/v1/completions", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        allowed = requests.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert allowed.status_code == 200
        assert requests.post(f"{server.url}/generate", json=body).status_code == 401
        assert requests.get(f"{server.url}/health").status_code == 200


