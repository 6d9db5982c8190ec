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


def encode(token_ids: list[int]) -> bytes:
    """The ids as one bytes string, 4 bytes an id, for find_after to scan."""
    return array("i", token_ids).tobytes()


def find_after(haystack: list[int], suffix: list[int], end: int | None = None, start: int = 0,
               last: bool = False, encoded: bytes | None = None) -> int | None:
    """The index just after an occurrence of `suffix` within haystack[start:end] that is followed by
    a token before `end` (the leftmost one, or the rightmost with `last`); None when there is none.
    `encoded`: encode(haystack), where the caller searches the same tokens more than once."""
    end = len(haystack) if end is None else end
    if not suffix or len(suffix) >= end - start:
        return None
    data = encode(haystack) if encoded is None else encoded
    needle = encode(suffix)
    low, high = start * _ID_BYTES, end * _ID_BYTES
    if last:  # the rightmost match must leave a token after it: it ends before the last id
        offset = data.rfind(needle, low, high - _ID_BYTES)
    else:
        offset = data.find(needle, low, high)
    while offset != -1:
        if offset % _ID_BYTES == 0:  # else a match across id boundaries: not a match
            after = offset // _ID_BYTES + len(suffix)
            return after if after < end else None
        offset = data.rfind(needle, low, offset + len(needle) - 1) if last else data.find(needle, offset + 1, high)
    return None


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed tokens after `token_ids` (the request's prompt and output)."""
    if num_tokens <= 0:
        return []
    encoded = encode(token_ids)  # once for every n tried
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        # The suffix itself sits at the end: search before it so it never finds itself.
        start = find_after(token_ids, token_ids[-n:], end=len(token_ids) - 1, last=True, encoded=encoded)
        if start is not None:
            return token_ids[start : start + num_tokens]
    return []
