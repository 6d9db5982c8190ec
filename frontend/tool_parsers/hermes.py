"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.

The model may write text before the first block and may write several blocks
(Qwen2.5 puts a newline between them). Format as in vLLM's
hermes_tool_parser.py; the state machine is our own:

    text ──"<tool_call>"──> block ──"</tool_call>"──> text ...

Outside a block, a tail that could begin "<tool_call>" is held back. A block is
held whole and parsed when it closes: a valid one becomes a call (its arguments
re-serialized with json.dumps, ensure_ascii=False), a malformed one is streamed
back as content, markers included. Whitespace right after a call is dropped, so
the newlines between blocks do not show up as content. An unclosed block at the
end is a call if its JSON parses.
"""

from __future__ import annotations

import logging

from frontend.tool_parsers.base import ToolCallDelta, ToolParser, parse_function_json
from ipc.text.hold_back import num_held_chars

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """`--tool-call-parser hermes`."""

    def __init__(self):
        super().__init__()
        self._held_text = ""  # outside a block: a possible start-marker tail; inside: the block's body so far
        self._is_in_block = False
        self._is_after_call = False  # drop whitespace until the next visible character

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        text = self._held_text + delta_text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._is_in_block:
                end = text.find(TOOL_CALL_END)
                if end == -1:
                    break
                self._close_block(text[:end], TOOL_CALL_END, content, deltas)
                text = text[end + len(TOOL_CALL_END):]
                self._is_in_block = False
            else:
                start = text.find(TOOL_CALL_START)
                if start == -1:
                    cut = len(text) - num_held_chars(text, (TOOL_CALL_START,))
                    content.append(self._visible(text[:cut]))
                    text = text[cut:]
                    break
                content.append(self._visible(text[:start]))
                text = text[start + len(TOOL_CALL_START):]
                self._is_in_block = True
        self._held_text = text
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text, self._held_text = self._held_text, ""
        if not self._is_in_block:
            return self._visible(text), []  # a partial start marker is plain text after all
        self._is_in_block = False
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        # An unclosed block (the output was cut short), maybe ending in part of "</tool_call>".
        body = text[:len(text) - num_held_chars(text, (TOOL_CALL_END,))]
        if parse_function_json(body.strip()) is not None:
            self._close_block(body, "", content, deltas)
        else:
            self._close_block(text, "", content, deltas)
        return "".join(content), deltas

    def _close_block(self, body: str, end_marker: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        """A whole block's body: a call if its JSON is a function call, else content as written."""
        call = parse_function_json(body.strip())
        if call is None:
            logger.warning("malformed tool call kept as content: %r", body[:200])
            content.append(self._visible(TOOL_CALL_START + body + end_marker))
            return
        deltas.extend(self._emit_call(*call))
        self._is_after_call = True

    def _visible(self, text: str) -> str:
        """Content text, less the whitespace that directly follows a call."""
        if self._is_after_call:
            text = text.lstrip()
            self._is_after_call = not text
        return text
