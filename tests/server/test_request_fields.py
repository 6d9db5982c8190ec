"""Every request field is honoured, refused with a 400 naming it, or accepted and logged
(docs/request_fields.md), checked on the request bodies themselves: no server, no model."""

from __future__ import annotations

import json
import logging

import pytest

from frontend.chat_tools import ToolOptions, resolve_tool_mode, template_messages
from frontend.errors import InvalidRequestError
from frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerateBody
from frontend.request_fields import NO_EFFECT, UNSUPPORTED, check_extra_fields

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_field_is_refused_by_name_unless_off(name):
    on = {"length_penalty": 2.0, "use_beam_search": True, "spaces_between_special_tokens": False,
          "guided_decoding_backend": "outlines", "modalities": ["audio"]}.get(name, "x")
    with pytest.raises(InvalidRequestError, match=name):
        check_extra_fields({name: on})
    for off in UNSUPPORTED[name]:
        check_extra_fields({name: off})


def test_no_effect_and_unknown_fields_are_accepted_and_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="frontend.request_fields"):
        for _ in range(3):
            chat(user="me", metadata={"a": "b"}, some_future_field=1).check_supported()
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'user'" in m for m in logged) == 1 and sum("'some_future_field'" in m for m in logged) == 1
    assert "user" in NO_EFFECT


def test_sampling_fields_reach_the_params():
    body = chat(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"5": 150, "7": -3},
                allowed_token_ids=[1, 2], bad_words=["no"], max_completion_tokens=9)
    params = body.to_sampling_params(9, body.num_logprobs)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.logit_bias == [(5, 150), (7, -3)]  # clamped where it is applied, so inf stays refusable
    assert params.allowed_token_ids == [1, 2] and params.bad_words == ["no"]
    with pytest.raises(InvalidRequestError, match="logit_bias keys must be token ids"):
        chat(logit_bias={"abc": 1}).to_sampling_params(9, None)


def test_each_structured_output_form_and_two_at_once():
    schema = {"type": "object"}
    forms = {
        "response_format json_schema": chat(response_format={"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": schema}}),
        "response_format json_object": chat(response_format={"type": "json_object"}),
        "structured_outputs regex": chat(structured_outputs={"regex": "a+"}),
        "guided_choice": chat(guided_choice=["a", "b"]),
        "guided_grammar": chat(guided_grammar='root ::= "a"'),
        "completions guided_json": CompletionRequest(prompt="x", guided_json=schema),
        "/generate structured_outputs": GenerateBody(prompt="x", structured_outputs={"json": schema}),
    }
    kinds = {name: body.structured_outputs_params().kind for name, body in forms.items()}
    assert kinds == {"response_format json_schema": "json", "response_format json_object": "json_object",
                     "structured_outputs regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
                     "completions guided_json": "json", "/generate structured_outputs": "json"}
    assert json.loads(forms["response_format json_schema"].structured_outputs_params().json) == schema
    assert chat(response_format={"type": "text"}).structured_outputs_params() is None
    with pytest.raises(InvalidRequestError, match="guided_regex, response_format"):
        chat(response_format={"type": "json_object"}, guided_regex="a").structured_outputs_params()


def test_tool_choice_modes():
    tools = chat(tools=[WEATHER]).tools
    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert resolve_tool_mode(None, None, None, ToolOptions()).kind == "none"
    assert resolve_tool_mode(tools, "none", None, options).template_tools is None
    auto = resolve_tool_mode(tools, None, None, options)
    assert auto.kind == "auto" and auto.structured_outputs is None and auto.new_parser() is not None
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        resolve_tool_mode(tools, "auto", None, ToolOptions())
    required = resolve_tool_mode(tools, "required", False, ToolOptions())
    schema = json.loads(required.structured_outputs.json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    named = resolve_tool_mode(tools, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}).tool_choice, None, ToolOptions())
    assert named.function_name == "get_weather" and json.loads(named.structured_outputs.json)["required"] == ["city"]
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        resolve_tool_mode(tools, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {
            "name": "other"}}).tool_choice, None, ToolOptions())
    with pytest.raises(InvalidRequestError, match="tool_choice needs tools"):
        resolve_tool_mode(None, "required", None, ToolOptions())


def test_tool_messages_render_arguments_as_a_mapping():
    body = chat(messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    messages = template_messages([m.to_template_dict() for m in body.messages])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_echo_with_logprobs_asks_for_the_prompts():
    assert CompletionRequest(prompt="x", echo=True, logprobs=2).num_prompt_logprobs == 2
    assert CompletionRequest(prompt="x", echo=True).num_prompt_logprobs is None
    assert CompletionRequest(prompt="x", prompt_logprobs=3, logprobs=1, echo=True).num_prompt_logprobs == 3
