"""Prompt tokenizing off the event loop, with a size cap checked before any work.

Tokenizing a 1 MiB prompt takes most of a second. On the event loop that second
stalls every stream, `/health` and the engine output pumps; so text is encoded in
worker threads, through the Rust tokenizer's batch call, which releases the GIL
(a plain `encode` holds it throughout, and the loop would stall just the same).

A prompt whose UTF-8 size is over `max_model_len x longest token` cannot fit in
the context whatever it says, so it is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend.errors import InvalidRequestError
from ipc.text.tokenizer import TemplateError, Tokenizer

NUM_TOKENIZE_THREADS = 2


class PromptTokenizer:
    """Async `encode` / `encode_chat` on a small thread pool; `max_prompt_bytes` refuses the hopeless."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int = NUM_TOKENIZE_THREADS):
        self.tokenizer = tokenizer
        self.max_prompt_bytes = 0  # 0: no cap until the context length is known
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize")

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_prompt_bytes = max_model_len * self.tokenizer.max_token_bytes

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_size(text)
        return await self._run(self.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        self.check_size(*(m.get("content") for m in messages))
        try:
            return await self._run(self.tokenizer.encode_chat, messages, add_generation_prompt, tools)
        except TemplateError as e:
            raise InvalidRequestError(str(e)) from None

    def check_size(self, *texts: Any) -> None:
        """Refuse text that cannot fit the context: a cheap upper bound on its tokens."""
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
                f"the prompt is {num_bytes} bytes long, more than this model's context of tokens could hold "
                f"({self.max_prompt_bytes} bytes); shorten it")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
