"""Prompt tokenizing off the event loop, at a cost bounded by the context length, not the body size.

Tokenizing a 1 MiB prompt takes most of a second. On the event loop that second
stalls every stream, `/health` and the engine output pumps; so text is encoded in
worker threads, through the Rust tokenizer's batch call, which releases the GIL
(a plain `encode` holds it throughout, and the loop would stall just the same).
The threads run at a lower scheduling priority (nice +10): on a small machine they
share cores with the engine's matmul threads, and under abuse they must lose.

Three bounds, cheapest first:
- A prompt whose UTF-8 size is over `max_model_len x longest token` cannot fit in
  the context whatever it says: refused before any tokenizing.
- A long prompt is first counted slice by slice, stopping as soon as the count is
  past the context: refusing it costs about one context's worth of tokenizing. A
  prompt that fits is then tokenized whole, exactly as before (its ids never depend
  on the slices).
- A request's prompts share one budget (`TokenBudget`, --max-request-prompt-tokens, by
  default two contexts' worth): a list of a thousand prompts stops at the first one over it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend.errors import InvalidRequestError
from ipc.text.tokenizer import TemplateError, Tokenizer

logger = logging.getLogger(__name__)

NUM_TOKENIZE_THREADS = 2
THREAD_NICENESS = 10
SLICE_CHARS = 16_384  # prompts longer than this are counted slice by slice first
# Cutting text can change its tokens next to the cut: a slice may add a few. Only a count
# past the limit by more than this per cut refuses, so a prompt that fits is never refused.
SLACK_TOKENS_PER_CUT = 8
NUM_CONTEXTS_PER_REQUEST = 2  # TokenBudget by default: all of a request's prompts together


class TokenBudget:
    """The prompt tokens one request may still spend over all its prompts."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens_left = num_tokens
        self.limit = num_tokens

    def spend(self, num_tokens: int) -> None:
        self.num_tokens_left -= num_tokens
        if self.num_tokens_left < 0:
            raise InvalidRequestError(f"the request's prompts hold more than {self.limit} tokens together; "
                                      "send fewer or shorter prompts per request")


class PromptTokenizer:
    """Async `encode` / `encode_chat` on a small thread pool, each refusing the hopeless early."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int = NUM_TOKENIZE_THREADS,
                 max_request_prompt_tokens: int = 0):
        self.tokenizer = tokenizer
        self.max_prompt_bytes = 0  # 0: no cap until the context length is known
        self.max_model_len = 0
        self.max_request_prompt_tokens = max_request_prompt_tokens  # 0: NUM_CONTEXTS_PER_REQUEST contexts
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize",
                                        initializer=_lower_priority)

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_model_len * self.tokenizer.max_token_bytes

    def new_budget(self) -> TokenBudget | None:
        limit = self.max_request_prompt_tokens or NUM_CONTEXTS_PER_REQUEST * self.max_model_len
        return TokenBudget(limit) if limit else None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_size(text)
        return await self._run(self._encode_bounded, text, add_special_tokens)

    async def encode_prediction(self, text: str) -> list[int]:
        """OpenAI's `prediction` text as tokens of the answer (no special tokens), under the same
        bounds as a prompt, refused naming the field."""
        self.check_size(text, what="prediction")
        return await self._run(self._encode_bounded, text, False, "prediction")

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """A request's prompts (texts or token ids) in one worker call, under one TokenBudget:
        a list of a thousand prompts costs one hop off the loop and stops at the budget."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_size(prompt)
        # One prompt is bounded by the context alone (and refused with that reason).
        return await self._run(self._encode_prompts, prompts, self.new_budget() if len(prompts) > 1 else None)

    def _encode_prompts(self, prompts: list[str | list[int]], budget: TokenBudget | None) -> list[list[int]]:
        token_ids_list = []
        for prompt in prompts:
            token_ids = list(prompt) if not isinstance(prompt, str) else self._encode_bounded(prompt, True)
            if budget is not None:
                budget.spend(len(token_ids))
            token_ids_list.append(token_ids)
        return token_ids_list

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        self.check_size(*(m.get("content") for m in messages))
        try:
            text = await self._run(self.tokenizer.apply_chat_template, messages, add_generation_prompt, tools,
                                   template_kwargs)
        except TemplateError as e:
            raise InvalidRequestError(str(e)) from None
        # The template writes the special tokens itself (Tokenizer.encode_chat).
        return await self._run(self._encode_bounded, text, False)

    def check_size(self, *texts: Any, what: str = "prompt") -> None:
        """Refuse text that cannot fit the context: a cheap upper bound on its tokens. `what` names it."""
        if not self.max_prompt_bytes:
            return
        num_chars = sum(len(t) for t in texts if isinstance(t, str))
        # Characters first (no copy): a character is 1-4 bytes, so only near the cap
        # is it worth encoding to count the bytes.
        if num_chars * 4 <= self.max_prompt_bytes:
            return
        num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"the {what} is {num_bytes} bytes long, more than this model's context of tokens could hold "
                f"({self.max_prompt_bytes} bytes); shorten it")

    def _encode_bounded(self, text: str, add_special_tokens: bool, what: str = "prompt") -> list[int]:
        """On a worker: refuse a long text once its sliced count passes the context, else encode it whole."""
        if self.max_model_len and len(text) > SLICE_CHARS:
            num_tokens, num_cuts = count_tokens_until(self.tokenizer, text, self.max_model_len)
            if num_tokens >= self.max_model_len + SLACK_TOKENS_PER_CUT * num_cuts:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, the {what} "
                    f"holds more than {num_tokens} tokens (counting stopped there). Please shorten the {what}.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def count_tokens_until(tokenizer: Tokenizer, text: str, limit: int) -> tuple[int, int]:
    """(tokens counted, cuts made): `text` tokenized in slices of about SLICE_CHARS, each cut
    where a space begins a word (so the cut seldom splits a token), stopping once the count
    passes `limit` plus the slack for the cuts so far."""
    num_tokens, num_cuts, start = 0, 0, 0
    while start < len(text):
        end = min(start + SLICE_CHARS, len(text))
        if end < len(text):
            space = text.rfind(" ", start + SLICE_CHARS // 2, end)
            end = space if space > start else end
            num_cuts += 1
        num_tokens += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if num_tokens >= limit + SLACK_TOKENS_PER_CUT * num_cuts:
            break
        start = end
    return num_tokens, num_cuts


def _lower_priority() -> None:
    """Each tokenizing thread yields the cores to the engine and the event loop (Linux: per-thread nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), THREAD_NICENESS)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed
        logger.debug("tokenizer threads keep their priority: %s", e)
