"""Fuzz every numeric and id field of every route, and of the local socket's SamplingParams, at the model's bounds.

Each value goes into an otherwise valid, short, greedy request (two tokens, min_tokens 1 so
stop_token_ids are also used as banned ids). An answer passes when it is a sane 2xx (no
finish_reason outside OpenAI's) or a 4xx with a clean OpenAI-style error that names the field;
on the local socket, exactly one final output whose error (if any) names the field and shows no
exception text. A core that dies is blamed on the value just sent; the field is then skipped on
the other routes (a restart costs tens of seconds) and the run waits for /health.

The newer fields get values of their own kind: penalties, logit_bias keys, values and sizes,
allowed_token_ids (ids, and one past the wire's length cap), bad_words, prompt_logprobs, and
malformed, huge or contradictory schemas, regexes, grammars, choices, response_format, tools and
tool_choice; /v1/embeddings' input (empty, 10,000 items, over the context, mixed kinds), its
token ids, dimensions and encoding_format. A dotted name is a path into the body (see http_body).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import msgpack

from scripts.hostile.field_values import TOOL, Big, values_for
from scripts.hostile.client import EXCEPTION_TEXT, LocalClient, Raw, Target, answer_problem, finals, wire_params

OPENAI_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call", None}

NO_CONTEXT_DEFAULT = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # null there means "up to the context": minutes
HTTP_BASE = {
    "/generate": {"prompt": "Hello", "max_tokens": 2, "min_tokens": 1, "temperature": 0},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "min_tokens": 1, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "min_tokens": 1,
                             "temperature": 0},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 2, "temperature": 0, "store": False},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0},
    "/v1/embeddings": {"input": "Hello"},
}
SAMPLING_FIELDS = {"max_tokens": "int", "min_tokens": "int", "n": "int", "seed": "int", "top_k": "int",
                   "temperature": "float", "top_p": "float", "min_p": "float", "stop_token_ids": "id"}
# Shared by every route like SAMPLING_FIELDS (--quick: on /v1/completions only).
NEW_SAMPLING_FIELDS = {"repetition_penalty": "float", "presence_penalty": "float", "frequency_penalty": "float",
                       "logit_bias": "bias", "logit_bias{}": "float", "allowed_token_ids": "id",
                       "allowed_token_ids[]": "id_count", "bad_words": "words", "prompt_logprobs": "int"}
STRUCTURED_FIELDS = {"structured_outputs.regex": "regex", "structured_outputs.grammar": "grammar",
                     "structured_outputs.choice": "choices", "structured_outputs.json": "schema",
                     "structured_outputs": "structured", "guided_regex": "regex", "guided_grammar": "grammar",
                     "guided_choice": "choices", "guided_json": "schema"}
CHAT_FIELDS = {"response_format": "format", "response_format.json_schema.schema": "schema",
               "tools[].parameters": "schema", "tools": "tools", "tool_choice": "tool_choice"}
HTTP_FIELDS = {
    "/generate": {**SAMPLING_FIELDS, "logprobs": "int", **NEW_SAMPLING_FIELDS, "structured_outputs.regex": "regex"},
    "/v1/completions": {**SAMPLING_FIELDS, "logprobs": "int", "best_of": "int", "prompt": "prompt_id",
                        "prompt[[]]": "prompt_id", **NEW_SAMPLING_FIELDS, **STRUCTURED_FIELDS,
                        "prediction": "prediction"},
    "/v1/chat/completions": {**SAMPLING_FIELDS, "top_logprobs": "int", "max_completion_tokens": "int",
                             **NEW_SAMPLING_FIELDS, **CHAT_FIELDS, "prediction": "prediction"},
    # The adapters' own fields (their bad bodies: scripts/hostile/adapters.py).
    "/v1/responses": {"max_output_tokens": "int", "temperature": "float", "top_p": "float", "seed": "int",
                      "text.format": "format", "tools": "tools", "tool_choice": "tool_choice"},
    "/v1/messages": {"max_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int",
                     "stop_sequences": "words", "tools": "tools", "tool_choice": "tool_choice"},
    "/v1/embeddings": {"input": "embedding_input", "input[]": "prompt_id", "input[[]]": "prompt_id", "dimensions": "int",
                       "encoding_format": "encoding"},
}
QUICK_COMPLETIONS_ONLY = {*SAMPLING_FIELDS, *NEW_SAMPLING_FIELDS, "structured_outputs.regex"}
LOCAL_FIELDS = {"temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float", "seed": "int",
                "max_tokens": "int", "min_tokens": "int", "stop_token_ids": "id", "logprobs": "int",
                "prompt_token_ids": "prompt_id", "repetition_penalty": "float", "presence_penalty": "float",
                "logit_bias": "bias_pairs", "allowed_token_ids": "id", "bad_words_token_ids": "id_lists",
                "prompt_logprobs": "int", "structured_outputs": "wire_structured", "prediction_token_ids": "id"}
# SamplingParams' fields appended after hostile_client.WIRE_FIELDS, in wire order, with their defaults.
NEW_WIRE_FIELDS = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                   ("logit_bias", []), ("allowed_token_ids", None), ("bad_words", []), ("bad_words_token_ids", []),
                   ("prompt_logprobs", None), ("structured_outputs", None), ("prediction_token_ids", None))
# Each adapter's own tool shape and its "required" tool_choice.
ROUTE_TOOLS = {"/v1/responses": ({"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]},
                                 "required"),
               "/v1/messages": ({"name": "f", "input_schema": TOOL["function"]["parameters"]}, {"type": "any"})}


def http_body(route: str, name: str, kind: str, value) -> dict:
    body = dict(HTTP_BASE[route])
    value = value.value if isinstance(value, Big) else value
    if name == "prompt":
        body["prompt"] = [1, value]
    elif name == "prompt[[]]":
        body["prompt"] = [[value]]
    elif name == "input[]":
        body["input"] = [1, value]
    elif name == "input[[]]":
        body["input"] = [[1], [value]]
    elif kind == "id":
        body[name] = [value]
    elif name == "top_logprobs":
        body.update(logprobs=True, top_logprobs=value)
    elif name == "max_completion_tokens":
        body.pop("max_tokens")
        body[name] = value
    elif name == "logit_bias{}":
        body["logit_bias"] = {"5": value}
    elif name == "allowed_token_ids[]":
        body["allowed_token_ids"] = [0] * value
    elif name == "response_format.json_schema.schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": value}}
    elif name == "tools[].parameters":
        body.update(tools=[{"type": "function", "function": {"name": "f", "parameters": value}}],
                    tool_choice="required")
    elif name == "tools":
        body.update(tools=value, tool_choice=ROUTE_TOOLS.get(route, (TOOL, "required"))[1])
    elif name == "tool_choice":
        body.update(tools=[ROUTE_TOOLS.get(route, (TOOL,))[0]], tool_choice=value)
    elif "." in name:
        outer, inner = name.split(".", 1)
        body[outer] = {inner: value}
    else:
        body[name] = value
    return body


# Words a 4xx message about the field may use instead of its own name.
FIELD_WORDS = {"max_completion_tokens": ("max_tokens",), "max_output_tokens": ("max_tokens",),
               "stop_sequences": ("stop",), "text.format": ("response_format", "text.format"), "top_logprobs": ("logprobs",), "prompt[[]]": ("prompt",),
               "prompt_token_ids": ("prompt",), "presence_penalty": ("presence",),
               "frequency_penalty": ("frequency",), "repetition_penalty": ("repetition",),
               "logit_bias{}": ("logit_bias",), "allowed_token_ids[]": ("allowed_token_ids",),
               "bad_words": ("bad word",), "bad_words_token_ids": ("bad word", "bad_words"),
               "structured_outputs.choice": ("choice",), "guided_choice": ("choice",),
               "tools[].parameters": ("parameters",), "tools": ("tool",), "tool_choice": ("tool choice",),
               "input[]": ("input", "prompt"), "input[[]]": ("input", "prompt"),
               "prediction_token_ids": ("prediction",)}
# Every structured-output form may be named as such ("structured output (regex) is not usable: ...").
STRUCTURED_WORDS = ("structured output", "structured_outputs", "response_format")
GENERAL_REASONS = ("context length", "not valid JSON")  # a message about the whole request or body is fine


def misleading(name: str, message: str) -> str | None:
    """A rejection that does not say which field is wrong (e.g. max_tokens 2**64: 'cannot encode int')."""
    words = (name, *FIELD_WORDS.get(name, ()), *GENERAL_REASONS)
    if name in STRUCTURED_FIELDS or name in CHAT_FIELDS or name == "text.format":
        words += STRUCTURED_WORDS
    return None if any(w.lower() in message.lower() for w in words) else f"rejected without naming {name}: {message!r}"


def to_wire(value):
    """The value as msgpack can carry it (NaN and inf are real floats there), or None when it cannot."""
    if isinstance(value, Big):
        return value if to_wire(value.value) is not None else None
    if isinstance(value, Raw):
        value = float(str(value).replace("Infinity", "inf"))
    try:
        msgpack.packb(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return value


def full_wire_params(**overrides) -> list:
    """hostile_client.wire_params with SamplingParams' appended fields too."""
    appended = [overrides.pop(name, default) for name, default in NEW_WIRE_FIELDS]
    return wire_params(**overrides) + appended


def local_problem(local: LocalClient, request_id: str, name: str, kind: str, value) -> str | None:
    value = value.value if isinstance(value, Big) else value
    if kind == "prompt_id":
        local.generate(request_id, token_ids=[1, value])
    else:
        local.generate(request_id, params=full_wire_params(**{name: [value] if kind == "id" else value}))
    outputs = local.collect([request_id], timeout_s=30, linger_s=0.2)[request_id]
    ends = finals(outputs)
    if len(ends) != 1:
        return f"{len(ends)} final outputs (want 1): {ends[:3]}"
    reason, error = ends[0]
    if reason == "error" and (not error or EXCEPTION_TEXT.search(error) or error.startswith("internal error")):
        return f"error final shows internals: {error!r}"
    return misleading(name, error) if reason == "error" else None


def odd_finish(route: str, status: int, text: str) -> str | None:
    """A 200 whose finish_reason is none of OpenAI's (e.g. "error", with no message saying why)."""
    if status != 200 or route not in ("/v1/completions", "/v1/chat/completions"):
        return None
    reasons = {c.get("finish_reason") for c in json.loads(text)["choices"]}
    return None if reasons <= OPENAI_FINISH_REASONS else f"200 with finish_reason {sorted(map(str, reasons))}"


def show(value) -> str | int | float:
    if isinstance(value, Big):
        return value.label
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2**53 \
        else repr(value)


def run_fuzz(target: Target, quick: bool, budget_s: float) -> dict:
    """Send every (route, field, value); return counts, the problems and which values killed the core."""
    vocab, max_len = target.vocab_size, target.max_model_len
    # --quick: the shared sampling fields on /v1/completions only; the other routes get their own fields.
    plan = [(route, name, kind, v) for route, fields in HTTP_FIELDS.items() for name, kind in fields.items()
            if not (quick and route != "/v1/completions" and name in QUICK_COMPLETIONS_ONLY)
            for v in values_for(kind, vocab, max_len, quick) if not (v is None and name in NO_CONTEXT_DEFAULT)]
    if target.client_socket:
        plan += [("local", name, kind, w) for name, kind in LOCAL_FIELDS.items()
                 for v in values_for(kind, vocab, max_len, quick)
                 if (w := to_wire(v)) is not None or v is None
                 if not (v is None and name in NO_CONTEXT_DEFAULT)]
    problems, core_deaths, killer_fields = [], [], set()
    num_sent, num_skipped = 0, 0
    deadline = time.monotonic() + budget_s
    pids = target.core_pids()
    local = LocalClient(target.client_socket) if target.client_socket else None
    try:
        for i, (route, name, kind, value) in enumerate(plan):
            if name in killer_fields or time.monotonic() > deadline:
                num_skipped += 1
                continue
            if route == "local":
                problem = local_problem(local, f"fuzz-{i}", name, kind, value)
            else:
                status, text, _ = target.post(route, http_body(route, name, kind, value))
                problem = answer_problem(route, status, text) or odd_finish(route, status, text)
                if problem is None and 400 <= status < 500:
                    problem = misleading(name, json.loads(text)["error"]["message"])
            num_sent += 1
            where = {"route": route, "field": name, "value": show(value)}
            if problem:
                problems.append({**where, "problem": problem})
            now_pids = target.core_pids()
            if now_pids != pids or (problem and target.health()[0] != 200):
                killer_fields.add(name)
                back_s = target.wait_healthy(120)
                core_deaths.append({**where, "service_back_after_s": None if back_s is None else round(back_s, 1)})
                pids = target.core_pids()
    finally:
        if local is not None:
            local.__exit__()
    return {
        "passed": not problems and not core_deaths,
        "num_sent": num_sent,
        "num_skipped": num_skipped,  # fields that already killed the core, or past the time budget
        "num_problems": len(problems),
        "problems_by_field": dict(Counter(f"{p['route']} {p['field']}" for p in problems)),
        "core_deaths": core_deaths,
        "problems": problems[:40],
    }
