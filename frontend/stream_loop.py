"""The one loop that reads a request's stream, for every route that reads one.

    relay(stream, on_delta, on_end, on_error)

opens the stream (leaving it aborts the request: a client gone, a route's error), hands each
delta and its finish reason in OpenAI's names ("stop", "length", ... or None) to `on_delta`,
then `on_end` once the request is over, and yields whatever they return: SSE events, NUL-ended
JSON, or nothing for a route that collects the whole answer. A request that fails (its engine
died, the request was refused) ends in `on_error`'s one item, in the route's own shape; without
`on_error` the error is raised to the caller.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable, Iterable, TypeVar

from frontend.errors import FrontendError
from frontend.request_state import RequestStream
from ipc.text.output_processor import RequestDelta

T = TypeVar("T")


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
