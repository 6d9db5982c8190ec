"""`POST /v1/responses` (OpenAI's Responses API): the body, and its translation into a chat request.

The adapter owns no sampling, template, tool or grammar logic: `to_chat_request` maps the
body onto a ChatCompletionRequest, and frontend.chat_run does the rest as for
/v1/chat/completions. Input items become chat messages:

    {"role": r, "content": ...} / {"type": "message", ...}   a message (developer -> system)
    {"type": "function_call", call_id, name, arguments}      an assistant tool call
    {"type": "function_call_output", call_id, output}        a tool message; an unknown call_id is a 400
    {"type": "reasoning", ...}                                dropped (chat templates drop old reasoning)

Reference: https://platform.openai.com/docs/api-reference/responses/create
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from frontend.chat_tools import ChatTool
from frontend.errors import InvalidRequestError
from frontend.protocol import ChatCompletionRequest, JsonSchemaFormat, chat_request_from
from frontend.request_fields import check_extra_fields
from ipc.bounded_json import check_bounds

MAX_INPUT_ITEMS = 4096  # far more turns than a context holds; bounds the work before tokenizing
# OpenAI's bounds on `metadata`: stored and echoed with the response, so they bound its memory too.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PART_TYPES = ("input_text", "output_text", "text")
# field -> its "off" values; anything else is a 400 naming it (docs/request_fields.md).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "include": (None, []),
    "reasoning": (None,),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None,),
    "context_management": (None,),
}


class TextFormat(JsonSchemaFormat):
    """`text.format`: the Responses form is flat ({type, name, schema, strict})."""

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # other values would change the answer: not done


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Any = None  # checked by check_metadata, each way it can be wrong with its own message
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # vLLM's extra

    def check_supported(self) -> None:
        if self.model_extra:  # fields the body does not declare (frontend.request_fields)
            check_extra_fields(self.model_extra, UNSUPPORTED)
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequestError("input must not be empty")
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequestError("input must not be an empty list")
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise InvalidRequestError(f"input holds {len(self.input)} items; at most {MAX_INPUT_ITEMS} are allowed")
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema" and form.schema_ is None:
            raise InvalidRequestError("text.format of type json_schema needs a `schema`")
        check_metadata(self.metadata)

    def input_messages(self, known_call_ids: set[str]) -> list[dict]:
        """The input as chat messages; `known_call_ids` (those of earlier turns) grows with this input's calls."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_message(item, f"input[{i}]"))
            elif kind == "function_call":
                call = {"id": _text(item, "call_id", i), "type": "function",
                        "function": {"name": _text(item, "name", i), "arguments": _arguments(item, i)}}
                known_call_ids.add(call["id"])
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                elif last is not None and last["role"] == "assistant":
                    last["tool_calls"] = [call]
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                call_id = _text(item, "call_id", i)
                if call_id not in known_call_ids:
                    raise InvalidRequestError(f"input[{i}]: function_call_output for call_id {call_id!r}, which no "
                                              "function_call in this input or the previous response made")
                output = item.get("output")
                content = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
                messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            elif kind != "reasoning":
                raise InvalidRequestError(f"input[{i}]: unknown item type {kind!r} (known: message, function_call, "
                                          "function_call_output, reasoning)")
        return messages

    def to_chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request for these (whole-conversation) messages; 400 for what chat cannot do."""
        fields: dict[str, Any] = {"messages": messages, "temperature": self.temperature, "top_p": self.top_p,
                                  "max_completion_tokens": self.max_output_tokens, "seed": self.seed,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.text is not None and self.text.format is not None:
            form = self.text.format
            fields["response_format"] = {"type": form.type} if form.type != "json_schema" else {
                "type": "json_schema", "json_schema": form.model_dump(by_alias=True, exclude={"type"})}
        if self.tools is not None:
            fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        return chat_request_from(fields)


def check_metadata(metadata: Any) -> None:
    """OpenAI's rule: null, or an object of at most 16 pairs, keys strings of at most 64
    characters, values strings of at most 512; anything else is a 400 naming the problem."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise InvalidRequestError(f"metadata must be an object of string pairs, got {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequestError(f"metadata key {key[:20]!r}... is {len(key)} characters long; at most "
                                      f"{MAX_METADATA_KEY_CHARS} are allowed")
        if not isinstance(value, str):
            raise InvalidRequestError(f"metadata.{key} must be a string, got {type(value).__name__}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(f"metadata.{key} is {len(value)} characters long; at most "
                                      f"{MAX_METADATA_VALUE_CHARS} are allowed")


def _text(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"input[{i}].{key} must be a string")
    return value


def _arguments(item: dict, i: int) -> str:
    """A function_call's arguments: JSON text within the bounds every client JSON string has (a 400 naming it)."""
    arguments = _text(item, "arguments", i)
    try:
        check_bounds(arguments, f"input[{i}].arguments")
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return arguments


def _parts_text(parts: Any, where: str, images: bool = False) -> str | list[dict]:
    """Text content parts joined; with `images`, input_image parts are kept too (a list of chat parts, decoded
    by frontend.media); any other part (files) is a 400."""
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts")
    texts, chat_parts = [], []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image":
            chat_parts.append(part)
            continue
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}]: content part of type {kind!r} is not supported "
                                      f"(text parts only: {', '.join(TEXT_PART_TYPES)} with a string `text`)")
        texts.append(part["text"])
        chat_parts.append({"type": "text", "text": part["text"]})
    return chat_parts if len(chat_parts) > len(texts) else "".join(texts)


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    role = ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {item.get('role')!r}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content", images=True)
    return {"role": role, "content": text}


def _chat_tool(tool: dict, i: int) -> dict:
    """A flat Responses function tool -> chat's {type, function: {...}}; built-in tools are 400s."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidRequestError(f"tools[{i}]: tool type {kind!r} is not supported (only function tools; "
                                  "built-in tools such as web_search and file_search are not served here)")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    try:
        return ChatTool.model_validate({"type": "function", "function": function}).model_dump(exclude_none=True)
    except ValidationError as e:
        problem = e.errors()[0]
        raise InvalidRequestError(f"tools[{i}].{problem['loc'][-1]}: {problem['msg']}") from None


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequestError(f"tool_choice must be auto, none, required or a function, got {choice!r}")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError('tool_choice as an object must be {"type": "function", "name": ...} '
                                  "(built-in tool choices are not supported)")
    return {"type": "function", "function": {"name": choice["name"]}}
