"""How much of a streamed text's tail to hold back because it may be the start of a marker.

A stop string, a tool-call tag or a reasoning tag can arrive split across deltas
("<too" then "l_call>"); the tail that could still grow into one is held until the
next delta shows whether it does, so text is never streamed and then retracted.
The stop checker, the tool parsers and the reasoning parsers all hold back this way.

    num_held_chars("answer: <tool", ["<tool_call>"])  # 5: "<tool" may become the tag
"""

from __future__ import annotations

from collections.abc import Sequence


def num_held_chars(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers` (0 if none)."""
    longest = max((len(marker) for marker in markers), default=1) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(len(marker) > n and marker.startswith(tail) for marker in markers):
            return n
    return 0
