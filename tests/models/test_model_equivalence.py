"""Greedy output equals transformers token for token, on the default model and on tiny
random Mistral, Qwen2 and llama3-scaled Llama models, under every scheduling stress."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.models import make_tiny_model

NUM_NEW_TOKENS = 64

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "In 1492, Columbus sailed the ocean blue, and many stories followed.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets a new request join as soon as another finishes.",
]


def make_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from a few tokens to several hundred."""
    prompts = []
    for i, num_sentences in enumerate([0, 1, 2, 3, 6, 12, 25, 40]):
        if num_sentences == 0:
            prompts.append(tokenizer.encode("Hello"))
            continue
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(num_sentences))
        prompts.append(tokenizer.encode(text))
    return prompts


@pytest.fixture(scope="module")
def smollm2_reference(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = make_prompts(tokenizer)
    assert min(map(len, prompts)) <= 3 and max(map(len, prompts)) >= 300
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    expected = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
    return prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

STRESS_CASES = {
    # block size 8: the longest sequence spans ~60 blocks, the shortest several
    "continuous": dict(block_size=8),
    "chunked_prefill": dict(block_size=8, max_num_batched_tokens=48),
    "preemption": dict(block_size=8, num_kv_blocks=90),
    "static": dict(block_size=8, batching="static", max_num_seqs=3),
    # padded to each batch's longest prompt, finished rows decoding pad tokens until the batch ends
    "static_padded": dict(block_size=8, batching="static-padded", max_num_seqs=3),
    # plain F.linear instead of the default oneDNN-prepacked weights
    "no_cpu_prepack": dict(block_size=8, cpu_prepack=False),
    # the torch backend's decode path instead of the default C++ kernel
    "torch_attention": dict(block_size=8, attention_backend="torch"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STRESS_CASES))
def test_smollm2_matches_transformers(case, smollm2_reference, default_model_path):
    prompts, expected = smollm2_reference
    llm = LLM(default_model_path, dtype="float32", **STRESS_CASES[case])  # exact: fp32 like the reference
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (output, want) in enumerate(zip(outputs, expected)):
        assert output.token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert output.finish_reason == "length"
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0


TINY_CASES = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    # A 16-token window: the longer prompts and every answer run past it (real sliding-window
    # attention, no longer a cap on the context).
    "mistral_window": ("MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "llama3_rope": (
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_models_match_transformers(case, tmp_path):
    architecture, overrides = TINY_CASES[case]
    path, hf_model = make_tiny_model(tmp_path, architecture, **overrides)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 5, 17, 40, 133)]
    expected = [hf_greedy(hf_model, p, 40) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for engine_kwargs in (dict(block_size=4), dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=50)):
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", **engine_kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, engine_kwargs
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks


def test_the_last_layer_runs_on_the_sampled_rows_only(tmp_path):
    """Only a prompt's last row is sampled, so the last layer's MLP (and attention output)
    sees only the sampled rows, while every row's K and V still reach the cache. (The eager
    layer loop's rows: the decode stack, which runs decode-only steps, samples every row.)"""
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, cpu_decode_stack=False)
    model = llm.engine.model_runner.model
    rows_seen = {"first": [], "last": []}
    model.layers[0].mlp.register_forward_pre_hook(lambda module, args: rows_seen["first"].append(args[0].shape[0]))
    model.layers[-1].mlp.register_forward_pre_hook(lambda module, args: rows_seen["last"].append(args[0].shape[0]))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, 3) for p in prompts]
    assert rows_seen["first"] == [10, 2, 2]  # the prompt step, then two decode steps
    assert rows_seen["last"] == [2, 2, 2]  # the prompts' last rows alone, then every decode
