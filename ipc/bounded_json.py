"""The one parse of JSON text a client sends inside a request: bounded in size and in depth.

A client puts JSON text in string fields (tool call arguments, `guided_json`, a schema, a
speculative config): `json.loads` on it is a recursion in C that stops with RecursionError
past about a thousand levels, which no `except ValueError` catches, so
`"[" * 50000 + "]" * 50000` turned into a plain-text 500. Here every failure is a
`ValueError` naming the field, which the frontend answers with a 400 in its route's shape:

    too long       over `max_bytes` (UTF-8 bytes)                 JSONTooLargeError
    too deep       arrays and objects nested over `max_depth`     JSONTooDeepError
    not JSON       anything json.loads refuses                    ValueError (json.JSONDecodeError)

The depth is counted before parsing, in one linear pass in C over the text with its string
literals taken out, so a deep text costs no recursion at all. The HTTP body itself is parsed by jiter
(frontend.api_server.read_body), which refuses nesting over 200 levels on its own.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 128  # a 60-level JSON schema is 121 deep; real arguments and schemas stay far below
MAX_JSON_BYTES = 1 << 20  # the default --max-request-bytes: no client string is longer than its body

# A JSON string literal, escapes included (unrolled: no alternation per character); what is left
# once they are gone holds the brackets that nest.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONTooLargeError(ValueError):
    """The text is over the size limit."""


class JSONTooDeepError(ValueError):
    """The text nests arrays and objects deeper than the limit."""


def loads_bounded(text: str | bytes, what: str, *, max_depth: int = MAX_JSON_DEPTH,
                  max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`json.loads(text)`, or a ValueError whose message starts with `what` (the field's name)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    check_bounds(text, what, max_depth=max_depth, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except RecursionError:  # unreachable past the depth check; kept so that no text can make a 500
        raise JSONTooDeepError(f"{what} nests arrays and objects too deeply") from None
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def check_bounds(text: str, what: str, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES) -> None:
    """Raise JSONTooLargeError or JSONTooDeepError (naming `what`) for text over the limits,
    without parsing it (for JSON text built from an already parsed value)."""
    # A character is 1-4 bytes: encode to count only when the count could be over.
    num_bytes = len(text) if len(text) * 4 <= max_bytes else len(text.encode("utf-8", "surrogatepass"))
    if num_bytes > max_bytes:
        raise JSONTooLargeError(f"{what} is {num_bytes} bytes of JSON, over the limit of {max_bytes}")
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONTooDeepError(f"{what} nests arrays and objects {depth} levels deep, over the limit of {max_depth}")


def nesting_depth(text: str) -> int:
    """How deep the text's arrays and objects nest (0 for a scalar), counting only brackets
    outside string literals; for text that is not JSON, an upper bound of its depth.
    Linear and in C throughout (regex, map, accumulate): about 60 ms for 1 MB of brackets."""
    brackets = _NOT_BRACKETS.sub("", _STRING.sub("", text))
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))
