"""`POST /v1/completions` (OpenAI) and `POST /generate` (vLLM's simple API server).

Both read one RequestStream. Streamed responses are built from the same deltas as
non-streamed ones, so the concatenated stream equals the non-streamed text.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi import Request
from msgspec.structs import replace
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.engine_client import AsyncEngineClient
from frontend.errors import InvalidRequestError
from frontend.protocol import CompletionRequest, GenerateBody
from frontend.request_state import RequestDelta, RequestStream, finish_reason_of, relay
from frontend.serving_utils import (
    collect_unless_disconnected, completion_logprobs, now_s, prompt_logprobs_field, random_id, sse_stream,
)

logger = logging.getLogger(__name__)


async def create_completion(body: CompletionRequest, raw_request: Request, client: AsyncEngineClient) -> Response:
    body.check_supported()
    prompts = body.prompts()
    params = body.to_sampling_params(body.max_tokens, body.logprobs, body.structured_outputs_params())
    if params.prompt_logprobs != body.num_prompt_logprobs:
        params = replace(params, prompt_logprobs=body.num_prompt_logprobs)
    request_id = random_id("cmpl")
    stream = await client.generate_batch(prompts, params, request_id, n=body.n, prediction=body.prediction_text)
    echo_texts = [_prompt_text(client, p) for p in prompts] if body.echo else None
    # echo with logprobs: the prompt's tokens lead the logprobs object, as in vLLM
    echo_first_ids = [ids[0] for ids in stream.prompt_token_ids] if body.echo and body.logprobs is not None else None
    header = {"id": request_id, "object": "text_completion", "created": now_s(), "model": client.model_name}
    if body.stream:
        return StreamingResponse(_stream_completion(stream, body, header, client, echo_texts, echo_first_ids),
                                 media_type="text/event-stream")
    results, usage = await collect_unless_disconnected(raw_request, stream, body.n)
    choices = []
    for result in results:
        prefix = echo_texts[result.index // body.n] if echo_texts else ""
        logprobs = None
        if echo_first_ids is not None:
            logprobs = completion_logprobs(client.tokenizer, (result.prompt_logprobs or []) + result.logprobs, 0,
                                           echo_first_ids[result.index // body.n])
        elif body.logprobs is not None:
            logprobs = completion_logprobs(client.tokenizer, result.logprobs, len(prefix))
        choice = {"index": result.index, "text": prefix + result.text, "logprobs": logprobs,
                  "finish_reason": result.finish_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(client.tokenizer, result.prompt_logprobs)
        choices.append(choice)
    return JSONResponse({**header, "choices": choices, "usage": usage.to_dict()})


def _stream_completion(stream: RequestStream, body: CompletionRequest, header: dict, client: AsyncEngineClient,
                       echo_texts: list[str] | None, echo_first_ids: list[int] | None) -> AsyncIterator[str]:
    is_echoed: set[int] = set()
    text_offsets: dict[int, int] = {}

    def make_choice(delta: RequestDelta) -> dict | None:
        text = delta.text
        entries, first_prompt_token_id = delta.logprobs or [], None
        prompt_logprobs = delta.output.prompt_logprobs if delta.output is not None else None
        if echo_texts and delta.index not in is_echoed:
            is_echoed.add(delta.index)
            text = echo_texts[delta.index // body.n] + text
            if echo_first_ids is not None:  # the prompt's log-probs come with the first token
                entries = (prompt_logprobs or []) + entries
                first_prompt_token_id = echo_first_ids[delta.index // body.n]
        logprobs = None
        if body.logprobs is not None:
            offset = text_offsets.get(delta.index, 0)
            logprobs = completion_logprobs(client.tokenizer, entries, offset, first_prompt_token_id)
            text_offsets[delta.index] = offset + len(text)
        finish_reason = finish_reason_of(delta)
        if not text and finish_reason is None and logprobs is None and prompt_logprobs is None:
            return None  # nothing a client could see
        choice = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if body.prompt_logprobs is not None and prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(client.tokenizer, prompt_logprobs)
        return choice

    return sse_stream(stream, header, body.n, body.include_usage, make_choice)


def _prompt_text(client: AsyncEngineClient, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else client.tokenizer.decode(prompt, skip_special_tokens=False)


async def generate(body: GenerateBody, raw_request: Request, client: AsyncEngineClient) -> Response:
    """vLLM's `/generate`: `{"text": [prompt + output, ...]}`, streamed as one such object per step + NUL."""
    if body.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs is not returned by /generate (use /v1/completions)")
    params = body.to_sampling_params(body.max_tokens, body.logprobs, body.structured_outputs_params())
    stream = await client.generate(body.prompt, params, random_id("gen"), n=body.n)
    if body.stream:
        return StreamingResponse(_stream_generate(stream, body))
    results, _ = await collect_unless_disconnected(raw_request, stream, body.n)
    return JSONResponse({"text": [body.prompt + result.text for result in results]})


async def _stream_generate(stream: RequestStream, body: GenerateBody) -> AsyncIterator[bytes]:
    texts = [body.prompt] * body.n

    def on_delta(delta: RequestDelta, finish_reason: str | None) -> list[bytes]:
        texts[delta.index] += delta.text
        return [(json.dumps({"text": texts}) + "\0").encode("utf-8")]

    async for item in relay(stream, on_delta, on_error=lambda e: (json.dumps(e.to_dict()) + "\0").encode("utf-8")):
        yield item
