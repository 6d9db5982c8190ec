"""`POST /v1/chat/completions` (OpenAI): the chat template, then the same delta stream as completions.

With --reasoning-parser (frontend.reasoning_parsers), the answer's `<think>...</think>`
part becomes `message.reasoning_content` (streamed as `delta.reasoning_content`), and a
grammar (a structured output, a forced tool call) waits in the engine until it is over.
With tools (frontend.chat_tools), the content part goes through the request's tool
parser: calls become `message.tool_calls` (streamed as OpenAI's tool-call deltas:
index, id and name first, then pieces of arguments) and `finish_reason: "tool_calls"`.
The way in and the parsers are frontend.chat_run's, shared with the Responses and
Messages adapters.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.chat_run import ChatAnswer, ChatRun, start_chat
from frontend.chat_tools import ToolOptions
from frontend.engine_client import AsyncEngineClient
from frontend.protocol import ChatCompletionRequest
from frontend.reasoning_parsers import ReasoningPrompt
from frontend.request_state import RequestDelta, finish_reason_of
from frontend.serving_utils import chat_logprobs, collect_unless_disconnected, now_s, sse_stream
from frontend.tool_parsers import merge_call_deltas

logger = logging.getLogger(__name__)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, client: AsyncEngineClient,
                                 tool_options: ToolOptions | None = None,
                                 reasoning: ReasoningPrompt | None = None) -> Response:
    run = await start_chat(body, client, tool_options, reasoning)
    header = {"id": run.request_id, "created": now_s(), "model": client.model_name}
    if body.stream:
        return StreamingResponse(_stream_chat(run, body, header, client), media_type="text/event-stream")
    results, usage = await collect_unless_disconnected(raw_request, run.stream, body.n)
    choices = []
    for result in results:
        answer = run.answer(result.text, result.finish_reason)
        message = _message(answer)
        if reasoning is not None:
            message["reasoning_content"] = answer.reasoning_content if body.include_reasoning else None
        choices.append({"index": result.index, "message": message,
                        "logprobs": chat_logprobs(client.tokenizer, result.logprobs) if body.logprobs else None,
                        "finish_reason": answer.finish_reason})
    return JSONResponse({**header, "object": "chat.completion", "choices": choices, "usage": usage.to_dict()})


def _message(answer: ChatAnswer) -> dict:
    message = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in answer.tool_calls]
    return message


def _stream_chat(run: ChatRun, body: ChatCompletionRequest, header: dict,
                 client: AsyncEngineClient) -> AsyncIterator[str]:
    parsers = {index: run.new_delta_parser() for index in range(len(run.stream.states))}

    def make_choice(delta: RequestDelta) -> dict | None:
        finish_reason = finish_reason_of(delta)
        parsed = parsers[delta.index].feed(delta.text, finish_reason)
        message = {"content": parsed.content} if parsed.content else {}
        if parsed.call_deltas:
            message["tool_calls"] = [d.to_openai() for d in merge_call_deltas(parsed.call_deltas)]
        if parsed.reasoning_content and body.include_reasoning:
            message = {"reasoning_content": parsed.reasoning_content, **message}
        if not message and parsed.finish_reason is None and not (body.logprobs and delta.logprobs):
            return None
        return {
            "index": delta.index,
            "delta": message,
            "logprobs": chat_logprobs(client.tokenizer, delta.logprobs or []) if body.logprobs else None,
            "finish_reason": parsed.finish_reason,
        }

    # OpenAI opens every choice with a role-only delta.
    opening_choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for index in range(len(run.stream.states))]
    return sse_stream(run.stream, {**header, "object": "chat.completion.chunk"}, body.n, body.include_usage,
                      make_choice, opening_choices)
