"""OpenAI tool-call parsing for chat completions, by name as vLLM's `--tool-call-parser` takes it.

Pure Python and stdlib json (the frontend never imports torch). Each parser is
made once per request and streams (`feed`/`finish`) or parses a whole output
(`extract`); see `base.py` for the contract, `forced.py` for tool_choice
"required" or a named function, where a grammar fixes the output's shape.
"""

from __future__ import annotations

from frontend.tool_parsers.base import (ToolCall, ToolCallDelta, ToolParser, calls_from_deltas, merge_call_deltas,
                                        make_tool_call_id)
from frontend.tool_parsers.forced import ForcedToolCallStream, parse_forced_tool_calls
from frontend.tool_parsers.hermes import HermesToolParser
from frontend.tool_parsers.llama3_json import Llama3JsonToolParser

_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
TOOL_PARSER_NAMES = tuple(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; make one instance per request."""
    try:
        return _TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSER_NAMES)}") from None


__all__ = ["TOOL_PARSER_NAMES", "ForcedToolCallStream", "HermesToolParser", "Llama3JsonToolParser", "ToolCall",
           "ToolCallDelta", "ToolParser", "calls_from_deltas", "get_tool_parser", "make_tool_call_id",
           "merge_call_deltas", "parse_forced_tool_calls"]
