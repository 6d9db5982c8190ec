"""Multi-turn chat over HTTP for bench_serving: each conversation resends its history.

    conversation c:  turn 0  [u0]                              -> reply r0
                     turn 1  [u0 r0' u1]                        -> reply r1
                     turn 2  [u0 r0' u1 r1' u2]                 -> reply r2
                     (r' = the reply's text, tokenized again by the client)

A turn is sent only once the previous turn's answer has fully arrived; conversations
start together (--request-rate inf) or on Poisson arrivals, and run side by side. The
prompts are token-id lists (workload.make_multi_turn_workload's user turns), so a
server with prefix caching finds the whole previous prompt in its cache, and the reply's
blocks too where its re-tokenized text gives back the ids it generated. That is what a
chat client does: it holds text, not the server's token ids, so this is the hit rate a
real client sees, not the ceiling bench_offline's multi_turn (exact ids) shows.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from scripts.lib.bench_metrics import RequestTrace
from scripts.lib.workload import Conversation, WorkloadRequest

# send(request) -> the trace of one streamed completion, its text included
SendFn = Callable[[WorkloadRequest], Awaitable[RequestTrace]]


async def run_conversations(conversations: list[Conversation], send: SendFn, tokenizer, request_rate: float,
                            seed: int, on_done: Callable[[], None] = lambda: None) -> list[list[RequestTrace]]:
    """Every conversation's traces, turn by turn; a failed turn ends its conversation
    (the history it would resend is unknown)."""
    rng = random.Random(seed)

    async def converse(conversation: Conversation, delay_s: float) -> list[RequestTrace]:
        await asyncio.sleep(delay_s)
        history: list[int] = []
        traces = []
        for user_turn in conversation.user_turns:
            request = WorkloadRequest(history + user_turn, conversation.max_tokens)
            trace = await send(request)
            traces.append(trace)
            on_done()
            if not trace.is_success:
                break
            history = request.prompt_token_ids + tokenizer.encode(trace.text, add_special_tokens=False)
        return traces

    delays, start = [], 0.0
    for i in range(len(conversations)):
        if i > 0 and request_rate != float("inf"):
            start += rng.expovariate(request_rate)  # Poisson arrivals of new conversations
        delays.append(start)
    return list(await asyncio.gather(*(converse(c, d) for c, d in zip(conversations, delays))))


def cached_share_by_turn(conversations: list[list[RequestTrace]]) -> list[float | None]:
    """Cached prompt tokens over prompt tokens at each turn index, over the conversations
    that reached it; None where the server reports no cached tokens."""
    num_turns = max((len(c) for c in conversations), default=0)
    shares = []
    for turn in range(num_turns):
        traces = [c[turn] for c in conversations if len(c) > turn and c[turn].is_success]
        reported = [t for t in traces if t.num_cached_tokens is not None]
        num_prompt = sum(t.num_prompt_tokens for t in reported)
        shares.append(sum(t.num_cached_tokens for t in reported) / num_prompt if reported and num_prompt else None)
    return shares
