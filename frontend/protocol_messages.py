"""`POST /v1/messages` (Anthropic's Messages API): the body, and its translation into a chat request.

As for the Responses API, the adapter owns no sampling, template, tool or grammar logic:
`to_chat_request` maps the body onto a ChatCompletionRequest for frontend.chat_run.

    system (a string or text blocks)          a system message
    text blocks                                the message's content
    tool_use blocks (assistant)                the assistant's tool_calls (input as JSON arguments)
    tool_result blocks (user)                  tool messages, before the user's text; an unknown tool_use_id is a 400
    thinking, redacted_thinking (assistant)    dropped (chat templates drop old reasoning)
    tool_choice auto / any / tool / none       chat's auto / required / named / none
    stop_sequences, top_k                      stop, top_k
    output_config.format (json_schema)         response_format json_schema (the grammar)

Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from frontend.errors import InvalidRequestError
from frontend.protocol import ChatCompletionRequest, chat_request_from
from frontend.protocol_responses import MAX_INPUT_ITEMS
from frontend.request_fields import check_extra_fields
from ipc.bounded_json import check_bounds

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
DROPPED_BLOCKS = ("thinking", "redacted_thinking")
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "mcp_servers": (None, []),
    "container": (None,),
    "context_management": (None,),
}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.model_extra:  # fields the body does not declare (frontend.request_fields)
            check_extra_fields(self.model_extra, UNSUPPORTED)
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        num_blocks = sum(len(m["content"]) if isinstance(m.get("content"), list) else 1 for m in self.messages)
        if num_blocks > MAX_INPUT_ITEMS:
            raise InvalidRequestError(f"messages hold {num_blocks} messages and content blocks; at most "
                                      f"{MAX_INPUT_ITEMS} are allowed")

    def chat_messages(self) -> list[dict]:
        messages = [{"role": "system", "content": _blocks_text(self.system, "system")}] if self.system else []
        call_ids: set[str] = set()
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise InvalidRequestError(f"messages[{i}].role must be user or assistant, got {role!r}")
            content = message.get("content")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif role == "assistant":
                messages.append(_assistant_message(content, f"messages[{i}].content", call_ids))
            else:
                messages += _user_messages(content, f"messages[{i}].content", call_ids)
        return messages

    def to_chat_request(self) -> ChatCompletionRequest:
        fields: dict[str, Any] = {"messages": self.chat_messages(), "max_tokens": self.max_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                  "stop": self.stop_sequences}
        if self.tools is not None:
            fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
            if self.tool_choice.get("disable_parallel_tool_use") is True:
                fields["parallel_tool_calls"] = False
        if self.output_config is not None:
            fields["response_format"] = _response_format(self.output_config)
        return chat_request_from(fields)


def _blocks(content: Any, where: str) -> list[dict]:
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise InvalidRequestError(f"{where} must be a string or a list of content blocks (objects)")
    return content


def _block_text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{where}: a text block needs a string `text`")
    return block["text"]


def _blocks_text(content: Any, where: str) -> str:
    """Text blocks (or a string) joined; any other block is a 400."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise InvalidRequestError(f"{where}[{j}]: block type {block.get('type')!r} is not supported here "
                                      "(text blocks only)")
        texts.append(_block_text(block, f"{where}[{j}]"))
    return "".join(texts)


def _assistant_message(content: Any, where: str, call_ids: set[str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise InvalidRequestError(f"{where}[{j}]: a tool_use block needs a string `id` and `name` and an "
                                          "object `input`")
            call_ids.add(call_id)
            arguments_text = json.dumps(arguments, ensure_ascii=False)
            try:  # the bounds of every client JSON string: a 400 naming the block, not the chat message
                check_bounds(arguments_text, f"{where}[{j}].input")
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_text}})
        elif kind not in DROPPED_BLOCKS:
            raise InvalidRequestError(f"{where}[{j}]: block type {kind!r} is not supported in an assistant message "
                                      "(text, tool_use, thinking)")
    message = {"role": "assistant", "content": "".join(texts)}
    return {**message, "tool_calls": calls} if calls else message


def _user_messages(content: Any, where: str, call_ids: set[str]) -> list[dict]:
    results, texts, parts = [], [], []  # parts: the text and image blocks in order, where there are images
    for j, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":  # decoded with the chat's other images (frontend.media)
            parts.append(block)
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise InvalidRequestError(f"{where}[{j}]: tool_result for tool_use_id {call_id!r}, which no earlier "
                                          "tool_use block made")
            output = _blocks_text(block.get("content", ""), f"{where}[{j}].content")
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise InvalidRequestError(f"{where}[{j}]: block type {kind!r} is not supported in a user message "
                                      "(text, image, tool_result)")
    if len(parts) > len(texts):
        return results + [{"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _chat_tool(tool: dict, i: int) -> dict:
    """{name, description, input_schema} -> chat's function tool; Anthropic's server tools are 400s."""
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequestError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported (client tools "
                                  "with name and input_schema only)")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError(f"tools[{i}].name must be a string")
    function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("input_schema")}
    return {"type": "function", "function": function}


def _response_format(config: dict) -> dict | None:
    """`output_config`: a JSON schema `format` is honoured through the grammar; `effort` is not done."""
    for key, value in config.items():
        if key not in ("format", "effort") or (key == "effort" and value is not None):
            raise InvalidRequestError(f"output_config.{key} is not supported (output_config.format only)")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise InvalidRequestError('output_config.format must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}


def _chat_tool_choice(choice: dict) -> str | dict:
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequestError('tool_choice of type "tool" needs a string `name`')
        return {"type": "function", "function": {"name": choice["name"]}}
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise InvalidRequestError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
    return TOOL_CHOICES[kind]
