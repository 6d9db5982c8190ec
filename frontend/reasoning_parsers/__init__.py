"""Reasoning parsers for chat completions, by name as vLLM's `--reasoning-parser` takes it.

Pure Python (the frontend never imports torch). A parser splits an answer into
`reasoning_content` (the `<think>...</think>` part) and `content`, whole (`extract`)
or delta by delta (`feed`/`finish`); see `base.py`. `ReasoningPrompt` binds the
server's parser to the tokenizer: the answer's starting state from the prompt, and
the end tag's token ids that hold a grammar back until the reasoning is over.
"""

from __future__ import annotations

from frontend.reasoning_parsers.base import ReasoningParser, ReasoningState
from frontend.reasoning_parsers.prompt import ReasoningPrompt


class DeepSeekR1ReasoningParser(ReasoningParser):
    """`deepseek_r1`: the template writes `<think>` into the prompt, so an answer is reasoning up to
    `</think>` (a leading `<think>` is dropped); one without `</think>` (cut by max_tokens) is all
    reasoning, as vLLM's deepseek_r1 parser reads it."""

    implicit_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """`qwen3`: the model writes `<think>` itself, so an answer that does not open with it is all
    content, `</think>` or not, as vLLM's qwen3 parser streams it; a template that opens the tag in
    the prompt (Qwen3-2507 thinking) is read from the prompt (`ReasoningPrompt`)."""

    implicit_reasoning = False


_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
REASONING_PARSER_NAMES = tuple(_REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; make one instance per answer."""
    try:
        return _REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSER_NAMES)}") from None


__all__ = ["REASONING_PARSER_NAMES", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "ReasoningPrompt", "ReasoningState", "get_reasoning_parser"]
