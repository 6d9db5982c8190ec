"""Verification steps on the C++ decode stack (engine.worker.step_inputs.to_row_tensors and DecodeStack.forward_rows): each proposed token a
one-token row of its own, attending to the positions before it. The same greedy tokens as
speculation off, and log-probabilities within rounding of the eager path's prefill-kernel rows."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu.host import detect_cpu_features
from tests.helpers.models import make_tiny_model, quantization_runs

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)
CPU = detect_cpu_features()
SETTINGS = {
    "fp32_onednn": dict(dtype="float32"),
    "fp32_plain": dict(dtype="float32", cpu_prepack=False),
    "int8": dict(quantization="int8"),
}
ENGINE_KWARGS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, enable_prefix_caching=False)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (6, 11, 17)]


def params(predictions: list[list[int]] | None = None) -> list[SamplingParams]:
    result = []
    for i in range(len(prompts())):
        param = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
        if predictions is not None:
            # The answer itself with one token edited: long accepted runs, one rejection, a resync.
            param.prediction_token_ids = [t if j != 9 else (t + 1) % 512 for j, t in enumerate(predictions[i])]
        result.append(param)
    return result


def generate(llm: LLM, predictions=None):
    outputs = llm.generate(prompts(), params(predictions), use_tqdm=False)
    return [o.token_ids for o in outputs], [o.logprobs for o in outputs]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_verification_on_the_stack_equals_speculation_off(setting, tmp_path):
    if setting == "int8" and not quantization_runs("int8"):
        pytest.skip("int8 needs AVX512_VNNI or AVX2; this CPU has neither")
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    llm = LLM(path, **ENGINE_KWARGS, **SETTINGS[setting])
    reference, _ = generate(llm)
    runner = llm.engine.model_runner
    assert runner.decode_stack is not None
    calls = []
    forward_rows = runner.decode_stack.forward_rows
    runner.decode_stack.forward_rows = lambda *args: calls.append(args[0].shape[0]) or forward_rows(*args)
    stacked, stacked_logprobs = generate(llm, reference)
    assert calls and max(calls) > 3  # verification steps of several rows went through the stack
    assert stacked == reference
    assert sum(s.num_accepted_tokens for s in llm.engine.stats().spec_decode) >= 30
    eager_llm = LLM(path, cpu_decode_stack=False, **ENGINE_KWARGS, **SETTINGS[setting])
    eager, eager_logprobs = generate(eager_llm, reference)
    assert eager == reference
    for stacked_row, eager_row in zip(stacked_logprobs, eager_logprobs):
        for a, b in zip(stacked_row, eager_row):
            assert (a.token_id, a.top_token_ids) == (b.token_id, b.top_token_ids)
            assert all(abs(x - y) < 1e-3 for x, y in zip([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs]))
