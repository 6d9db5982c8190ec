"""Prompt tokenizing off the event loop, and the size cap checked before any tokenizing."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontend.errors import InvalidRequestError
from frontend.prompt_tokenizer import PromptTokenizer
from ipc.text.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. " * 24_000  # ~1 MiB


async def max_loop_gap(work) -> tuple[float, object]:
    """The longest the event loop went without running a 5 ms ticker while `work` ran."""
    gaps, last = [], time.monotonic()
    done = False

    async def tick():
        nonlocal last
        while not done:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        result = await work
    finally:
        done = True
        await ticker
    return max(gaps), result


def test_tokenizing_a_big_prompt_leaves_the_event_loop_free(model_folder):
    tokenizer = Tokenizer(model_folder)
    prompts = PromptTokenizer(tokenizer)  # no cap yet: the whole MiB is tokenized

    async def main():
        started = time.monotonic()
        gap, ids = await max_loop_gap(asyncio.gather(prompts.encode(TEXT), prompts.encode(TEXT)))
        return gap, ids, time.monotonic() - started

    gap, (ids, ids_again), elapsed = asyncio.run(main())
    prompts.shutdown()
    assert ids == ids_again == tokenizer._tokenizer.encode(TEXT).ids
    # A blocking encode would stall the loop for a whole encode, half of `elapsed`; off the loop
    # the longest stall is scheduling noise (loose bound: other processes share these cores).
    assert elapsed > 0.2 and gap < elapsed / 5, (gap, elapsed)


def test_prompts_too_big_for_any_context_are_refused_before_tokenizing(model_folder):
    tokenizer = Tokenizer(model_folder)
    prompts = PromptTokenizer(tokenizer)
    prompts.set_max_model_len(1024)
    assert prompts.max_prompt_bytes == 1024 * tokenizer.max_token_bytes
    # The bound is safe: no token stands for more bytes than max_token_bytes.
    vocab = tokenizer._tokenizer.get_vocab(True)
    assert all(len(tokenizer.decode([i], skip_special_tokens=False).encode()) <= tokenizer.max_token_bytes
               for i in vocab.values())

    async def main():
        fits = "fox " * 100
        assert len(await prompts.encode(fits)) > 0
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match="more than this model's context"):
            await prompts.encode(TEXT)
        with pytest.raises(InvalidRequestError, match="more than this model's context"):
            await prompts.encode_chat([{"role": "user", "content": TEXT}], True)
        return time.monotonic() - started

    assert asyncio.run(main()) < 0.1  # refused at once: nothing was tokenized
    prompts.shutdown()
