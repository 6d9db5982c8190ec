"""prompt_logprobs against transformers' own log-softmax over the prompt, whole, chunked and preempted."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks."


@pytest.fixture(scope="module")
def reference(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt = tokenizer.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [num_tokens, vocab]
    return prompt, logprobs


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=8), dict(num_kv_blocks=12, block_size=4)],
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_match_transformers(default_model_path, reference, config):
    prompt, expected = reference
    llm = LLM(default_model_path, dtype="float32", **config)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    # Two copies of the prompt: the second would hit the prefix cache, which prompt log-probs skip.
    filler = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outputs = llm.generate([prompt, prompt, [5, 6, 7, 8, 9, 10, 11]], [params, params, filler], use_tqdm=False)
    if "num_kv_blocks" in config:
        assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs[:2]:
        entries = output.prompt_logprobs
        assert entries[0] is None and len(entries) == len(prompt)
        for position, entry in enumerate(entries[1:]):
            row = expected[position]
            assert entry.token_id == prompt[position + 1]
            assert entry.logprob == pytest.approx(float(row[prompt[position + 1]]), abs=1e-3)
            assert entry.top_token_ids == row.topk(3).indices.tolist()
    assert outputs[2].prompt_logprobs is None
