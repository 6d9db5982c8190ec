"""Tool calling for chat completions: what `tools` and `tool_choice` make of a request, and its answer.

    tool_choice   the template sees   the answer is constrained to          calls come from
    "none"        no tools            (nothing)                             (none)
    "auto"        the tools           (nothing)                             --tool-call-parser
    "required"    the tools           [{"name": one of them, "parameters": its schema}, ...]   the grammar's array
    named         the tools           the named function's parameters schema                    the whole answer

"auto" needs --enable-auto-tool-choice and a --tool-call-parser (vLLM's flags); "required"
and a named function are forced through the grammar, so their arguments always match the
function's schema (`parallel_tool_calls: false` allows one call). No tools and no
tool_choice is plain chat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from frontend.errors import InvalidRequestError
from frontend.tool_parsers import ToolParser, get_tool_parser
from frontend.tool_parsers.forced import ForcedToolCallStream
from ipc.bounded_json import JSONTooDeepError, JSONTooLargeError, loads_bounded
from ipc.structured_outputs import StructuredOutputsParams

MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the grammar always holds arguments to the schema


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolOptions:
    """The server's flags: --enable-auto-tool-choice, --tool-call-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class ToolMode:
    """What one request's `tools` and `tool_choice` come to."""

    kind: Literal["none", "auto", "required", "named"]
    template_tools: list[dict] | None  # for the chat template
    structured_outputs: StructuredOutputsParams | None
    parser_class: type[ToolParser] | None = None  # "auto"
    function_name: str | None = None  # named

    def new_parser(self) -> ToolParser | None:
        """A fresh per-request parser of the answer (None: the answer is plain content)."""
        if self.kind in ("required", "named"):
            return ForcedToolCallStream(self.function_name)
        return self.parser_class() if self.parser_class is not None else None


def resolve_tool_mode(tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
                      parallel_tool_calls: bool | None, options: ToolOptions) -> ToolMode:
    """Raise InvalidRequestError for a tool_choice that cannot be honoured."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return ToolMode("none", None, None)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return ToolMode("none", None, None)
    if choice == "auto":
        if not options.enable_auto_tool_choice or not options.tool_call_parser:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      "to be set on the server")
        return ToolMode("auto", template_tools, None, parser_class=get_tool_parser(options.tool_call_parser))
    if choice == "required":
        schema = _required_schema(tools, max_calls=1 if parallel_tool_calls is False else None)
        return ToolMode("required", template_tools, StructuredOutputsParams(json=schema))
    by_name = {tool.function.name: tool for tool in tools}
    tool = by_name.get(choice.function.name)
    if tool is None:
        raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
    parameters = tool.function.parameters or EMPTY_PARAMETERS
    return ToolMode("named", template_tools, StructuredOutputsParams(json=parameters),
                    function_name=tool.function.name)


def _required_schema(tools: list[ChatTool], max_calls: int | None) -> dict:
    """vLLM's form for "required": an array of calls, each a name and its parameters."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                       "parameters": tool.function.parameters or EMPTY_PARAMETERS},
        "required": ["name", "parameters"],
    } for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI sends a call's arguments as JSON text; chat templates read them as a mapping (as vLLM passes them).
    Arguments over the size or depth limit (ipc.bounded_json) are a 400; text that is not JSON goes as it came."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = loads_bounded(function["arguments"],
                                                          f"messages[{i}].tool_calls[{j}].function.arguments")
                except (JSONTooDeepError, JSONTooLargeError) as e:
                    raise InvalidRequestError(str(e)) from None
                except ValueError:
                    pass  # not JSON: the template gets the text as it came
    return messages
