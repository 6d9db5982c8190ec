"""The Responses and Messages adapters' request translation into chat requests, the response
store's bounds, and the error shapes: no server, no model (the live checks are in
test_server_responses_messages.py)."""

from __future__ import annotations

import pytest

from frontend.errors import InvalidRequestError, ModelNotFoundError, error_body
from frontend.protocol_messages import MessagesRequest
from frontend.protocol_responses import MAX_INPUT_ITEMS, UNSUPPORTED, ResponsesRequest
from frontend.response_store import ResponseStore, StoredResponse

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def responses(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def to_chat(body: ResponsesRequest, call_ids: set[str] | None = None):
    body.check_supported()
    return body.to_chat_request(body.input_messages(set() if call_ids is None else call_ids))


def test_responses_input_forms_become_chat_messages():
    assert [m.to_template_dict() for m in to_chat(responses()).messages] == [{"role": "user", "content": "hi"}]
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    messages = [m.to_template_dict() for m in to_chat(responses(input=items)).messages]
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_responses_fields_map_onto_chat_fields():
    body = responses(max_output_tokens=7, temperature=0.5, top_p=0.9, parallel_tool_calls=False,
                     text={"format": {"type": "json_schema", "name": "city", "schema": PARAMS, "strict": True}},
                     tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                     tool_choice={"type": "function", "name": "get_weather"})
    chat = to_chat(body)
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (7, 0.5, 0.9, False)
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == PARAMS
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == PARAMS
    assert chat.tool_choice.function.name == "get_weather"
    assert to_chat(responses(text={"format": {"type": "json_object"}})).response_format.type == "json_object"


@pytest.mark.parametrize("fields, words", [
    ({"input": ""}, "input must not be empty"),
    ({"input": []}, "input must not be an empty list"),
    ({"input": [{"role": "user", "content": "x"}] * 10_000}, f"at most {MAX_INPUT_ITEMS}"),
    ({"input": [{"type": "computer_call"}]}, "unknown item type 'computer_call'"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "call_id 'nope'"),
    # Images pass to the chat (tests/server/test_server_vision.py); files do not.
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input_file"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "string `text`"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tool type 'web_search'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "file_search"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
])
def test_responses_bad_input_is_a_400_naming_what(fields, words):
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        to_chat(responses(**fields))


def test_responses_unsupported_fields_pass_when_off():
    for name, offs in UNSUPPORTED.items():
        for off in offs:
            to_chat(responses(**{name: off}))
    # A call id known from the previous response's turn is a good one.
    output = {"type": "function_call_output", "call_id": "old", "output": "42"}
    assert to_chat(responses(input=[output]), {"old"}).messages[0].role == "tool"


def messages_body(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
                                           **fields})


def test_messages_blocks_become_chat_messages():
    body = messages_body(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], top_k=5, stop_sequences=["\n"],
        messages=[{"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                    {"type": "text", "text": "Let me look."},
                                                    {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": [{"type": "text", "text": "sunny"}]},
                                               {"type": "text", "text": "thanks"}]}],
        tools=[{"name": "get_weather", "description": "weather", "input_schema": PARAMS}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    body.check_supported()
    chat = body.to_chat_request()
    assert [m.to_template_dict() for m in chat.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "thanks"}]
    assert (chat.max_tokens, chat.top_k, chat.stop, chat.tool_choice, chat.parallel_tool_calls) == (
        16, 5, ["\n"], "required", False)
    assert chat.tools[0].function.parameters == PARAMS
    schema = messages_body(output_config={"format": {"type": "json_schema", "schema": PARAMS}}).to_chat_request()
    assert schema.response_format.json_schema.schema_ == PARAMS
    named = messages_body(tools=[{"name": "f", "input_schema": PARAMS}], tool_choice={"type": "tool", "name": "f"})
    assert named.to_chat_request().tool_choice.function.name == "f"


@pytest.mark.parametrize("fields, words", [
    ({"messages": []}, "messages must not be empty"),
    ({"messages": [{"role": "user", "content": "x"}] * 10_000}, f"at most {MAX_INPUT_ITEMS}"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "block type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "string `text`"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "content blocks"),
    ({"messages": [{"role": "user", "content": 5}]}, "content blocks"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role must be user or assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]}, "'nope'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]}, "tool_use block"),
    ({"system": [{"type": "image"}]}, "system"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"name": "f"}], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [{"name": "f"}], "tool_choice": {"type": ["any"]}}, "tool_choice.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
])
def test_messages_bad_input_is_a_400_naming_what(fields, words):
    with pytest.raises(InvalidRequestError, match=words):
        body = messages_body(**fields)
        body.check_supported()
        body.to_chat_request()


def test_error_shapes_by_api():
    error = InvalidRequestError("bad")
    assert error_body(error, "/v1/messages") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                              "message": "bad"}}
    assert error_body(ModelNotFoundError("no"), "/v1/messages")["error"]["type"] == "not_found_error"
    assert error_body(error, "/v1/responses") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                             "code": 400}}


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(max_entries=2, max_bytes=20_000)
    for name in "abc":
        store.put(name, StoredResponse.of([{"role": "user", "content": name}], set(), {"id": name}))
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    store.put("d", StoredResponse.of([], set(), {}))  # "b" was used last: "c" goes
    assert store.get("c") is None and store.get("b") is not None
    assert store.get("b").messages() == [{"role": "user", "content": "b"}] and store.get("b").response() == {"id": "b"}
    store.put("big", StoredResponse.of([{"content": "x" * 12_000}], set(), {}))
    store.put("big2", StoredResponse.of([{"content": "x" * 12_000}], {"call_1"}, {}))  # over max_bytes together
    assert store.get("big") is None and store.get("big2") is not None and store.num_bytes <= 20_000
    assert store.get("big2").call_ids == {"call_1"}
    store.put("huge", StoredResponse.of([{"content": "x" * 30_000}], set(), {}))  # never fits: not stored
    assert store.get("huge") is None and store.get("big2") is not None


def test_response_store_counts_what_the_entry_holds_in_memory():
    # A million empty lists are 2 MB of JSON and ~60 MB as Python lists; stored as JSON bytes,
    # the entry holds what it counts.
    import sys

    response = {"metadata": None, "tools": [{"type": "function", "name": "f", "x": [[] for _ in range(100_000)]}]}
    entry = StoredResponse.of([{"role": "user", "content": "hi"}], {"c"}, response)
    held = sum(sys.getsizeof(part) for part in (entry.messages_json, entry.response_json, *entry.call_ids))
    assert held <= entry.num_bytes < 2 * held + 1024
    assert entry.response()["tools"][0]["x"][:2] == [[], []]
