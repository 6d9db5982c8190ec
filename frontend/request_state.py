"""Per-request state in the frontend: where a request runs, its queue and timings.

The text logic (detokenizing, stop strings, usage counts) is the shared
`ipc.text.output_processor.OutputProcessor`, which the output pump feeds each
`EngineOutputs`; each `RequestDelta` it makes goes into the consumer's queue. Several
states share one queue when a request fans out into `n` choices (each delta carries
its choice's `index`).

The one loop that reads a request's stream, for every route that reads one:

    relay(stream, on_delta, on_end, on_error)

opens the stream (leaving it aborts the request: a client gone, a route's error), hands each
delta and its finish reason in OpenAI's names ("stop", "length", ... or None) to `on_delta`,
then `on_end` once the request is over, and yields whatever they return: SSE events, NUL-ended
JSON, or nothing for a route that collects the whole answer. A request that fails (its engine
died, the request was refused) ends in `on_error`'s one item, in the route's own shape; without
`on_error` the error is raised to the caller.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Iterable, TypeVar

from frontend.errors import FrontendError
from ipc.text.output_processor import RequestDelta

T = TypeVar("T")


class RequestState:
    """One engine-side request: which core runs it, whose queue gets its deltas, its timings."""

    def __init__(self, request_id: str, index: int, queue: asyncio.Queue, engine_index: int):
        self.request_id = request_id
        self.index = index
        self.queue = queue
        self.engine_index = engine_index
        self.is_finished = False
        self.arrival_time = time.monotonic()
        self.last_token_time: float | None = None  # None until the first token: TTFT vs ITL


class RequestStream:
    """The consumer's side of a request: an async iterator of deltas over all its choices.

    An object rather than an async generator so `close` aborts the request even if it
    was never iterated. Cancelling a pending `__anext__` (the HTTP client went away)
    closes it too; the API layer closes it in a `finally` for every other exit.
    """

    def __init__(self, states: list[RequestState], queue: asyncio.Queue, abort: Callable[[list[RequestState]], None],
                 prompt_token_ids: list[list[int]] | None = None):
        self.states = states
        self.prompt_token_ids = prompt_token_ids or []  # per prompt: choice i has prompt i // n
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


def finish_reason_of(delta: RequestDelta) -> str | None:
    """The delta's finish reason in OpenAI's names; None while the request goes on."""
    return delta.finish_reason.openai_name if delta.finish_reason is not None else None


async def relay(stream: RequestStream, on_delta: Callable[[RequestDelta, str | None], Iterable[T]],
                on_end: Callable[[], Iterable[T]] = tuple,
                on_error: Callable[[FrontendError], T] | None = None) -> AsyncIterator[T]:
    try:
        async with stream:
            async for delta in stream:
                for item in on_delta(delta, finish_reason_of(delta)):
                    yield item
        for item in on_end():
            yield item
    except FrontendError as e:
        if on_error is None:
            raise
        yield on_error(e)
