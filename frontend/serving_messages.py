"""`POST /v1/messages` (Anthropic's Messages API), an adapter over the chat path.

The body becomes a ChatCompletionRequest (frontend.protocol_messages) and runs through
frontend.chat_run; this module writes the answer as Anthropic does: content blocks
(`thinking` with --reasoning-parser, `text`, one `tool_use` per call), `stop_reason`
(end_turn, max_tokens, stop_sequence, tool_use), `usage`, and, streamed, the events

    message_start, then per block: content_block_start, content_block_delta
    (text_delta / thinking_delta / input_json_delta)..., content_block_stop,
    then message_delta (stop_reason, usage), message_stop

as `event: NAME` / `data: {...}` pairs. Errors are Anthropic's shape (frontend.errors.error_body).

Reference: https://docs.anthropic.com/en/api/messages-streaming
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.chat_run import ChatRun, start_chat
from frontend.chat_tools import ToolOptions
from frontend.engine_client import AsyncEngineClient
from frontend.errors import FrontendError, anthropic_error
from frontend.protocol_messages import MessagesRequest
from frontend.reasoning_parsers import ReasoningPrompt
from frontend.request_state import RequestDelta, relay
from frontend.serving_utils import collect_unless_disconnected, is_stop_string
from frontend.tool_parsers import ToolCallDelta
from frontend.tool_parsers.base import MODEL_TEXT_MAX_BYTES
from ipc.bounded_json import loads_bounded

logger = logging.getLogger(__name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
BLOCK_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
                "tool_use": ("input_json_delta", "partial_json")}


async def create_message(body: MessagesRequest, raw_request: Request, client: AsyncEngineClient,
                         tool_options: ToolOptions | None, reasoning: ReasoningPrompt | None) -> Response:
    body.check_supported()
    run = await start_chat(body.to_chat_request(), client, tool_options, reasoning, "msg")
    header = {"id": run.request_id, "type": "message", "role": "assistant", "model": client.model_name}
    if body.stream:
        return StreamingResponse(_stream_message(run, body, header, client), media_type="text/event-stream")
    results, usage = await collect_unless_disconnected(raw_request, run.stream, 1)
    result = results[0]
    answer = run.answer(result.text, result.finish_reason)
    content = [{"type": "thinking", "thinking": answer.reasoning_content, "signature": ""}] \
        if answer.reasoning_content else []
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call.arguments)}
                for call in answer.tool_calls]
    stop_sequence = _stop_sequence(client, body, result.token_ids, result.text) if result.is_stop_string else None
    counts = usage.to_dict()
    return JSONResponse({**header, "content": content, "stop_reason": _stop_reason(answer.finish_reason, stop_sequence),
                         "stop_sequence": stop_sequence,
                         "usage": {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"]}})


def _tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic sends; arguments cut short (max_tokens) are {}."""
    try:
        value = loads_bounded(arguments, "tool call arguments", max_bytes=MODEL_TEXT_MAX_BYTES)
    except ValueError:
        logger.info("tool call arguments are not whole JSON (cut short?): %r", arguments[-200:])
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str | None:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn") if finish_reason is not None else None


def _stop_sequence(client: AsyncEngineClient, body: MessagesRequest, token_ids: list[int], text: str) -> str | None:
    """Which stop sequence ended the answer: the one the decoded output goes on with after the text."""
    stops = [s for s in body.stop_sequences or () if s]
    if len(stops) <= 1:
        return stops[0] if stops else None
    tail = client.tokenizer.decode(token_ids, skip_special_tokens=True)[len(text):]
    found = [(tail.find(s) + len(s), s) for s in stops if s in tail]
    return min(found)[1] if found else stops[0]


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _BlockWriter:
    """Opens, feeds and closes content blocks as the answer's kind of text changes."""

    def __init__(self):
        self.num_blocks = 0
        self.open_kind: str | None = None

    def piece(self, kind: str, text: str, call: ToolCallDelta | None = None) -> list[str]:
        events = []
        if call is not None and call.id is not None:
            events += self.close()
            events.append(self._start({"type": "tool_use", "id": call.id, "name": call.name or "", "input": {}}))
        elif text and self.open_kind != kind:
            events += self.close()
            events.append(self._start({"type": kind, kind: ""} if kind != "text" else {"type": "text", "text": ""}))
        if text and self.open_kind == kind:
            delta_type, key = BLOCK_DELTAS[kind]
            events.append(_event("content_block_delta", {"index": self.num_blocks - 1,
                                                         "delta": {"type": delta_type, key: text}}))
        return events

    def _start(self, block: dict) -> str:
        self.open_kind = block["type"]
        self.num_blocks += 1
        return _event("content_block_start", {"index": self.num_blocks - 1, "content_block": block})

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", {"index": self.num_blocks - 1})]


async def _stream_message(run: ChatRun, body: MessagesRequest, header: dict,
                          client: AsyncEngineClient) -> AsyncIterator[str]:
    parser, writer = run.new_delta_parser(), _BlockWriter()
    finish_reason, stop_sequence, num_output_tokens = None, None, 0
    token_ids: list[int] = []
    text_parts: list[str] = []
    usage = {"input_tokens": len(run.prompt_token_ids), "output_tokens": 0}
    yield _event("message_start", {"message": {**header, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": usage}})

    def on_delta(delta: RequestDelta, reason: str | None) -> list[str]:
        nonlocal num_output_tokens, stop_sequence, finish_reason
        num_output_tokens = delta.num_output_tokens
        token_ids.extend(delta.token_ids)
        text_parts.append(delta.text)
        if reason is not None and is_stop_string(delta):
            stop_sequence = _stop_sequence(client, body, token_ids, "".join(text_parts))
        parsed = parser.feed(delta.text, reason)
        finish_reason = parsed.finish_reason or finish_reason
        events = writer.piece("thinking", parsed.reasoning_content) + writer.piece("text", parsed.content)
        for call in parsed.call_deltas:
            events += writer.piece("tool_use", call.arguments, call)
        return events

    def on_end() -> list[str]:
        return writer.close() + [
            _event("message_delta", {"delta": {"stop_reason": _stop_reason(finish_reason, stop_sequence),
                                               "stop_sequence": stop_sequence},
                                     "usage": {"output_tokens": num_output_tokens}}),
            _event("message_stop", {})]

    def on_error(e: FrontendError) -> str:
        return f"event: error\ndata: {json.dumps(anthropic_error(e.status_code, str(e)))}\n\n"

    async for event in relay(run.stream, on_delta, on_end, on_error):
        yield event
