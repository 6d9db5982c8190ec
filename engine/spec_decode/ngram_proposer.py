"""Prompt lookup (n-gram) proposals: what followed the sequence's last n tokens where they occurred before.

    tokens   ... def add(a, b):\n    return a + b ... | def add(a, b):      <- the output copies the prompt
    suffix   "add(a, b):" (n = 4 tokens) found earlier; propose the k tokens that followed it there

The longest suffix (prompt_lookup_max tokens) is tried first, down to prompt_lookup_min; the
leftmost occurrence wins, as vLLM's prompt lookup does. The search runs in C: tokens become a
bytes string of 4-byte ids and `bytes.find` scans it.
"""

from __future__ import annotations

from array import array

_ID_BYTES = 4


def find_after(haystack: list[int], suffix: list[int], end: int | None = None) -> int | None:
    """The index just after the leftmost occurrence of `suffix` in haystack[:end] that is followed
    by a token before `end`; None when there is none."""
    end = len(haystack) if end is None else end
    if not suffix or len(suffix) >= end:
        return None
    data = array("i", haystack[:end]).tobytes()
    needle = array("i", suffix).tobytes()
    offset = data.find(needle)
    while offset != -1:
        if offset % _ID_BYTES == 0:  # else a match across id boundaries: not a match
            start = offset // _ID_BYTES + len(suffix)
            return start if start < end else None
        offset = data.find(needle, offset + 1)
    return None


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed tokens after `token_ids` (the request's prompt and output)."""
    if num_tokens <= 0:
        return []
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        # The suffix itself sits at the end: search before it so it never finds itself.
        start = find_after(token_ids, token_ids[-n:], end=len(token_ids) - 1)
        if start is not None:
            return token_ids[start : start + num_tokens]
    return []
