"""Prompt lookup (n-gram) proposals: what followed the sequence's last n tokens where they occurred before.

    tokens   ... def add(a, b):\n    return a + b ... | def add(a, b):      <- the output copies the prompt
    suffix   "add(a, b):" (n = 4 tokens) found earlier; propose the k tokens that followed it there

The longest suffix (prompt_lookup_max tokens) is tried first, down to prompt_lookup_min; the
rightmost (latest) occurrence wins. vLLM takes the leftmost; the latest predicts better where an
answer repeats its own recent lines, and a text copied from the prompt usually occurs there once.
The search runs in C: tokens become a bytes string of 4-byte ids and `bytes.rfind` scans it.
"""

from __future__ import annotations

from array import array

_ID_BYTES = 4


def find_after(haystack: list[int], suffix: list[int], end: int | None = None, start: int = 0,
               last: bool = False) -> int | None:
    """The index just after an occurrence of `suffix` within haystack[start:end] that is followed by
    a token before `end` (the leftmost one, or the rightmost with `last`); None when there is none."""
    end = len(haystack) if end is None else end
    if not suffix or len(suffix) >= end - start:
        return None
    data = array("i", haystack[start:end]).tobytes()
    needle = array("i", suffix).tobytes()
    search = data.rfind if last else data.find
    # The rightmost match must leave a token after it: search the bytes before the last id.
    offset = search(needle, 0, len(data) - _ID_BYTES) if last else search(needle)
    while offset != -1:
        if offset % _ID_BYTES == 0:  # else a match across id boundaries: not a match
            after = start + offset // _ID_BYTES + len(suffix)
            return after if after < end else None
        offset = data.rfind(needle, 0, offset + len(needle) - 1) if last else data.find(needle, offset + 1)
    return None


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed tokens after `token_ids` (the request's prompt and output)."""
    if num_tokens <= 0:
        return []
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        # The suffix itself sits at the end: search before it so it never finds itself.
        start = find_after(token_ids, token_ids[-n:], end=len(token_ids) - 1, last=True)
        if start is not None:
            return token_ids[start : start + num_tokens]
    return []
