"""What every tool-call parser shares: the call records, the streaming contract, small text helpers.

A parser turns a chat model's output text into OpenAI tool calls, either all at
once (`extract`, for a non-streamed answer) or delta by delta (`feed`/`finish`,
for SSE chunks). Both paths run the same state machine: `extract` feeds the
whole text to a fresh instance, so a streamed answer and a non-streamed one can
never disagree, however the text was split into deltas.

A tool call that has been streamed is never retracted. So when a later call
turns out malformed, the calls before it stand and only the malformed text (and
what follows) becomes content. When the first one is malformed, the whole text
stays content, as vLLM does.
"""

from __future__ import annotations

import json
import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ipc.bounded_json import loads_bounded

logger = logging.getLogger(__name__)

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes writes "arguments", Llama 3 "parameters"
# An answer is bounded by its tokens already; its JSON is parsed bounded for the depth (a deep
# answer, under a grammar that allows nesting, would otherwise raise RecursionError).
MODEL_TEXT_MAX_BYTES = 64 << 20


def make_tool_call_id() -> str:
    """A fresh id in vLLM's form, "chatcmpl-tool-<32 hex digits>"."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is a JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The entry of a non-streamed message's "tool_calls" list."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries id and name, later ones argument text."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict:
        """The entry of a chunk's "delta.tool_calls" list."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One entry per call in a chunk, as OpenAI sends: a call's head and its argument pieces
    that arrive in the same chunk become one delta (clients merge by index, but some take
    only the first entry of an index per chunk)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.id is None:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged


def calls_from_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Join streamed deltas back into whole calls, in index order."""
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            heads[delta.index] = delta
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(heads[i].id, heads[i].name or "", "".join(arguments[i])) for i in sorted(heads)]


class ToolParser(ABC):
    """One request's parser: feed it text deltas, then finish; or call `extract` on a whole text."""

    def __init__(self):
        self.num_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        """Whether any call was emitted (after `finish`: set finish_reason "tool_calls")."""
        return self.num_calls > 0

    @abstractmethod
    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Return (content text to stream now, tool-call deltas); text that may start a call is held back."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush what was held back at the end of the output."""

    def fresh(self) -> ToolParser:
        """A new instance with the same settings and no stream state."""
        return type(self)()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content left over, or None if empty; the calls)."""
        parser = self.fresh()
        content, deltas = parser.feed(text)
        tail, more = parser.finish()
        return (content + tail) or None, calls_from_deltas(deltas + more)

    def _start_call(self, name: str) -> ToolCallDelta:
        """The first delta of a new call, with a new id and an empty arguments text."""
        delta = ToolCallDelta(self.num_calls, make_tool_call_id(), name, "")
        self.num_calls += 1
        logger.debug("tool call %d: %s", delta.index, name)
        return delta

    def _emit_call(self, name: str, arguments: str) -> list[ToolCallDelta]:
        """The deltas of a call known whole: its head, then its arguments in one piece."""
        head = self._start_call(name)
        return [head, ToolCallDelta(head.index, None, None, arguments)]


def parse_function_json(text: str) -> tuple[str, str] | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> (name, arguments JSON text), or None if malformed."""
    try:
        obj = loads_bounded(text, "a tool call", max_bytes=MODEL_TEXT_MAX_BYTES)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in ARGUMENT_KEYS if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = loads_bounded(arguments, "a tool call's arguments", max_bytes=MODEL_TEXT_MAX_BYTES)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class JsonScanner:
    """Where a stream of JSON characters stands: inside a string or not, and how deeply nested.

    Enough to tell when an object or array closes without parsing it; bracket kinds are not
    matched (json.loads checks the finished text).
    """

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self._is_escaped = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self._is_escaped:
                self._is_escaped = False
            elif ch == "\\":
                self._is_escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
