"""Reasoning parsers (frontend/reasoning_parsers) on recorded answers: whole, and streamed
split at every character boundary and character by character, so the tags arrive in
pieces; where a prompt leaves the answer; the grammar held for the engine."""

from __future__ import annotations

import pytest

from frontend.reasoning_parsers import (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningPrompt, ReasoningState, get_reasoning_parser,
)
from ipc.structured_outputs import StructuredOutputsParams
from ipc.text.tokenizer import Tokenizer

# Answers as the models write them (Qwen3-8B thinking; DeepSeek-R1-Distill, whose template opened <think>).
QWEN3_THINKING = "<think>\nOkay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3_TOOL = ('<think>\nI should call get_weather for Paris.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
R1_ANSWER = "Okay, so I need to add 2 and 2. That gives 4.\n</think>\n\n2 + 2 = **4**."
PLAIN = "The capital of France is Paris."

# (parser, answer, (reasoning, content)) as vLLM's parsers read them
CASES = [
    (Qwen3ReasoningParser, QWEN3_THINKING, ("\nOkay, the user asks for 2 + 2. That is 4.\n", "\n\nThe answer is **4**.")),
    (Qwen3ReasoningParser, QWEN3_TOOL, ("\nI should call get_weather for Paris.\n", QWEN3_TOOL.split("</think>")[1])),
    (Qwen3ReasoningParser, PLAIN, (None, PLAIN)),  # no <think>: all content
    (Qwen3ReasoningParser, "<think>\ncut short by max_tokens", ("\ncut short by max_tokens", None)),
    (Qwen3ReasoningParser, "<think>\n\n</think>\n\nHi", ("\n\n", "\n\nHi")),
    (Qwen3ReasoningParser, "a < b and <thin ice>", (None, "a < b and <thin ice>")),
    (Qwen3ReasoningParser, "<thi", (None, "<thi")),  # a start tag never completed is text
    (DeepSeekR1ReasoningParser, R1_ANSWER, ("Okay, so I need to add 2 and 2. That gives 4.\n", "\n\n2 + 2 = **4**.")),
    (DeepSeekR1ReasoningParser, "<think>" + R1_ANSWER, ("Okay, so I need to add 2 and 2. That gives 4.\n",
                                                        "\n\n2 + 2 = **4**.")),
    (DeepSeekR1ReasoningParser, PLAIN, (PLAIN, None)),  # no </think>: all reasoning (the template opened it)
    (DeepSeekR1ReasoningParser, "thinking</think>", ("thinking", None)),  # stopped right after: null content
    (DeepSeekR1ReasoningParser, "x </think", ("x </think", None)),  # an end tag never completed is reasoning
    (DeepSeekR1ReasoningParser, "a</think>b</think>c", ("a", "b</think>c")),  # only the first ends it
]
IDS = [f"{parser.__name__[:5]}-{i}" for i, (parser, _, _) in enumerate(CASES)]


def streamed(parser, deltas: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def as_joined(expected: tuple[str | None, str | None]) -> tuple[str, str]:
    return expected[0] or "", expected[1] or ""


@pytest.mark.parametrize("parser_class, text, expected", CASES, ids=IDS)
def test_whole_answers(parser_class, text, expected):
    assert parser_class().extract(text) == expected


@pytest.mark.parametrize("parser_class, text, expected", CASES, ids=IDS)
def test_streamed_split_at_every_boundary_and_char_by_char(parser_class, text, expected):
    for cut in range(len(text) + 1):
        assert streamed(parser_class(), [text[:cut], text[cut:]]) == as_joined(expected), cut
    assert streamed(parser_class(), list(text)) == as_joined(expected)


def test_no_delta_holds_more_than_a_tags_length():
    """Text streams as it comes: only what may still be a tag waits."""
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("step one, step two </th") == ("step one, step two ", "")
    assert parser.feed("ink>\n\nAnswer") == ("", "\n\nAnswer")
    parser = Qwen3ReasoningParser()
    assert parser.feed("  <th") == ("", "")
    assert parser.feed("ink>why") == ("why", "")
    assert parser.feed("</think>so") == ("", "so")


@pytest.mark.parametrize("parser_class", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_the_prompts_state_decides_where_the_answer_starts(parser_class):
    assert parser_class(ReasoningState.REASONING).extract(PLAIN) == (PLAIN, None)  # the template opened <think>
    assert parser_class(ReasoningState.REASONING).extract("why</think>so") == ("why", "so")
    assert parser_class(ReasoningState.CONTENT).extract("<think>x</think>y") == (None, "<think>x</think>y")


def test_unknown_names_are_refused_naming_the_known_ones():
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


def test_the_prompt_state_and_the_grammar_held_for_the_engine(model_folder):
    tokenizer = Tokenizer(model_folder)
    reasoning = ReasoningPrompt(Qwen3ReasoningParser, tokenizer)
    assert tokenizer.decode(reasoning.end_token_ids) == "</think>"

    def state(text: str) -> ReasoningState:
        return reasoning.state_after(tokenizer.encode(text, add_special_tokens=False))

    assert state("<|im_start|>assistant\n") == ReasoningState.OPENING
    assert state("<|im_start|>assistant\n<think>\n") == ReasoningState.REASONING
    assert state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ReasoningState.CONTENT  # enable_thinking off
    grammar = StructuredOutputsParams(regex="[0-9]+")
    held = reasoning.hold_grammar(grammar, ReasoningState.OPENING)
    assert held.reasoning_end_token_ids == reasoning.end_token_ids and held.regex == grammar.regex
    assert grammar.reasoning_end_token_ids is None  # the request's own params are left as they were
    assert reasoning.hold_grammar(grammar, ReasoningState.CONTENT) is grammar  # the prompt ended the reasoning
    assert reasoning.hold_grammar(None, ReasoningState.REASONING) is None
