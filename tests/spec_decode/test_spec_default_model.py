"""Speculative decoding on the default model in fp32: n-gram lookup, a prediction and the self-int4
draft give the tokens and text of one token per step, stop strings cut inside a step's accepted tokens included."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from ipc.messages import SpecMethod
from tests.helpers.models import quantization_runs

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
PROMPTS = [
    [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}],
    [{"role": "user", "content": f"Rename subtotal to net in this code:\n\n{CODE}"}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def llms():
    off = LLM("smollm2", dtype="float32")
    ngram = LLM("smollm2", dtype="float32",
                speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    yield off, ngram
    off.shutdown()
    ngram.shutdown()


def run(llm: LLM, params: SamplingParams | list[SamplingParams]):
    return [(o.text, o.token_ids, o.finish_reason) for o in llm.chat(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_ngram_and_prediction_are_exact_on_the_default_model(llms):
    off, ngram = llms
    params = SamplingParams(temperature=0, max_tokens=120)
    expected = run(off, params)
    assert expected[2][0] == "The capital of France is Paris."
    assert run(ngram, params) == expected
    accepted = next(s for s in ngram.engine.stats().spec_decode if s.method == SpecMethod.NGRAM).num_accepted_tokens
    assert accepted > 20  # the copies are proposed, and much of them right
    predicted = [SamplingParams(temperature=0, max_tokens=120, prediction_token_ids=ids)
                 for ids in (off.tokenizer.encode(CODE, add_special_tokens=False),) * 3]
    assert run(off, predicted) == expected


@pytest.mark.slow
def test_a_stop_string_inside_a_step_of_accepted_tokens_cuts_there(llms):
    off, ngram = llms
    for stop in (["tax_rate"], ["quantity"], ["return"]):
        params = SamplingParams(temperature=0, max_tokens=120, stop=stop)
        expected = run(off, params)
        assert run(ngram, params) == expected


@pytest.mark.slow
def test_the_self_int4_draft_is_exact_on_the_default_model(llms):
    if not quantization_runs("int4"):
        pytest.skip("self-int4 needs AVX512_VNNI or AVX2; this CPU has neither")
    off, _ = llms
    params = SamplingParams(temperature=0, max_tokens=120)
    draft = LLM("smollm2", dtype="float32",
                speculative_config={"method": "draft", "model": "self-int4", "num_speculative_tokens": 4})
    assert run(draft, params) == run(off, params)
    stats = next(s for s in draft.engine.stats().spec_decode if s.method == SpecMethod.DRAFT)
    assert stats.num_accepted_tokens > stats.num_proposed_tokens // 2  # its own int4 copy mostly agrees
    draft.shutdown()
