"""The SSE body both OpenAI routes send (frontend.serving_utils.sse_stream): chunks, then
the usage chunk when asked for, an error event when the request fails, and [DONE] last."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from frontend.errors import EngineDeadError
from frontend.request_state import RequestStream
from frontend.serving_utils import sse_stream
from ipc.messages import FinishReason
from ipc.text.output_processor import RequestDelta

HEADER = {"id": "x", "object": "chunk"}


def delta(index: int, text: str, finish_reason: FinishReason | None = None, num_output_tokens: int = 1) -> RequestDelta:
    return RequestDelta(index=index, text=text, token_ids=[7], finish_reason=finish_reason, logprobs=None,
                        num_prompt_tokens=3, num_output_tokens=num_output_tokens)


def events(items: list, n: int = 1, include_usage: bool = False, opening_choices=()) -> list:
    """Run sse_stream over a stream whose queue holds `items`; return the decoded events."""
    aborted = []

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        states = [SimpleNamespace(index=i, is_finished=False) for i in range(n)]
        stream = RequestStream(states, queue, aborted.extend)

        def make_choice(d: RequestDelta) -> dict | None:
            return {"index": d.index, "text": d.text} if d.text or d.finish_reason else None

        return [e async for e in sse_stream(stream, HEADER, n, include_usage, make_choice, opening_choices)]

    raw = asyncio.run(run())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in raw)
    return [e[len("data: "):-2] if e == "data: [DONE]\n\n" else json.loads(e[len("data: "):-2]) for e in raw]


def test_chunks_then_done_and_invisible_deltas_are_skipped():
    out = events([delta(0, "a"), delta(0, ""), delta(0, "b", FinishReason.STOP, 3)])
    assert out == [{**HEADER, "choices": [{"index": 0, "text": "a"}]},
                   {**HEADER, "choices": [{"index": 0, "text": "b"}]}, "[DONE]"]


def test_usage_chunk_before_done_and_usage_null_on_the_others():
    out = events([delta(0, "a", FinishReason.LENGTH, 2), delta(1, "b", FinishReason.LENGTH, 4)], n=2,
                 include_usage=True, opening_choices=[{"index": 0, "role": "assistant"}])
    assert out[0] == {**HEADER, "choices": [{"index": 0, "role": "assistant"}], "usage": None}
    assert [e["usage"] for e in out[1:3]] == [None, None]
    assert out[3]["choices"] == [] and out[3]["usage"]["completion_tokens"] == 6
    assert out[3]["usage"]["prompt_tokens"] == 3  # the n choices of one prompt count it once
    assert out[4] == "[DONE]"


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_failed_request_ends_with_an_error_event_then_done(include_usage):
    out = events([delta(0, "a"), EngineDeadError("the engine died")], include_usage=include_usage)
    assert out[-2] == {"error": {"message": "the engine died", "type": "service_unavailable", "code": 503}}
    assert out[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and e.get("choices") == [] for e in out)  # no usage after a failure
