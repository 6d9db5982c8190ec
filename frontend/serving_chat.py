"""`POST /v1/chat/completions` (OpenAI): the chat template, then the same delta stream as completions.

With --reasoning-parser (frontend.reasoning_parsers), the answer's `<think>...</think>`
part becomes `message.reasoning_content` (streamed as `delta.reasoning_content`), and a
grammar (a structured output, a forced tool call) waits in the engine until it is over.
With tools (frontend.chat_tools), the content part goes through the request's tool
parser: calls become `message.tool_calls` (streamed as OpenAI's tool-call deltas:
index, id and name first, then pieces of arguments) and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.chat_tools import ToolMode, ToolOptions, resolve_tool_mode, template_messages
from frontend.engine_client import AsyncEngineClient
from frontend.errors import InvalidRequestError
from frontend.protocol import ChatCompletionRequest
from frontend.reasoning_parsers import ReasoningParser, ReasoningPrompt, ReasoningState
from frontend.request_state import RequestDelta, RequestStream
from frontend.serving_utils import (
    chat_logprobs, collect_unless_disconnected, now_s, random_id, sse_stream,
)
from frontend.tool_parsers import ToolParser, merge_call_deltas

logger = logging.getLogger(__name__)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, client: AsyncEngineClient,
                                 tool_options: ToolOptions | None = None,
                                 reasoning: ReasoningPrompt | None = None) -> Response:
    body.check_supported()
    tool_mode = resolve_tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls, tool_options or ToolOptions())
    structured_outputs = body.structured_outputs_params()
    if tool_mode.structured_outputs is not None:
        if structured_outputs is not None:
            raise InvalidRequestError(f'tool_choice "{tool_mode.kind}" cannot be combined with a structured output')
        structured_outputs = tool_mode.structured_outputs
    messages = template_messages([message.to_template_dict() for message in body.messages])
    prompt_token_ids = await client.tokenize_chat(messages, body.add_generation_prompt, tool_mode.template_tools,
                                                  body.chat_template_kwargs)
    reasoning_state = reasoning.state_after(prompt_token_ids) if reasoning is not None else ReasoningState.CONTENT
    if reasoning is not None:
        structured_outputs = reasoning.hold_grammar(structured_outputs, reasoning_state)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.to_sampling_params(max_tokens, body.num_logprobs, structured_outputs)
    request_id = random_id("chatcmpl")
    stream = await client.generate(None, params, request_id, prompt_token_ids=prompt_token_ids, n=body.n,
                                   prediction=body.prediction_text)
    header = {"id": request_id, "created": now_s(), "model": client.model_name}
    if body.stream:
        new_reasoning_parser = (lambda: reasoning.new_parser(reasoning_state)) if reasoning is not None else None
        return StreamingResponse(_stream_chat(stream, body, header, client, tool_mode, new_reasoning_parser),
                                 media_type="text/event-stream")
    results, usage = await collect_unless_disconnected(raw_request, stream, body.n)
    choices = []
    for result in results:
        reasoning_content, content = None, result.text
        if reasoning is not None:
            reasoning_content, content = reasoning.new_parser(reasoning_state).extract(result.text)
        message, finish_reason = _message(content, result.finish_reason, tool_mode.new_parser())
        if reasoning is not None:
            message["reasoning_content"] = reasoning_content if body.include_reasoning else None
        choices.append({"index": result.index, "message": message,
                        "logprobs": chat_logprobs(client.tokenizer, result.logprobs) if body.logprobs else None,
                        "finish_reason": finish_reason})
    return JSONResponse({**header, "object": "chat.completion", "choices": choices, "usage": usage.to_dict()})


def _message(text: str | None, finish_reason: str | None, parser: ToolParser | None) -> tuple[dict, str | None]:
    """`text`: the answer's content part (None: the answer was all reasoning)."""
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parser.extract(text or "")
    if not calls:
        return {"role": "assistant", "content": content or ""}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
    return message, _tool_finish_reason(finish_reason)


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    # A call cut short by max_tokens still says "length".
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _feed(parser, text: str, is_last: bool) -> tuple:
    """A streaming parser's (two-part) output for this delta, and what it held back when it is the last."""
    first, second = parser.feed(text)
    if is_last:
        more_first, more_second = parser.finish()
        first, second = first + more_first, second + more_second
    return first, second


def _stream_chat(stream: RequestStream, body: ChatCompletionRequest, header: dict,
                 client: AsyncEngineClient, tool_mode: ToolMode,
                 new_reasoning_parser: Callable[[], ReasoningParser] | None) -> AsyncIterator[str]:
    parsers = {index: tool_mode.new_parser() for index in range(len(stream.states))}
    reasoning_parsers = {index: new_reasoning_parser() if new_reasoning_parser else None
                         for index in range(len(stream.states))}

    def make_choice(delta: RequestDelta) -> dict | None:
        finish_reason = delta.finish_reason.openai_name if delta.finish_reason is not None else None
        reasoning_text, text = "", delta.text
        reasoning_parser = reasoning_parsers[delta.index]
        if reasoning_parser is not None:
            reasoning_text, text = _feed(reasoning_parser, text, finish_reason is not None)
        message = {"content": text} if text else {}
        parser = parsers[delta.index]
        if parser is not None:
            content, call_deltas = _feed(parser, text, finish_reason is not None)
            if finish_reason is not None and parser.has_tool_calls:
                finish_reason = _tool_finish_reason(finish_reason)
            message = {"content": content} if content else {}
            if call_deltas:
                message["tool_calls"] = [d.to_openai() for d in merge_call_deltas(call_deltas)]
        if reasoning_text and body.include_reasoning:
            message = {"reasoning_content": reasoning_text, **message}
        if not message and finish_reason is None and not (body.logprobs and delta.logprobs):
            return None
        return {
            "index": delta.index,
            "delta": message,
            "logprobs": chat_logprobs(client.tokenizer, delta.logprobs or []) if body.logprobs else None,
            "finish_reason": finish_reason,
        }

    # OpenAI opens every choice with a role-only delta.
    opening_choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for index in range(len(stream.states))]
    return sse_stream(stream, {**header, "object": "chat.completion.chunk"}, body.n, body.include_usage,
                      make_choice, opening_choices)
