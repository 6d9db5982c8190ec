"""Pieces the HTTP handlers share: ids, SSE framing, usage, non-streamed collection, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from fastapi import Request

from frontend.request_state import RequestStream, relay
from ipc.messages import FinishReason, TokenLogprobs
from ipc.text.output_processor import RequestDelta

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client hung up before the response was ready; the app answers 499 (nginx's "client closed
    request"), which no one reads, but the access log and the metrics count it apart from an error."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_stream(stream: RequestStream, header: dict, n: int, include_usage: bool,
                     make_choice: Callable[[RequestDelta], dict | None],
                     opening_choices: Iterable[dict] = ()) -> AsyncIterator[str]:
    """The SSE body of both OpenAI routes: a chunk per choice `make_choice` returns (None:
    nothing a client could see), the usage chunk when asked for, an error event if the
    request fails, and always `[DONE]` last."""
    extra = {"usage": None} if include_usage else {}
    usage = Usage(n)
    for choice in opening_choices:
        yield sse({**header, "choices": [choice], **extra})

    def on_delta(delta: RequestDelta, finish_reason: str | None) -> list[str]:
        usage.add(delta)
        choice = make_choice(delta)
        return [sse({**header, "choices": [choice], **extra})] if choice is not None else []

    def on_end() -> list[str]:
        return [sse({**header, "choices": [], "usage": usage.to_dict()})] if include_usage else []

    async for event in relay(stream, on_delta, on_end, on_error=lambda e: sse(e.to_dict())):
        yield event
    yield SSE_DONE


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, accumulated from its deltas."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    is_stop_string: bool = False  # finish_reason "stop" came from a stop string, not EOS or a stop token
    token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., when asked for

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Usage:
    """Token counts for the `usage` object: each prompt counted once, every choice's output.

    With a `prediction`, completion_tokens counts as OpenAI bills it: the tokens written plus the
    prediction's rejected tokens (the engine computed them too), so that
    accepted_prediction_tokens + rejected_prediction_tokens + the rest = completion_tokens,
    where the rest are the tokens written that no accepted prediction token supplied
    (docs/request_fields.md)."""

    def __init__(self, n: int):
        self.n = n
        self.num_prompt_tokens_by_prompt: dict[int, int] = {}
        self.num_output_tokens_by_choice: dict[int, int] = {}
        self.num_cached_tokens_by_prompt: dict[int, int] = {}
        self.num_accepted_prediction_tokens = 0  # summed over steps and choices
        self.num_rejected_prediction_tokens = 0

    def add(self, delta: RequestDelta) -> None:
        self.num_prompt_tokens_by_prompt[delta.index // self.n] = delta.num_prompt_tokens
        self.num_output_tokens_by_choice[delta.index] = delta.num_output_tokens
        # The n choices of a prompt count it once; the best-cached choice speaks for it.
        prompt_index = delta.index // self.n
        self.num_cached_tokens_by_prompt[prompt_index] = max(
            self.num_cached_tokens_by_prompt.get(prompt_index, 0), delta.num_cached_tokens
        )
        if delta.output is not None:  # the engine's per-step deltas
            self.num_accepted_prediction_tokens += delta.output.num_accepted_prediction_tokens
            self.num_rejected_prediction_tokens += delta.output.num_rejected_prediction_tokens

    def to_dict(self) -> dict:
        num_prompt_tokens = sum(self.num_prompt_tokens_by_prompt.values())
        num_completion_tokens = sum(self.num_output_tokens_by_choice.values()) + self.num_rejected_prediction_tokens
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                "total_tokens": num_prompt_tokens + num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens_by_prompt.values())},
                "completion_tokens_details": {"accepted_prediction_tokens": self.num_accepted_prediction_tokens,
                                              "rejected_prediction_tokens": self.num_rejected_prediction_tokens}}


def is_stop_string(delta: RequestDelta) -> bool:
    """A final delta's "stop" is a stop string's: the engine itself had not stopped (it is still generating)."""
    return delta.finish_reason == FinishReason.STOP and (delta.output is None
                                                         or delta.output.finish_reason != FinishReason.STOP)


async def collect(stream: RequestStream, usage: Usage) -> list[ChoiceResult]:
    """Read a whole request; choices come back in index order."""
    choices = {state.index: ChoiceResult(state.index) for state in stream.states}

    def on_delta(delta: RequestDelta, finish_reason: str | None) -> tuple:
        usage.add(delta)
        choice = choices[delta.index]
        choice.text_parts.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs or ())
        if delta.output is not None and delta.output.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.output.prompt_logprobs
        choice.num_output_tokens = delta.num_output_tokens
        if finish_reason is not None:
            choice.finish_reason = finish_reason
            choice.is_stop_string = is_stop_string(delta)
        return ()

    async for _ in relay(stream, on_delta):  # errors reach the caller
        pass
    return [choices[i] for i in sorted(choices)]


async def collect_unless_disconnected(raw_request: Request, stream: RequestStream, n: int
                                      ) -> tuple[list[ChoiceResult], Usage]:
    """A non-streamed request read whole, and its usage; ClientDisconnected if the client hangs up first."""
    usage = Usage(n)
    return await run_unless_disconnected(raw_request, collect(stream, usage)), usage


async def run_unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its request) if the client hangs up first.

    Like vLLM's `with_cancellation`: once the body is read, the next ASGI message can
    only be http.disconnect.
    """
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task in done:
        return work_task.result()
    try:
        await work_task  # let the cancellation run the stream's abort before we return
    except asyncio.CancelledError:
        pass
    logger.info("client disconnected; request aborted")
    raise ClientDisconnected()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, logprobs: list[TokenLogprobs], text_offset: int = 0,
                        first_prompt_token_id: int | None = None) -> dict:
    """The legacy completions `logprobs` object: parallel lists over the tokens. With
    `first_prompt_token_id` (echo), `logprobs` begins with the prompt's and the prompt's
    first token leads with no log-prob, as vLLM writes it."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    if first_prompt_token_id is not None:
        text = token_text(tokenizer, first_prompt_token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        offsets.append(text_offset)
        text_offset += len(text)
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        # The token itself first, then its top alternatives: up to N + 1 entries, as OpenAI and vLLM
        # write them (a prompt token, or a sampled one, is often not among the top N).
        top = {text: lp.logprob}
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(token_text(tokenizer, token_id), value)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs_field(tokenizer, prompt_logprobs: list[TokenLogprobs] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, decoded_token}}
    for the token itself and its top alternatives."""
    if prompt_logprobs is None:
        return None
    entries: list[dict | None] = [None]
    for lp in prompt_logprobs:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": token_text(tokenizer, lp.token_id)}}
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            entry.setdefault(str(token_id), {"logprob": value, "decoded_token": token_text(tokenizer, token_id)})
        entries.append(entry)
    return entries


def chat_logprobs(tokenizer, logprobs: list[TokenLogprobs]) -> dict:
    """The chat `logprobs` object: one entry per sampled token, each with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**entry(lp.token_id, lp.logprob),
         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
        for lp in logprobs
    ]}
