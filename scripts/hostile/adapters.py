"""The hostile case for the Responses (/v1/responses) and Messages (/v1/messages) adapters: bad bodies.

Each body must get a 400 in its API's own error shape (OpenAI's {"error": {...}}, Anthropic's
{"type": "error", "error": {"type": "invalid_request_error", ...}}) with a message free of
exception text, and no core may die. Their numeric fields are in the field fuzzer (scripts/hostile/fuzz.py).
"""

from __future__ import annotations

import json

from scripts.hostile.client import Target, error_problem

LONG_TEXT = "hello " * 10_000  # over the default model's context length
USER = {"role": "user", "content": "hi"}
RESPONSES_BODIES = {
    "empty_input": {"input": ""},
    "empty_input_list": {"input": []},
    "input_over_context": {"input": LONG_TEXT},
    "10000_inputs": {"input": [USER] * 10_000},
    "unknown_item_type": {"input": [{"type": "computer_call", "id": "x"}]},
    "unknown_call_id": {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
    "malformed_content_part": {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    "image_content_part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "file_content_part": {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
    "item_not_an_object": {"input": ["hi"]},
    "unknown_previous_response_id": {"input": "hi", "previous_response_id": "resp_nope"},
    "built_in_tool": {"input": "hi", "tools": [{"type": "web_search"}]},
    "background": {"input": "hi", "background": True},
}
MESSAGES_BODIES = {
    "empty_messages": {"messages": []},
    "message_over_context": {"messages": [{"role": "user", "content": LONG_TEXT}]},
    "10000_messages": {"messages": [USER] * 10_000},
    "unknown_block_type": {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
    "unknown_tool_use_id": {"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                                        "tool_use_id": "toolu_nope"}]}]},
    "malformed_text_block": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "block_not_an_object": {"messages": [{"role": "user", "content": ["hi"]}]},
    "malformed_tool_use": {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": 5}]}]},
    "no_max_tokens": {"messages": [USER], "max_tokens": None},
    "thinking": {"messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 1024}},
}


def shape_problem(route: str, status: int, text: str) -> str | None:
    """What is wrong with a 400 in the route's error shape, or None."""
    if status != 400:
        return f"status {status}, not 400: {text[:200]!r}"
    problem = error_problem(status, text)
    if problem is not None or route != "/v1/messages":
        return problem
    body = json.loads(text)
    if body.get("type") != "error" or body["error"].get("type") != "invalid_request_error":
        return f"not Anthropic's error shape: {text[:200]!r}"
    return None


def adapter_bad_input(target: Target) -> dict:
    pids = target.core_pids()
    answers = {}
    for route, base, bodies in (("/v1/responses", {"max_output_tokens": 2, "store": False}, RESPONSES_BODIES),
                                ("/v1/messages", {"max_tokens": 2}, MESSAGES_BODIES)):
        for name, body in bodies.items():
            status, text, _ = target.post(route, {**base, **body}, timeout=60)
            answers[f"{route} {name}"] = {"status": status, "problem": shape_problem(route, status, text)}
    problems = {name: a for name, a in answers.items() if a["problem"]}
    is_alive = target.health()[0] == 200 and target.core_pids() == pids
    return {"passed": not problems and is_alive, "num_sent": len(answers), "core_alive_same_pid": is_alive,
            "problems": problems}
