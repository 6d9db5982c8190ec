"""Speculative decoding is exact for greedy requests: the same tokens as one token per step, on a
tiny random Llama in fp32, for n-gram lookup, the self-int4 draft and a prediction — alone, in a
batch of 48 mixed requests, across preemptions, with prefix caching, and with max_tokens and stop
tokens cut inside a proposal."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from ipc.messages import SpecMethod
from tests.helpers.models import make_tiny_model, quantization_runs

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("spec"), "LlamaForCausalLM")
    return path


def make_llm(model_path, **kwargs) -> LLM:
    return LLM(model_path, skip_tokenizer_init=True, dtype="float32", block_size=4, **kwargs)


def prompts(num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3..40 tokens; most repeat a segment, so n-gram lookup has something to find."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for i in range(num_prompts):
        length = int(torch.randint(3, 20, (1,), generator=generator))
        segment = torch.randint(0, VOCAB_SIZE, (length,), generator=generator).tolist()
        result.append(segment * 2 if i % 4 else segment)
    return result


def token_ids(llm: LLM, prompt_list, params) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(prompt_list, params, use_tqdm=False)]


def spec_stats(llm: LLM, method: SpecMethod):
    return next(s for s in llm.engine.stats().spec_decode if s.method == method)


@pytest.fixture(scope="module")
def reference(model_path):
    llm = make_llm(model_path)
    yield llm
    llm.shutdown()


SELF_INT4 = {"method": "draft", "model": "self-int4", "num_speculative_tokens": 4}
METHODS = ["ngram", "self-int4", "prediction"]


def speculating(method: str, model_path, params: SamplingParams, expected: list[list[int]], **kwargs):
    """An engine speculating with `method`, and each request's parameters: a prediction request's is
    its expected answer with every 7th token edited (so it diverges and resyncs)."""
    if method == "self-int4" and not quantization_runs("int4"):
        pytest.skip("self-int4 needs AVX512_VNNI or AVX2; this CPU has neither")
    config = {"ngram": NGRAM, "self-int4": SELF_INT4}.get(method)
    llm = make_llm(model_path, speculative_config=config, **kwargs)
    if method != "prediction":
        return llm, params
    return llm, [SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                prediction_token_ids=[(t + 1) % VOCAB_SIZE if i % 7 == 3 else t
                                                      for i, t in enumerate(e)]) for e in expected]


def num_proposed(llm: LLM) -> int:
    return sum(s.num_proposed_tokens for s in llm.engine.stats().spec_decode)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_one_token_per_step_alone_and_in_a_batch_of_48(model_path, reference, method):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batch = prompts(48)
    expected = token_ids(reference, batch, params)
    llm, spec_params = speculating(method, model_path, params, expected)
    first = spec_params if isinstance(spec_params, SamplingParams) else spec_params[:1]
    assert token_ids(llm, batch[:1], first) == expected[:1]
    assert token_ids(llm, batch, spec_params) == expected
    assert num_proposed(llm) > 0
    for stats in llm.engine.stats().spec_decode:
        assert stats.num_accepted_tokens <= stats.num_proposed_tokens
        assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts
    llm.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_exact_across_preemptions_and_with_prefix_caching(model_path, reference, method):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    batch = prompts(12, seed=1)
    expected = token_ids(reference, batch, params)
    # 40 blocks of 4 tokens cannot hold 12 sequences of up to 86 tokens: requests are preempted and recomputed.
    llm, spec_params = speculating(method, model_path, params, expected, num_kv_blocks=40,
                                   enable_prefix_caching=True)
    assert token_ids(llm, batch, spec_params) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and num_proposed(llm) > 0
    # Every block the cache holds now was computed from accepted tokens only: later requests sharing
    # the earlier ones' whole sequences as prompts find them, and still decode the same tokens.
    longer = [p + e for p, e in zip(batch, expected)]
    assert token_ids(llm, longer, params) == token_ids(reference, longer, params)
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_and_stop_tokens_cut_inside_a_proposal(model_path, reference, method):
    batch = prompts(16, seed=2)
    free = token_ids(reference, batch, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    llm, _ = speculating(method, model_path, SamplingParams(max_tokens=30), free)

    def with_prediction(params: SamplingParams, answer: list[int]) -> SamplingParams:
        if method == "prediction":
            params.prediction_token_ids = answer  # the whole answer: proposals run past the cut
        return params

    for max_tokens in (1, 2, 7):
        params = [with_prediction(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), f)
                  for f in free]
        assert token_ids(llm, batch, params) == [f[:max_tokens] for f in free]
    # Stop at the 5th token each request writes: the tokens after it (inside an accepted proposal) are dropped.
    for prompt, full in zip(batch, free):
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full[4]])
        expected = token_ids(reference, [prompt], params)
        assert token_ids(llm, [prompt], with_prediction(params, full)) == expected and len(expected[0]) <= 5
    assert num_proposed(llm) > 0
    llm.shutdown()


def test_a_prediction_drafts_without_speculative_config_and_counts_what_it_kept(model_path, reference):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = prompts(8, seed=3)
    expected = token_ids(reference, batch, params)
    llm = make_llm(model_path)
    exact = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prediction_token_ids=e) for e in expected]
    outputs = llm.generate(batch, exact, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    stats = spec_stats(llm, SpecMethod.PREDICTION)
    # The whole answer predicted: all but the first token of each step come from the prediction.
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > len(batch) * 16
    # An edited prediction (every 7th token changed) still gives the model's own answer.
    edited = [[(t + 1) % VOCAB_SIZE if i % 7 == 3 else t for i, t in enumerate(e)] for e in expected]
    params_edited = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prediction_token_ids=e)
                     for e in edited]
    assert token_ids(llm, batch, params_edited) == expected
    llm.shutdown()


def test_rows_with_logits_processing_are_not_speculated_and_stay_exact(model_path, reference):
    batch = prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                            logit_bias=[(7, 2.0)], min_tokens=4)
    llm = make_llm(model_path, speculative_config=NGRAM)
    assert token_ids(llm, batch, params) == token_ids(reference, batch, params)
    assert not llm.engine.stats().spec_decode  # nothing proposed for them
    llm.shutdown()


def test_the_draft_method_loads_its_draft_model(model_path):
    """method "draft" loads the draft beside the target (its exactness: tests/models/test_draft_proposer.py)."""
    if not quantization_runs("int4"):
        pytest.skip("self-int4 needs AVX512_VNNI or AVX2")
    llm = make_llm(model_path, speculative_config={"method": "draft", "model": "self-int4", "num_speculative_tokens": 3})
    assert llm.engine.proposer.draft is not None
    llm.shutdown()
