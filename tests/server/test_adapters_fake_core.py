"""The Responses and Messages adapters through the official clients on a live frontend with a fake
engine core (a fixed script, so every text is known): shapes, streams, usage, API keys and errors.
The same APIs on the real model: test_server_responses_messages.py."""

from __future__ import annotations

import anthropic
import openai
import pytest
import requests

from scripts.lib.fake_engine import FrontendServer, expected_text
from tests.helpers.server import fake_core

pytestmark = pytest.mark.timeout(120)
KEY = "sekrit"


@pytest.fixture(scope="module")
def server(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.002"), "--served-model-name", "fake",
                        "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key


def test_responses_plain_and_streamed(oai, model_folder):
    response = oai.responses.create(model="fake", input="Hi", max_output_tokens=10)
    assert response.output_text == expected_text(model_folder, 10)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 10 and response.usage.total_tokens == response.usage.input_tokens + 10
    events = list(oai.responses.create(model="fake", input="Hi", max_output_tokens=10, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events[4:-4]) == response.output_text
    assert events[-1].response.output_text == response.output_text
    assert events[-1].response.usage.model_dump() == response.usage.model_dump()


def test_responses_store_and_previous_response_id(oai, server):
    first = oai.responses.create(model="fake", input="Hi", max_output_tokens=3)
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    follow_up = oai.responses.create(model="fake", input="More", max_output_tokens=3, previous_response_id=first.id)
    alone = oai.responses.create(model="fake", input="More", max_output_tokens=3)
    assert follow_up.usage.input_tokens > alone.usage.input_tokens  # the first turn came along
    unstored = oai.responses.create(model="fake", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="fake", input="x", max_output_tokens=3, previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_messages_plain_and_streamed(server, claude, model_folder):
    message = claude.messages.create(model="fake", max_tokens=10, messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].text == expected_text(model_folder, 10) and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 10 and message.usage.input_tokens > 0
    with claude.messages.stream(model="fake", max_tokens=10, messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"
    raw = requests.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, stream=True, timeout=30,
                        json={"model": "fake", "max_tokens": 3, "stream": True,
                              "messages": [{"role": "user", "content": "Hi"}]})
    lines = [line for line in raw.iter_lines(decode_unicode=True) if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert len(names) == sum(line.startswith("data: ") for line in lines)


def test_keys_and_error_shapes(server, claude):
    url = server.url
    body = {"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    assert requests.post(f"{url}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).status_code == 200
    r = requests.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
    r = requests.post(f"{url}/v1/responses", json={"input": "Hi"}, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401  # OpenAI's shape there
    assert requests.post(f"{url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                         headers={"x-api-key": KEY}, timeout=30).status_code == 200
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="fake", max_tokens=3, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
