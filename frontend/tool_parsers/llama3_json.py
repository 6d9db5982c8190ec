"""Llama 3.x JSON tool calls: `<|python_tag|>{"name": ..., "parameters": {...}}; {...}`.

The whole output is the calls or it is content: only when its first visible
characters are "{" or "<|python_tag|>" is it read as JSON objects (each with
"name" and "parameters", or "arguments") separated by ";". Format as in vLLM's
llama_tool_parser.py; the state machine is our own:

    undecided ──"{" or tag──> calls: object ; object ; ... ──anything else──> content
              └─other text──> content (streamed as it comes)

While undecided, leading whitespace and a partial tag are held back. In calls,
each object is held until its closing brace (found with a JsonScanner) and then
emitted whole. A malformed object turns the raw text since the last call into
content, and the rest of the output streams as content.
"""

from __future__ import annotations

import enum
import logging

from frontend.tool_parsers.base import JsonScanner, ToolCallDelta, ToolParser, parse_function_json

logger = logging.getLogger(__name__)

PYTHON_TAG = "<|python_tag|>"
CALL_SEPARATOR = ";"


class _Mode(enum.IntEnum):
    UNDECIDED = 0
    CALLS = 1
    CONTENT = 2


class Llama3JsonToolParser(ToolParser):
    """`--tool-call-parser llama3_json`."""

    def __init__(self):
        super().__init__()
        self._mode = _Mode.UNDECIDED
        self._pending = ""  # raw text since the last call (or the start): content if what follows is malformed
        self._object_start = 0  # where the open object begins in _pending
        self._scanner: JsonScanner | None = None  # set while inside an object
        self._is_expecting_object = True  # after the tag or a ";"; False after an object

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._mode is _Mode.CONTENT:
            return delta_text, []
        if self._mode is _Mode.CALLS:
            return self._scan(delta_text)
        self._pending += delta_text
        head = self._pending.lstrip()
        if head.startswith(PYTHON_TAG):
            rest = head[len(PYTHON_TAG):]
        elif head.startswith("{"):
            rest = head
        elif not head or PYTHON_TAG.startswith(head):
            return "", []  # whitespace or part of the tag: cannot tell yet
        else:
            self._mode = _Mode.CONTENT
            content, self._pending = self._pending, ""
            return content, []
        self._mode = _Mode.CALLS
        self._pending = self._pending[:len(self._pending) - len(rest)]
        return self._scan(rest)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        pending, self._pending = self._pending, ""
        if self._mode is _Mode.CALLS and self._scanner is None and self.has_tool_calls:
            return "", []  # only separators and whitespace after the last call
        if self._mode is _Mode.CALLS:
            logger.warning("malformed llama3 tool call kept as content: %r", pending[:200])
        self._mode = _Mode.CONTENT
        return pending, []

    def _scan(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Read call text character by character; emit each object as it closes."""
        deltas: list[ToolCallDelta] = []
        for i, ch in enumerate(text):
            self._pending += ch
            if self._scanner is not None:
                self._scanner.step(ch)
                if self._scanner.depth > 0:
                    continue
                self._scanner = None
                call = parse_function_json(self._pending[self._object_start:])
                if call is None:
                    return self._give_up(text[i + 1:], deltas)
                deltas.extend(self._emit_call(*call))
                self._pending = ""
                self._is_expecting_object = False
            elif ch.isspace():
                continue
            elif self._is_expecting_object and ch == "{":
                self._scanner = JsonScanner()
                self._scanner.step(ch)
                self._object_start = len(self._pending) - 1
            elif not self._is_expecting_object and ch == CALL_SEPARATOR:
                self._is_expecting_object = True
            else:
                return self._give_up(text[i + 1:], deltas)
        return "", deltas

    def _give_up(self, rest: str, deltas: list[ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
        """Not a call after all: the raw text since the last call and all that follows is content."""
        logger.warning("malformed llama3 tool call kept as content: %r", self._pending[:200])
        self._mode = _Mode.CONTENT
        content, self._pending = self._pending + rest, ""
        return content, deltas
