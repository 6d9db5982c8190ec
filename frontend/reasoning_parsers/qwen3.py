"""`--reasoning-parser qwen3`: Qwen3 writes `<think>` itself when it thinks.

An answer that opens with `<think>` is reasoning up to `</think>`, then content; one
that does not (thinking off, or a model that never thinks) is all content, `</think>`
or not, as vLLM's qwen3 parser streams it. A template that opens the tag in the
prompt (Qwen3-2507 thinking models) is read from the prompt (`ReasoningPrompt`).
"""

from __future__ import annotations

from frontend.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    implicit_reasoning = False
