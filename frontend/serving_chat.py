"""`POST /v1/chat/completions` (OpenAI): the chat template, then the same delta stream as completions."""

from __future__ import annotations

import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.engine_client import AsyncEngineClient
from frontend.protocol import ChatCompletionRequest
from frontend.request_state import RequestDelta, RequestStream
from frontend.serving_utils import (
    ClientDisconnected, Usage, chat_logprobs, collect, now_s, random_id, run_unless_disconnected, sse_stream,
)

logger = logging.getLogger(__name__)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request,
                                 client: AsyncEngineClient) -> Response:
    body.check_supported()
    messages = [message.to_template_dict() for message in body.messages]
    prompt_token_ids = await client.tokenize_chat(messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.to_sampling_params(max_tokens, body.num_logprobs)
    request_id = random_id("chatcmpl")
    stream = await client.generate(None, params, request_id, prompt_token_ids=prompt_token_ids, n=body.n)
    header = {"id": request_id, "created": now_s(), "model": client.model_name}
    if body.stream:
        return StreamingResponse(_stream_chat(stream, body, header, client), media_type="text/event-stream")
    usage = Usage(body.n)
    try:
        results = await run_unless_disconnected(raw_request, collect(stream, usage))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = [
        {"index": result.index,
         "message": {"role": "assistant", "content": result.text},
         "logprobs": chat_logprobs(client.tokenizer, result.logprobs) if body.logprobs else None,
         "finish_reason": result.finish_reason}
        for result in results
    ]
    return JSONResponse({**header, "object": "chat.completion", "choices": choices, "usage": usage.to_dict()})


def _stream_chat(stream: RequestStream, body: ChatCompletionRequest, header: dict,
                 client: AsyncEngineClient) -> AsyncIterator[str]:
    def make_choice(delta: RequestDelta) -> dict | None:
        finish_reason = delta.finish_reason.openai_name if delta.finish_reason is not None else None
        if not delta.text and finish_reason is None and not (body.logprobs and delta.logprobs):
            return None
        return {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": chat_logprobs(client.tokenizer, delta.logprobs or []) if body.logprobs else None,
            "finish_reason": finish_reason,
        }

    # OpenAI opens every choice with a role-only delta.
    opening_choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for index in range(body.n)]
    return sse_stream(stream, {**header, "object": "chat.completion.chunk"}, body.n, body.include_usage,
                      make_choice, opening_choices)
