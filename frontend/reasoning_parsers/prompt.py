"""The server's reasoning parser bound to the model's tokenizer: where a prompt leaves the
answer (inside the reasoning, after it, or undecided), and the end tag's token ids for the
engine, which holds a grammar back until the answer has written them.

A prompt's state is its last tag, as vLLM's `is_reasoning_end` reads the prompt: an open
`<think>` (a template that starts the thinking) puts the answer inside the reasoning; a
`</think>` after it (Qwen3's `enable_thinking: false`) puts it after; no tag decides
nothing. The prompt is decoded with its special tokens, so the tags are found whether
the vocabulary has them as single tokens (reasoning models) or spells them in pieces.
"""

from __future__ import annotations

import logging

from msgspec.structs import replace

from frontend.reasoning_parsers.base import ReasoningParser, ReasoningState
from ipc.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)


class ReasoningPrompt:
    def __init__(self, parser_class: type[ReasoningParser], tokenizer) -> None:
        self.parser_class = parser_class
        self._tokenizer = tokenizer
        # The grammar waits for these in the output; a reasoning model's vocabulary has the tag as one token.
        self.end_token_ids = tokenizer.encode(parser_class.end_tag, add_special_tokens=False)
        logger.info("reasoning parser %s: %r is token ids %s", parser_class.__name__, parser_class.end_tag,
                    self.end_token_ids)

    def state_after(self, prompt_token_ids: list[int]) -> ReasoningState:
        """Where the answer to this prompt starts."""
        text = self._tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        start = text.rfind(self.parser_class.start_tag)
        end = text.rfind(self.parser_class.end_tag)
        if end >= 0 and end > start:
            return ReasoningState.CONTENT
        return ReasoningState.REASONING if start >= 0 else ReasoningState.OPENING

    def new_parser(self, state: ReasoningState) -> ReasoningParser:
        return self.parser_class(state)

    def hold_grammar(self, params: StructuredOutputsParams | None,
                     state: ReasoningState) -> StructuredOutputsParams | None:
        """The grammar to send: one that waits for the end of the reasoning, unless the prompt ended it."""
        if params is None or state == ReasoningState.CONTENT:
            return params
        return replace(params, reasoning_end_token_ids=list(self.end_token_ids))
