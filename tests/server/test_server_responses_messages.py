"""OpenAI's Responses API and Anthropic's Messages API through their official clients, on the real
two-process server with the default model: plain, streamed, structured, tools forced and fed back,
the answers parsed into each client's own types; bad input is a 400 in each API's shape."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import requests

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
FRANCE = "What is the capital of France?"
PARIS = "The capital of France is Paris."
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                      "required": ["city", "unit"]}
ASK_WEATHER = "What is the weather in Paris?"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
RESPONSES_EVENTS_IN_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta",
                             "response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.completed"]
# anthropic 2.x's messages.create() no longer takes temperature, top_p or top_k; the API (and this server) does.
GREEDY = {"temperature": 0}
MESSAGES_EVENTS_IN_ORDER = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                            "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def oai(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def engine_pid(server) -> int:
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    return int(children[0])


def ordered_subsequence(wanted: list[str], seen: list[str]) -> bool:
    """Every wanted type appears, in this order (each may repeat)."""
    position = 0
    for kind in seen:
        if position < len(wanted) and kind == wanted[position]:
            position += 1
    return position == len(wanted)


def test_greedy_answer_is_the_same_on_all_three_routes(oai, claude):
    chat = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": FRANCE}],
                                       temperature=0, max_tokens=30)
    response = oai.responses.create(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=30)
    message = claude.messages.create(model="smollm2", max_tokens=30, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": FRANCE}])
    assert chat.choices[0].message.content == PARIS
    assert response.output_text == PARIS and message.content[0].text == PARIS
    assert response.status == "completed" and message.stop_reason == "end_turn"
    assert response.usage.input_tokens == message.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == message.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens


def test_responses_plain_and_streamed_parse_into_the_clients_types(oai):
    from openai.types.responses import Response, ResponseOutputMessage

    # Sent twice: a prefix-cache hit may move a bf16 greedy answer, so the one compared with the
    # stream below meets the cache as the stream does.
    for _ in range(2):
        response = oai.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a color.",
                                        temperature=0, max_output_tokens=12)
    assert isinstance(response, Response) and isinstance(response.output[0], ResponseOutputMessage)
    assert response.output[0].content[0].type == "output_text" and response.output_text
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 12
    events = list(oai.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a color.",
                                       temperature=0, max_output_tokens=12, stream=True))
    kinds = [event.type for event in events]
    final = events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert ordered_subsequence(RESPONSES_EVENTS_IN_ORDER[:-1], kinds)
    assert kinds[-1] in ("response.completed", "response.incomplete") and final.status == response.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert final.output_text == response.output_text and final.usage.output_tokens == response.usage.output_tokens
    # Stored: GET returns it; an unknown id is a 404.
    assert oai.responses.retrieve(response.id).output_text == response.output_text
    assert requests.get(f"{oai.base_url}responses/resp-nope", timeout=10).status_code == 404


def test_responses_json_schema_format(oai):
    response = oai.responses.create(model="smollm2", input="Describe a person named Ann, 40 years old, as JSON.",
                                    text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                     "strict": True}}, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_responses_forced_function_call_then_its_output_fed_back(oai):
    from openai.types.responses import ResponseFunctionToolCall

    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER_PARAMETERS}]
    forced = dict(model="smollm2", tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=60, temperature=0)
    response = oai.responses.create(input=ASK_WEATHER, **forced)
    call = response.output[0]
    assert response.output[0].type == "function_call" and isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS) is None
    # Streamed: the arguments arrive as deltas and add up to the same call.
    events = list(oai.responses.create(input=ASK_WEATHER, stream=True, **forced))
    kinds = [event.type for event in events]
    assert ordered_subsequence(["response.output_item.added", "response.function_call_arguments.delta",
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"], kinds)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments == events[-1].response.output[0].arguments
    # The output fed back, whole (the call item in the input) ...
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 20 C"}
    # (tool_choice "none": the answer is text, whatever the model would call next. Sent twice: a prefix-cache
    # hit may move a bf16 greedy answer, so the one compared below meets the cache as the chained one does.)
    for _ in range(2):
        follow_up = oai.responses.create(model="smollm2", tools=tools, tool_choice="none", max_output_tokens=30,
                                         temperature=0,
                                         input=[{"role": "user", "content": ASK_WEATHER}, call.model_dump(), output])
    assert follow_up.output[0].type == "message" and follow_up.output_text
    # ... or through previous_response_id: the same conversation, the same greedy answer.
    chained = oai.responses.create(model="smollm2", tools=tools, tool_choice="none", max_output_tokens=30,
                                   temperature=0, input=[output], previous_response_id=response.id)
    assert chained.usage.input_tokens == follow_up.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens == follow_up.usage.input_tokens_details.cached_tokens
    assert chained.output_text == follow_up.output_text


def test_messages_plain_and_streamed_parse_into_the_clients_types(claude):
    from anthropic.types import Message, TextBlock

    kwargs = dict(model="smollm2", max_tokens=12, extra_body=GREEDY, system="Answer briefly.",
                  messages=[{"role": "user", "content": "Name a color."}])
    message = claude.messages.create(**kwargs)
    assert isinstance(message, Message) and isinstance(message.content[0], TextBlock)
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    events = list(claude.messages.create(stream=True, **kwargs))
    assert ordered_subsequence(MESSAGES_EVENTS_IN_ORDER, [event.type for event in events])
    assert events[0].message.usage.input_tokens == message.usage.input_tokens


def test_messages_stop_sequence(claude):
    message = claude.messages.create(model="smollm2", max_tokens=30, extra_body=GREEDY,
                                     stop_sequences=["Paris", "Rome"], messages=[{"role": "user", "content": FRANCE}])
    assert message.content[0].text == PARIS.split("Paris")[0]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
    with claude.messages.stream(model="smollm2", max_tokens=30, extra_body=GREEDY, stop_sequences=["Paris", "Rome"],
                                messages=[{"role": "user", "content": FRANCE}]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")


def test_messages_output_config_json_schema(claude):
    message = claude.messages.create(model="smollm2", max_tokens=60, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": PERSON}},
                                     messages=[{"role": "user", "content": "Describe Ann, 40 years old, as JSON."}])
    jsonschema.validate(json.loads(message.content[0].text), PERSON)


def test_messages_forced_tool_plain_and_streamed(claude):
    from anthropic.types import ToolUseBlock

    kwargs = dict(model="smollm2", max_tokens=60, extra_body=GREEDY,
                  tools=[{"name": "get_weather", "description": "Current weather in a city",
                          "input_schema": WEATHER_PARAMETERS}],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": ASK_WEATHER}])
    message = claude.messages.create(**kwargs)
    block = message.content[0]
    assert isinstance(block, ToolUseBlock) and block.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER_PARAMETERS)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == block.input and final.stop_reason == "tool_use"
    # The result fed back as a tool_result block.
    follow_up = claude.messages.create(
        model="smollm2", max_tokens=30, extra_body=GREEDY, tools=kwargs["tools"],
        messages=[{"role": "user", "content": ASK_WEATHER}, {"role": "assistant", "content": [block.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                "content": "Sunny, 20 C"}]}],
        tool_choice={"type": "none"})
    assert follow_up.content[0].type == "text" and follow_up.stop_reason in ("end_turn", "max_tokens")


def test_bad_input_is_a_400_in_each_apis_shape_and_the_core_serves_on(server, oai, claude):
    import anthropic

    pid = engine_pid(server)
    long_text = "hello " * 10_000  # over the context length
    responses_cases = [
        {"input": ""}, {"input": long_text}, {"input": [{"role": "user", "content": "hi"}] * 10_000},
        {"input": [{"type": "computer_call", "id": "x"}]},
        {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        {"input": "hi", "previous_response_id": "resp_nope"},
        {"input": "hi", "tools": [{"type": "web_search"}]}, {"input": "hi", "background": True},
    ]
    for body in responses_cases:
        r = requests.post(f"{server.url}/v1/responses", json={"max_output_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text[:300])
    user = {"role": "user", "content": "hi"}
    messages_cases = [
        {"messages": []}, {"messages": [{"role": "user", "content": long_text}]}, {"messages": [user] * 10_000},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope"}]}]},
        {"messages": [{"role": "user", "content": [{"text": 5}]}]}, {"messages": [user], "max_tokens": "many"},
        {"messages": [user], "thinking": {"type": "enabled", "budget_tokens": 1024}},
    ]
    for body in messages_cases:
        r = requests.post(f"{server.url}/v1/messages", json={"max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text[:300])
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
    r = requests.post(f"{server.url}/v1/messages", data=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="smollm2", max_tokens=4, messages=[])
    assert raised.value.body["error"]["message"] == "messages must not be empty"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=[user])
    assert engine_pid(server) == pid
    assert oai.responses.create(model="smollm2", input="hi", max_output_tokens=3).usage.output_tokens == 3
