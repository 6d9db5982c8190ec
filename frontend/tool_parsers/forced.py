"""Tool calls whose shape a grammar forces (tool_choice "required" or a named function), streamed piece by piece.

Because the output's shape is known, the arguments can stream as they are
generated instead of once each call is whole:

- named function: the whole output IS the arguments object. The first text
  emits the call's head (id, name); then every piece is argument text. Leading
  and trailing whitespace is left out, so the arguments equal `text.strip()`.
- required: the output is vLLM's array `[{"name": "f", "parameters": {...}}, ...]`.
  A character scanner follows the keys of each element object: when the
  "name" string closes, the element's head goes out; then the characters of
  the "parameters" value (its own, not the whitespace or commas around it)
  stream as argument pieces until the value ends.

`parse_forced_tool_calls` gives the non-streamed answer by running the same
scanner, so both answers carry the same argument text byte for byte.
"""

from __future__ import annotations

import json
import logging

from frontend.tool_parsers.base import (ARGUMENT_KEYS, MODEL_TEXT_MAX_BYTES, JsonScanner, ToolCall, ToolCallDelta,
                                        ToolParser, calls_from_deltas)
from ipc.bounded_json import loads_bounded

logger = logging.getLogger(__name__)

ELEMENT_DEPTH = 2  # inside `[` then `{`: where an element's keys live


class ForcedToolCallStream(ToolParser):
    """Streams the calls of a grammar-forced output; `function_name=None` means tool_choice "required"."""

    def __init__(self, function_name: str | None = None):
        super().__init__()
        self.function_name = function_name
        self._held_space = ""  # named mode: whitespace that is argument text only if more text follows
        self._scanner = JsonScanner()
        self._reset_element()

    def fresh(self) -> ForcedToolCallStream:
        return ForcedToolCallStream(self.function_name)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, parse_forced_tool_calls(text, self.function_name)

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.function_name is not None:
            return "", self._feed_named(delta_text)
        deltas: list[ToolCallDelta] = []
        for ch in delta_text:
            self._step(ch, deltas)
        self._flush_arguments(deltas)
        return "", deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._held_space = ""  # trailing whitespace is not part of the arguments
        return "", []

    def _feed_named(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if not text:
            return deltas
        if not self.has_tool_calls:
            deltas.append(self._start_call(self.function_name))
        if not self._arguments_started:
            text = text.lstrip()
            self._arguments_started = bool(text)
        visible = text.rstrip()
        if visible:
            deltas.append(ToolCallDelta(0, None, None, self._held_space + visible))
            self._held_space = ""
        self._held_space += text[len(visible):]
        return deltas

    def _reset_element(self) -> None:
        self._key_text = ""  # the raw key string being read, then the last key read
        self._is_reading_key = False
        self._value_key: str | None = None  # the key whose value is being read, None between values
        self._value_opener = ""
        self._name_text = ""
        self._head: ToolCallDelta | None = None
        self._arguments_piece = ""  # argument characters not yet emitted
        self._has_arguments = False
        self._arguments_started = False

    def _step(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        """One character of the array; element keys are read at ELEMENT_DEPTH."""
        depth = self._scanner.depth
        if self._value_key is not None:
            if self._value_opener and self._value_opener not in '{["' and (ch in ",}]" or ch.isspace()):
                self._flush_arguments(deltas)
                self._value_key = None  # a number, true, false or null ended before this character
            else:
                self._step_value(ch, deltas)
                return
        self._scanner.step(ch)
        if depth != ELEMENT_DEPTH:
            if depth == ELEMENT_DEPTH - 1 and ch == "{":
                self._reset_element()
            return
        if self._is_reading_key:
            self._key_text += ch
            self._is_reading_key = self._scanner.in_string
        elif ch == '"':
            self._key_text, self._is_reading_key = ch, True
        elif ch == ":":
            self._value_key = json.loads(self._key_text) if self._key_text else ""
            self._value_opener = ""
        elif ch == "}":
            self._end_element(deltas)

    def _step_value(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        """One character of an element's value: the name, the arguments, or one to skip."""
        if not self._value_opener:
            if ch.isspace():
                return
            self._value_opener = ch
        self._scanner.step(ch)
        # A string or container ends with its closing character; a scalar ends before a delimiter (see _step).
        is_done = (self._value_opener in '{["' and self._scanner.depth == ELEMENT_DEPTH
                   and not self._scanner.in_string)
        if self._value_key == "name" and self._value_opener == '"':
            self._name_text += ch
            if is_done and self._head is None:
                self._head = self._start_call(json.loads(self._name_text))
                deltas.append(self._head)
        elif self._value_key in ARGUMENT_KEYS:
            self._arguments_piece += ch
            self._has_arguments = True
        if is_done:
            self._flush_arguments(deltas)
            self._value_key = None

    def _flush_arguments(self, deltas: list[ToolCallDelta]) -> None:
        """Emit the argument characters read so far, once the call has its head."""
        if self._head is not None and self._arguments_piece:
            deltas.append(ToolCallDelta(self._head.index, None, None, self._arguments_piece))
            self._arguments_piece = ""

    def _end_element(self, deltas: list[ToolCallDelta]) -> None:
        if self._head is None:
            logger.warning("forced tool call without a name dropped")
        elif not self._has_arguments:
            deltas.append(ToolCallDelta(self._head.index, None, None, "{}"))
        self._reset_element()


def parse_forced_tool_calls(text: str, function_name: str | None) -> list[ToolCall]:
    """The calls of a whole grammar-forced output (see the module docstring for both shapes)."""
    stream = ForcedToolCallStream(function_name)
    _, deltas = stream.feed(text)
    _, more = stream.finish()
    if function_name is None:
        try:
            loads_bounded(text, "forced tool calls", max_bytes=MODEL_TEXT_MAX_BYTES)
        except ValueError:
            logger.warning("forced tool calls are not a whole JSON array (cut short?): %r", text[-200:])
    return calls_from_deltas(deltas + more)
