"""One request's grammar: waiting for its compile, then a matcher that follows its tokens.

The matcher advances only on tokens the request accepts, never on recomputed ones,
so preemption and prefix caching leave it as it is. A compile that fails or takes
longer than `compile_timeout_s`, or a token the matcher rejects, fails this
request alone.

With `reasoning_end_token_ids` (a server with --reasoning-parser) the grammar is
dormant while the model reasons: no mask, the matcher unmoved, until the output's
token ids end with that sequence ("</think>"); it constrains from the next token on:

    output:   <think> ... reasoning ... </think> { "name": ...
    grammar:  dormant ------------------------- | mask, accept ...
"""

from __future__ import annotations

import time
from concurrent.futures import Future

DEFAULT_COMPILE_TIMEOUT_S = 30.0


class GrammarError(RuntimeError):
    """The grammar cannot constrain this request: what went wrong, for the client."""


class RequestGrammar:
    def __init__(self, future: Future, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 reasoning_end_token_ids: list[int] | None = None) -> None:
        self._future = future
        self._reasoning_end = list(reasoning_end_token_ids or [])
        self._recent_token_ids: list[int] = []  # the output's last len(_reasoning_end) tokens, while dormant
        self.is_dormant = bool(self._reasoning_end)
        self._deadline = time.monotonic() + compile_timeout_s
        self._compile_timeout_s = compile_timeout_s
        self.matcher = None
        self.error: str | None = None

    @property
    def is_ready(self) -> bool:
        """Compiled, with a matcher: the request may be scheduled."""
        if self.matcher is None and self.error is None and self._future.done():
            self._start()
        return self.matcher is not None

    def check(self) -> str | None:
        """The error that fails this request (a failed or overdue compile), or None."""
        if self.is_ready or self.error is not None:
            return self.error
        if time.monotonic() > self._deadline:
            self._future.cancel()
            self.error = f"the grammar did not compile within {self._compile_timeout_s:g} s"
        return self.error

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and not self.is_dormant and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance on the request's new token; False (and `error` set) when the grammar rejects it."""
        if self.is_dormant:
            self._watch_for_reasoning_end(token_id)
            return True
        if self.matcher.is_terminated():
            return True  # the stop token that ended it has been accepted already
        if not self.matcher.accept_token(token_id):
            self.error = f"the grammar rejected token {token_id}"
            return False
        return True

    def _watch_for_reasoning_end(self, token_id: int) -> None:
        self._recent_token_ids.append(token_id)
        del self._recent_token_ids[:-len(self._reasoning_end)]
        if self._recent_token_ids == self._reasoning_end:
            self.is_dormant = False  # the next token is the answer's first

    def _start(self) -> None:
        import xgrammar

        try:
            compiled = self._future.result()
        except Exception as e:  # xgrammar's reason, for the client
            self.error = f"the grammar did not compile: {e}"
            return
        self.matcher = xgrammar.GrammarMatcher(compiled)
