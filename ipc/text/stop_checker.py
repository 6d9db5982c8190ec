"""Stop strings over a stream of text deltas.

A stop string may arrive split across deltas ("<|e" then "nd|>"), so text that
could be the start of a stop string is held back until the next delta shows
whether it is one; held text is never streamed and then retracted.

"First stop" means the occurrence that is complete earliest in the text (the
smallest end index; on a tie, the longer one). This is the only rule a stream
can apply without waiting: as soon as a stop string is complete we know no
other one can finish before it, so the request can be stopped at once, and the
result does not depend on how the text was split into deltas.
"""

import logging

from ipc.text.hold_back import num_held_chars

logger = logging.getLogger(__name__)


class StopChecker:
    """Cuts streamed text at the first stop string."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        # An empty stop string would match everywhere; treat it as absent.
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held_text = ""
        self.is_stopped = False

    def process(self, new_text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.is_stopped:
            return "", True
        if not self.stop:
            return new_text, False
        # Only the held tail plus the new delta can hold a new occurrence, so
        # the search is O(len(new_text) + longest stop string).
        text = self._held_text + new_text
        match = self._find_first_stop(text)
        if match is not None:
            start, stop_str = match
            self.is_stopped = True
            self._held_text = ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            logger.debug("stop string %r hit", stop_str)
            return text[:end], True
        num_hold_chars = num_held_chars(text, self.stop)
        cut = len(text) - num_hold_chars
        self._held_text = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """Return the held-back text at the end of the stream (none after a stop)."""
        out, self._held_text = self._held_text, ""
        return "" if self.is_stopped else out

    def _find_first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            # A string's earliest start is also its earliest end.
            start = text.find(stop_str)
            if start != -1:
                candidate = (start + len(stop_str), start, stop_str)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else (best[1], best[2])
