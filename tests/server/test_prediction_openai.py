"""OpenAI's `prediction` through the `openai` client against the real server on the default model.

Greedy answers with a prediction are the answers without one (the prediction only drafts
tokens that the model verifies), and the usage details add up as docs/request_fields.md says:
accepted + rejected + the rest = completion_tokens, rejected prediction tokens billed as
completion tokens. fp32, so that verifying several tokens in one step picks the same argmax as
one at a time.
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--dtype", "float32")
TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
        "ninety steps, trimmed the wick and wound the clockwork that turned the great lens. Ships passing the "
        "point saw its beam sweep the water once every twelve seconds, and knew where the rocks were.\n")
MESSAGES = [{"role": "user", "content": f"Repeat the following text exactly, and nothing else.\n\n{TEXT}"}]
PREDICTION = {"type": "content", "content": TEXT}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=300)


def details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def check_usage_adds_up(usage, num_written: int) -> None:
    accepted, rejected = details(usage)
    rest = num_written - accepted  # written tokens no accepted prediction token supplied
    assert 0 <= accepted <= num_written and rejected >= 0 and rest >= 0
    assert accepted + rejected + rest == usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.fixture(scope="module")
def answers(oai):
    kwargs = dict(model="smollm2", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    plain = oai.chat.completions.create(**kwargs)
    predicted = oai.chat.completions.create(**kwargs, prediction=PREDICTION)
    chunks = list(oai.chat.completions.create(**kwargs, prediction=PREDICTION, stream=True,
                                              stream_options={"include_usage": True}))
    return plain, predicted, chunks


def test_prediction_returns_the_same_text_and_the_usage_adds_up(answers):
    plain, predicted, chunks = answers
    num_written = plain.usage.completion_tokens
    assert details(plain.usage) == (0, 0)
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    assert predicted.choices[0].finish_reason == plain.choices[0].finish_reason
    check_usage_adds_up(predicted.usage, num_written)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    check_usage_adds_up(chunks[-1].usage, num_written)


def test_completions_prediction_returns_the_same_text(oai):
    kwargs = dict(model="smollm2", prompt=f"{TEXT}\nThe same text again:\n", max_tokens=64, temperature=0)
    plain = oai.completions.create(**kwargs)
    predicted = oai.completions.create(**kwargs, extra_body={"prediction": PREDICTION})
    assert predicted.choices[0].text == plain.choices[0].text
    check_usage_adds_up(predicted.usage, plain.usage.completion_tokens)


def test_a_copy_task_accepts_prediction_tokens(answers):
    plain, predicted, chunks = answers
    accepted, _ = details(predicted.usage)
    assert accepted > 0 and details(chunks[-1].usage)[0] > 0
