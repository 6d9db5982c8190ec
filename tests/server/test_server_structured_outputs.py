"""Structured outputs, tools and the sampling fields through the official `openai` client,
on the real two-process server with the default model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest
import requests


pytestmark = pytest.mark.slow

SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                      "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name", "age"]}}, "required": ["person"]},
    "enum": {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
             "required": ["color"]},
    "array": {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 2, "maxItems": 3}}, "required": ["fruits"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                      "y": {"type": "integer"}},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"]},
    "any_of_null": {"type": "object", "properties": {"nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                                     "year": {"type": "integer"}},
                    "required": ["nickname", "year"]},
}
ASK = {
    "nested": "Describe a person named Ann, 40 years old, as JSON.",
    "enum": "Pick a color for the sky as JSON.",
    "array": "List two or three fruits as JSON.",
    "pattern": "Give an airport code like ABC-12 as JSON.",
    "defs_ref": "Give a line from point (1, 2) to point (3, 4) as JSON.",
    "any_of_null": "Give a nickname (or null) and a year as JSON.",
}


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def engine_pid(server) -> int:
    """The engine core: the frontend's child process."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    return int(children[0])


def chat(client, messages, **fields):
    fields.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="smollm2", messages=messages, **fields)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_json_schema_answers_validate(client, mode):
    from concurrent.futures import ThreadPoolExecutor

    sampling = {"temperature": 0} if mode == "greedy" else {"temperature": 0.8, "seed": 3}

    def ask(name: str):
        return chat(client, [{"role": "user", "content": ASK[name]}], **sampling, response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        choices = dict(zip(SCHEMAS, pool.map(ask, SCHEMAS)))
    stopped = [name for name, choice in choices.items() if choice.finish_reason == "stop"]
    for name in stopped:  # every answer the grammar ended
        jsonschema.validate(json.loads(choices[name].message.content), SCHEMAS[name])
    assert len(stopped) >= len(SCHEMAS) - 1, {n: c.message.content for n, c in choices.items()}


def test_json_object_regex_choice_and_grammar(client):
    response = chat(client, [{"role": "user", "content": "Reply with a JSON object with keys name and age for Bob, "
                                                         "31 years old. Only JSON."}],
                    response_format={"type": "json_object"}, temperature=0)
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    for extra in ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, {"guided_regex": r"\d{3}-\d{4}"}):
        answer = chat(client, [{"role": "user", "content": "A phone number?"}], extra_body=extra).choices[0]
        assert re.fullmatch(r"\d{3}-\d{4}", answer.message.content) and answer.finish_reason == "stop"
    for extra in ({"guided_choice": ["red", "green"]}, {"structured_outputs": {"choice": ["red", "green"]}}):
        assert chat(client, ASK_WEATHER, extra_body=extra).choices[0].message.content in ("red", "green")
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    answer = chat(client, ASK_WEATHER, extra_body={"structured_outputs": {"grammar": grammar}}).choices[0]
    assert answer.message.content in ("The answer is yes.", "The answer is no.")


def test_n_choices_each_follow_the_grammar(client):
    response = chat(client, ASK_WEATHER, n=3, temperature=1.0, seed=5,
                    extra_body={"structured_outputs": {"regex": "[a-z]{2,6}"}})
    assert len(response.choices) == 3
    assert all(re.fullmatch("[a-z]{2,6}", c.message.content) for c in response.choices)


def streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    calls, finish_reason = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id and delta.function.name  # the first delta of a call: id and name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_plain_and_streamed(client, tool_choice):
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    response = chat(client, ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    calls, finish_reason = streamed_calls(chat(client, ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                               temperature=0, stream=True))
    assert finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # The call and its result go back through the chat template.
    follow_up = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"}]
    assert chat(client, follow_up, max_tokens=20).choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_answers(client):
    choice = chat(client, ASK_WEATHER, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls


def test_bad_grammars_are_400s_and_the_core_serves_on(server, client):
    pid = engine_pid(server)
    bad = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
           {"structured_outputs": {"regex": "a(b"}}, {"structured_outputs": {"grammar": "root ::= "}}]
    reasons = ['Unsupported type "objectx"', "parenthesis is not closed", "EBNF parser error"]
    for body, reason in zip(bad, reasons):
        r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ASK_WEATHER, **body}, timeout=60)
        assert r.status_code == 400 and reason in r.json()["error"]["message"]
    assert chat(client, ASK_WEATHER, max_tokens=5).choices[0].finish_reason == "length"
    assert engine_pid(server) == pid


def test_contradicting_constraints_are_400s_with_the_reason(server, client):
    """Each part is valid; together they leave no token: the engine finds it at the step."""
    for fields in ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 5},
                   {"structured_outputs": {"regex": "[0-9]+"}, "allowed_token_ids": [0]}):
        r = requests.post(f"{server.url}/v1/chat/completions",
                          json={"messages": ASK_WEATHER, "max_tokens": 8, **fields}, timeout=60)
        assert r.status_code == 400 and "no token satisfies" in r.json()["error"]["message"], r.text[:300]
    assert chat(client, ASK_WEATHER, max_tokens=5).choices[0].finish_reason == "length"


def test_sampling_fields_through_the_openai_client(server, client):
    prompt = "List the days of the week: Monday, Tuesday,"
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert "Wednesday" in plain.choices[0].text
    banned = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": ["Wednesday"]})
    assert "Wednesday" not in banned.choices[0].text
    allowed = requests.post(f"{server.url}/tokenize", json={"prompt": " one two", "add_special_tokens": False},
                            timeout=30).json()["tokens"]
    only = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": only.choices[0].text, "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    assert set(ids) <= set(allowed)
    penalised = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=0.5, presence_penalty=0.5,
        logit_bias={"28": 2.0}, extra_body={"repetition_penalty": 1.2, "prompt_logprobs": 1})
    entries = penalised.choices[0].model_extra["prompt_logprobs"]
    num_prompt_tokens = penalised.usage.prompt_tokens
    assert entries[0] is None and len(entries) == num_prompt_tokens and all(entries[1:])
    echoed = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1)
    choice = echoed.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == num_prompt_tokens + 4
    assert all(math.isfinite(v) for v in choice.logprobs.token_logprobs[1:])
    # Each token's own log-prob leads its top_logprobs, prompt tokens (rarely the top 1) included.
    for token, value, top in list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                      choice.logprobs.top_logprobs))[1:]:
        assert top[token] == value and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])


def test_tokenize_round_trips_and_counts_chat(server):
    text = "你好，世界 🌍🚀 naïve"
    tokens = requests.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert requests.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]},
                         timeout=30).json()["prompt"] == text
    chat_count = requests.post(f"{server.url}/tokenize", json={"messages": ASK_WEATHER}, timeout=30).json()["count"]
    usage = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ASK_WEATHER, "max_tokens": 1},
                          timeout=60).json()["usage"]
    assert chat_count == usage["prompt_tokens"]


BAD_VALUES = [
    ('{"prompt": "x", "frequency_penalty": NaN}', "not valid JSON"),
    ('{"prompt": "x", "presence_penalty": Infinity}', "not valid JSON"),
    ('{"prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty"),
    ('{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty"),
    ('{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias"),
    ('{"prompt": "x", "allowed_token_ids": [49152]}', "allowed_token_ids"),
    ('{"prompt": "x", "prompt_logprobs": 50}', "prompt_logprobs"),
    (json.dumps({"prompt": "x", "logit_bias": {str(i): 1 for i in range(10_000)}}), "logit_bias"),
    ('{"prompt": "x", "use_beam_search": true}', "use_beam_search"),
    ('{"prompt": "x", "chat_template": "{{ x }}"}', "chat_template"),
]


def test_bad_values_are_400s_naming_the_field(server):
    pid = engine_pid(server)
    for body, name in BAD_VALUES:
        r = requests.post(f"{server.url}/v1/completions", data=body, timeout=60,
                          headers={"content-type": "application/json"})
        assert r.status_code == 400 and name in r.json()["error"]["message"], (body[:80], r.text[:200])
    r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ASK_WEATHER, "functions": [{}]},
                      timeout=30)
    assert r.status_code == 400 and "functions" in r.text
    r = requests.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ASK_WEATHER, "max_tokens": 2, "user": "me", "metadata": {"a": "b"}, "store": False})
    assert r.status_code == 200
    assert engine_pid(server) == pid
