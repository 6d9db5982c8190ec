"""Fuzz every numeric and id field of every route, and of the local socket's SamplingParams, at the model's bounds.

Each value goes into an otherwise valid, short, greedy request (two tokens, min_tokens 1 so
stop_token_ids are also used as banned ids). An answer passes when it is a sane 2xx or a 4xx
with a clean OpenAI-style error that names the field; on the local socket, exactly one final
output whose error (if any) names the field and shows no exception text. A core that dies is blamed on the value just sent; the field is
then skipped on the other routes (a restart costs tens of seconds) and the run waits for /health.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import msgpack

from hostile_client import EXCEPTION_TEXT, LocalClient, Raw, Target, answer_problem, finals, wire_params

NO_CONTEXT_DEFAULT = ("max_tokens", "max_completion_tokens")  # null there means "up to the context": minutes
HTTP_BASE = {
    "/generate": {"prompt": "Hello", "max_tokens": 2, "min_tokens": 1, "temperature": 0},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "min_tokens": 1, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "min_tokens": 1,
                             "temperature": 0},
}
SAMPLING_FIELDS = {"max_tokens": "int", "min_tokens": "int", "n": "int", "seed": "int", "top_k": "int",
                   "temperature": "float", "top_p": "float", "min_p": "float", "stop_token_ids": "id"}
HTTP_FIELDS = {
    "/generate": {**SAMPLING_FIELDS, "logprobs": "int"},
    "/v1/completions": {**SAMPLING_FIELDS, "logprobs": "int", "best_of": "int", "prompt": "prompt_id",
                        "prompt[[]]": "prompt_id", "presence_penalty": "float", "frequency_penalty": "float"},
    "/v1/chat/completions": {**SAMPLING_FIELDS, "top_logprobs": "int", "max_completion_tokens": "int",
                             "repetition_penalty": "float"},
}
LOCAL_FIELDS = {"temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float", "seed": "int",
                "max_tokens": "int", "min_tokens": "int", "stop_token_ids": "id", "logprobs": "int",
                "prompt_token_ids": "prompt_id"}


def int_values(vocab: int, max_len: int, quick: bool) -> list:
    if quick:
        return [vocab, max_len + 1, 2**31 - 1, 2**31, 2**63, 2**64, -1, 0, 1.5, "1", None]
    return [vocab - 1, vocab, max_len, max_len + 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -1, 0,
            -2**31 - 1, -2**63, -2**63 - 1, 1.5, 1e308, Raw("NaN"), Raw("Infinity"), "1", True, None, [], {}]


def float_values(quick: bool) -> list:
    if quick:
        return [1e-40, 5e-324, 1e308, -1.0, 2**64, Raw("1e400"), Raw("NaN"), Raw("-Infinity"), "x", None]
    return [0.0, -0.0, 1e-40, 5e-324, 1e308, -1e308, -1.0, 1.5, 1e40, 2**31, 2**63, 2**64, -1, Raw("1e400"),
            Raw("-1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), "0.5", True, None, [], {}]


def values_for(kind: str, vocab: int, max_len: int, quick: bool) -> list:
    if kind == "float":
        return float_values(quick)
    values = int_values(vocab, max_len, quick)
    return [v for v in values if kind == "int" or not isinstance(v, (list, dict))]  # ids are list entries


def http_body(route: str, name: str, kind: str, value) -> dict:
    body = dict(HTTP_BASE[route])
    if name == "prompt":
        body["prompt"] = [1, value]
    elif name == "prompt[[]]":
        body["prompt"] = [[value]]
    elif kind == "id":
        body[name] = [value]
    elif name == "top_logprobs":
        body.update(logprobs=True, top_logprobs=value)
    elif name == "max_completion_tokens":
        body.pop("max_tokens")
        body[name] = value
    else:
        body[name] = value
    return body


# Words a 4xx message about the field may use instead of its own name.
FIELD_WORDS = {"max_completion_tokens": ("max_tokens",), "top_logprobs": ("logprobs",), "prompt[[]]": ("prompt",),
               "prompt_token_ids": ("prompt",), "presence_penalty": ("presence",),
               "frequency_penalty": ("frequency",), "repetition_penalty": ("repetition",)}
GENERAL_REASONS = ("context length", "not valid JSON")  # a message about the whole request or body is fine


def misleading(name: str, message: str) -> str | None:
    """A rejection that does not say which field is wrong (e.g. max_tokens 2**64: 'cannot encode int')."""
    words = (name, *FIELD_WORDS.get(name, ()), *GENERAL_REASONS)
    return None if any(w.lower() in message.lower() for w in words) else f"rejected without naming {name}: {message!r}"


def to_wire(value):
    """The value as msgpack can carry it (NaN and inf are real floats there), or None when it cannot."""
    if isinstance(value, Raw):
        value = float(str(value).replace("Infinity", "inf"))
    try:
        msgpack.packb(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return value


def local_problem(local: LocalClient, request_id: str, name: str, kind: str, value) -> str | None:
    if kind == "prompt_id":
        local.generate(request_id, token_ids=[1, value])
    else:
        local.generate(request_id, params=wire_params(**{name: [value] if kind == "id" else value}))
    outputs = local.collect([request_id], timeout_s=30, linger_s=0.2)[request_id]
    ends = finals(outputs)
    if len(ends) != 1:
        return f"{len(ends)} final outputs (want 1): {ends[:3]}"
    reason, error = ends[0]
    if reason == "error" and (not error or EXCEPTION_TEXT.search(error) or error.startswith("internal error")):
        return f"error final shows internals: {error!r}"
    return misleading(name, error) if reason == "error" else None


def show(value) -> str | int | float:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2**53 \
        else repr(value)


def run_fuzz(target: Target, quick: bool, budget_s: float) -> dict:
    """Send every (route, field, value); return counts, the problems and which values killed the core."""
    vocab, max_len = target.vocab_size, target.max_model_len
    # --quick: the shared sampling fields on /v1/completions only; the other routes get their own fields.
    plan = [(route, name, kind, v) for route, fields in HTTP_FIELDS.items() for name, kind in fields.items()
            if not (quick and route != "/v1/completions" and name in SAMPLING_FIELDS)
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
                problem = answer_problem(route, status, text)
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
