"""`--reasoning-parser deepseek_r1`: DeepSeek-R1's template writes `<think>` into the prompt.

So an answer is reasoning up to `</think>` even when it does not open with `<think>`
(a leading one is dropped), then content; an answer without `</think>` (cut by
max_tokens, or a model that does not think) is all reasoning, as vLLM's deepseek_r1
parser reads it.
"""

from __future__ import annotations

from frontend.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_reasoning = True
