"""What every reasoning parser shares: one state machine that splits a chat answer into
its reasoning (`<think>...</think>`) and its content, whole or delta by delta.

vLLM's `--reasoning-parser` semantics (vllm/reasoning/basic_parsers.py and the
qwen3 / deepseek_r1 parsers): an answer may open with the start tag; whatever
comes before the end tag is then reasoning and whatever follows it is content.
The parsers differ in what an answer that does not open with the tag means
(`implicit_reasoning`): DeepSeek-R1's template writes `<think>` into the prompt, so
its text is reasoning until `</think>`; Qwen3 writes the tag itself, so without it
the answer is all content.

The prompt can settle that first (`ReasoningPrompt`): a chat template that opens
`<think>` in the prompt (Qwen3-2507 thinking, R1-0528) makes the answer start inside
the reasoning; one that closes it (Qwen3's `enable_thinking: false`, which writes
`<think>\\n\\n</think>\\n\\n`) makes it all content.

`extract` feeds the whole text to a fresh instance, so a streamed answer and a
non-streamed one can never disagree, however the text was split. Tags split across
deltas are held back until they are whole or cannot be a tag any more.
"""

from __future__ import annotations

import enum
from abc import ABC

from ipc.text.hold_back import num_held_chars


class ReasoningState(enum.IntEnum):
    OPENING = 0  # nothing decided: the answer may still open with the start tag
    REASONING = 1
    CONTENT = 2  # the reasoning has ended (or never began): the rest is content


class ReasoningParser(ABC):
    """One answer's parser: `feed` deltas, then `finish`; or `extract` a whole text."""

    start_tag = "<think>"
    end_tag = "</think>"
    implicit_reasoning: bool  # an answer that does not open with start_tag starts inside the reasoning

    def __init__(self, state: ReasoningState = ReasoningState.OPENING) -> None:
        self.initial_state = state
        self.state = state
        self.has_reasoning = state == ReasoningState.REASONING  # whether a reasoning part exists (maybe empty)
        self._held = ""  # text that may be the start of a tag

    def fresh(self) -> ReasoningParser:
        """A new instance in this one's initial state."""
        return type(self)(self.initial_state)

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning text, content text) to stream now."""
        text, self._held = self._held + delta_text, ""
        reasoning = ""
        if self.state == ReasoningState.OPENING:
            text = self._open(text)
            if self.state == ReasoningState.OPENING:
                return "", ""
        if self.state == ReasoningState.REASONING:
            before, tag, after = text.partition(self.end_tag)
            if not tag:
                num_held = num_held_chars(text, (self.end_tag,))
                self._held = text[len(text) - num_held:]
                return text[:len(text) - num_held], ""
            reasoning, text = before, after
            self.state = ReasoningState.CONTENT
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the answer: a tag never completed is text."""
        held, self._held = self._held, ""
        if self.state == ReasoningState.OPENING:
            self._enter(ReasoningState.REASONING if self.implicit_reasoning else ReasoningState.CONTENT)
        return (held, "") if self.state == ReasoningState.REASONING else ("", held)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """The whole answer -> (reasoning, or None when there is none; content, or None when empty)."""
        parser = self.fresh()
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not parser.has_reasoning:
            return None, content
        return reasoning, content or None  # as vLLM: an answer that stops after "</think>" has null content

    def _open(self, text: str) -> str:
        """In OPENING: consume a leading start tag, decide, or hold everything back; the text left."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            self._enter(ReasoningState.REASONING)
            return stripped[len(self.start_tag):]
        if not stripped or self.start_tag.startswith(stripped):
            self._held = text  # whitespace, or a start tag arriving in pieces
            return ""
        self._enter(ReasoningState.REASONING if self.implicit_reasoning else ReasoningState.CONTENT)
        return text

    def _enter(self, state: ReasoningState) -> None:
        self.state = state
        self.has_reasoning = self.has_reasoning or state == ReasoningState.REASONING
