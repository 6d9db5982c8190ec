"""Per-request state in the frontend: engine token deltas in, text deltas out.

The output pump owns these: for each `RequestOutput` it calls `make_delta`, which
detokenizes incrementally, cuts at stop strings and keeps the usage counts; the
resulting `RequestDelta` goes into the consumer's queue. Several states share one
queue when a request fans out into `n` choices (each tags its deltas with `index`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from ipc.messages import FinishReason, RequestOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams
from frontend.text_stream import TextStream


@dataclass
class RequestDelta:
    """What one engine step added to one choice of a request."""

    index: int  # which of the n choices
    text: str  # final text only: never retracted later
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, for usage
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


class RequestState:
    """One engine-side request: where it runs, its detokenizer, stop checker and timings."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        queue: asyncio.Queue,
        engine_index: int,
    ):
        self.request_id = request_id
        self.index = index
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.queue = queue
        self.engine_index = engine_index
        self.text_stream = TextStream(tokenizer, prompt_token_ids, params)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.is_finished = False
        self.arrival_time = time.monotonic()
        self.last_token_time: float | None = None  # None until the first token: TTFT vs ITL

    def make_delta(self, output: RequestOutput) -> RequestDelta:
        """Turn one engine output into a text delta; a stop-string hit finishes the request."""
        token_ids = output.new_token_ids
        self.num_output_tokens += len(token_ids)
        # Kept from the first output on: a later one (an abort) may not carry it.
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        finish_reason = output.finish_reason
        text, hit_stop = self.text_stream.add_tokens(token_ids, is_last=finish_reason is not None,
                                                     stop_token_id=output.stop_token_id)
        if hit_stop:
            finish_reason = FinishReason.STOP
        self.is_finished = finish_reason is not None
        return RequestDelta(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            logprobs=output.new_logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )


class RequestStream:
    """The consumer's side of a request: an async iterator of deltas over all its choices.

    An object rather than an async generator so `close` aborts the request even if it
    was never iterated. Cancelling a pending `__anext__` (the HTTP client went away)
    closes it too; the API layer closes it in a `finally` for every other exit.
    """

    def __init__(self, states: list[RequestState], queue: asyncio.Queue, abort: Callable[[list[RequestState]], None]):
        self.states = states
        self._queue = queue
        self._abort = abort
        self._num_unfinished = len(states)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._num_unfinished == 0:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: nobody will read the rest
            self.close()
            raise
        if isinstance(item, Exception):  # a FrontendError: the engine failed this choice
            self._num_unfinished = 0  # the request as a whole has failed; the other choices are aborted
            self.close()
            raise item
        if item.finish_reason is not None:
            self._num_unfinished -= 1
        return item

    def close(self) -> None:
        """Abort every choice that has not finished; safe to call twice."""
        unfinished = [s for s in self.states if not s.is_finished]
        if unfinished:
            self._abort(unfinished)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort for a consumer that broke out of its loop without closing.
        if any(not s.is_finished for s in self.states):
            try:
                self.close()
            except Exception:
                pass
