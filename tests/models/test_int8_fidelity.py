"""--quantization int8 on the default model: the weights held in about half of bf16's bytes,
the capital of France still answered, and greedy answers about as close to fp32 as bf16's.

The yardstick is test_bf16_fidelity's: the mean number of leading tokens (of 32) equal to
transformers' fp32 greedy answer, at least 80% of what transformers' own bf16 achieves (the
same bound the Q8_0 GGUF test holds llama.cpp's scheme to). scripts/bench/quant_drift.py
prints the same score for simulated schemes beside the engine's.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.models import hf_greedy
from tests.models.test_bf16_fidelity import NUM_NEW_TOKENS, QUESTIONS, mean_leading_matches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int8_llm(default_model_path):
    from engine.dtype_policy import detect_cpu_features

    if not detect_cpu_features().has_avx512_vnni:
        pytest.skip("int8 needs AVX512_VNNI")
    return LLM(default_model_path, quantization="int8")


def test_int8_weights_take_about_half_of_bf16s_bytes(int8_llm):
    runner = int8_llm.engine.model_runner
    model = runner.model
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    # int8 plus one fp32 scale per 64 weights: 0.53 of bf16; norms and rotary tables add a little.
    assert resident <= 0.55 * 2 * runner.num_params, (resident, runner.num_params)


def test_int8_answers_the_capital_of_france(int8_llm):
    out = int8_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=30))
    assert out[0].text.startswith("The capital of France is Paris."), out[0].text


def test_int8_stays_as_close_to_fp32_as_transformers_bf16(int8_llm, default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    references = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=dtype).eval()
        references[dtype] = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
        del model
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ours = [o.token_ids for o in int8_llm.generate(prompts, params, use_tqdm=False)]

    fp32 = references[torch.float32]
    hf_bf16_score = mean_leading_matches(references[torch.bfloat16], fp32)
    int8_score = mean_leading_matches(ours, fp32)
    print(f"mean leading tokens equal to fp32 (of {NUM_NEW_TOKENS}): ours int8 {int8_score:.1f}, "
          f"transformers bf16 {hf_bf16_score:.1f}")
    assert hf_bf16_score > 0  # the yardstick itself is meaningful
    assert int8_score >= 0.8 * hf_bf16_score
