"""The hostile case for deeply nested JSON, on every route that parses JSON a client sends.

Two ways to nest: JSON *text* in a string field (tool call arguments, `guided_json`), which
the server parses itself (ipc.bounded_json: at most 128 levels), and a nested *value* in the
body (a schema, a tool_use input), which the body parser takes up to 200 levels and which
is then bounded like the text. The body itself nested 50,000 deep is the third. Each must get
a 400 in its route's error shape (OpenAI's, or Anthropic's on /v1/messages) naming the
problem, never a 500 or a plain-text answer, and no core may die.
"""

from __future__ import annotations

from scripts.hostile.adapters import shape_problem
from scripts.hostile.client import Target

DEEP_TEXT = "[" * 50_000 + "]" * 50_000  # far past json.loads' recursion limit (about 1000)
DEEP_BODY = ("[" * 50_000 + "]" * 50_000).encode()
VALUE_DEPTH = 150  # under the body parser's 200 levels, over the 128 of a client's JSON string


def deep_value(depth: int = VALUE_DEPTH) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_schema(depth: int = VALUE_DEPTH // 2) -> dict:
    """An object schema nested `depth` times: two JSON levels each ({"properties": {"a": ...}})."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


USER = {"role": "user", "content": "hi"}
CHAT_WITH_CALL = [USER, {"role": "assistant", "content": "", "tool_calls": [_call(DEEP_TEXT)]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": deep_schema()}}
# (route, case, body): bodies hold each way a route nests; bytes are sent as they are.
CASES = [
    ("/v1/completions", "guided_json text", {"prompt": "hi", "max_tokens": 2, "guided_json": DEEP_TEXT}),
    ("/v1/completions", "structured_outputs.json text",
     {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": DEEP_TEXT}}),
    ("/v1/completions", "guided_json value", {"prompt": "hi", "max_tokens": 2, "guided_json": deep_schema()}),
    ("/v1/completions", "body", DEEP_BODY),
    ("/v1/chat/completions", "tool_calls arguments text", {"messages": CHAT_WITH_CALL, "max_tokens": 2}),
    ("/v1/chat/completions", "response_format schema value",
     {"messages": [USER], "max_tokens": 2,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema()}}}),
    ("/v1/chat/completions", "tools parameters value",
     {"messages": [USER], "max_tokens": 2, "tools": [TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", "guided_json text", {"messages": [USER], "max_tokens": 2, "guided_json": DEEP_TEXT}),
    ("/v1/chat/completions", "body", DEEP_BODY),
    ("/v1/responses", "function_call arguments text",
     {"max_output_tokens": 2, "store": False,
      "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_TEXT},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    ("/v1/responses", "text.format schema value",
     {"max_output_tokens": 2, "store": False, "input": "hi",
      "text": {"format": {"type": "json_schema", "name": "x", "schema": deep_schema()}}}),
    ("/v1/responses", "body", DEEP_BODY),
    ("/v1/messages", "tool_use input value",
     {"max_tokens": 2, "messages": [
         USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                  "input": deep_value()}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
    ("/v1/messages", "tools input_schema value",
     {"max_tokens": 2, "messages": [USER], "tools": [{"name": "f", "input_schema": deep_schema()}],
      "tool_choice": {"type": "any"}}),
    ("/v1/messages", "body", DEEP_BODY),
    ("/v1/embeddings", "input value", {"input": deep_value()}),
    ("/v1/embeddings", "body", DEEP_BODY),
    ("/tokenize", "tool_calls arguments text", {"messages": CHAT_WITH_CALL}),
    ("/generate", "structured_outputs.json text",
     {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": DEEP_TEXT}}),
    ("/generate", "body", DEEP_BODY),
]


def nested_json(target: Target) -> dict:
    pids = target.core_pids()
    answers = {}
    for route, name, body in CASES:
        status, text, _ = target.post(route, body, timeout=60)
        answers[f"{route} {name}"] = {"status": status, "problem": shape_problem(route, status, text)}
    problems = {name: a for name, a in answers.items() if a["problem"]}
    is_alive = target.health()[0] == 200 and target.core_pids() == pids
    return {"passed": not problems and is_alive, "num_sent": len(answers), "core_alive_same_pid": is_alive,
            "problems": problems}
