"""Tensor parallelism gives the single-process tokens: fp32 greedy, TP = 2 vs TP = 1 on tiny
Llama, Mistral and Qwen2 models (and a Llama with fewer KV heads than ranks, so they are
replicated), and SmolLM2 split three ways (9 heads, 3 KV heads).

The all-reduces sum the ranks' partial matmuls in another order than one matmul does, so
the logits differ in the last bits; each test reports by how much (the sampled tokens'
log-probs) and, should a greedy token ever change, where.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel.parallel_layers import check_tensor_parallel
from engine.models.config import ModelConfig
from ipc.engine_config import EngineConfig
from tests.helpers.models import make_tiny_model

TINY_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "mistral_window": ("MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "llama_kv_replicated": ("LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
}
# NCCL needs a GPU per rank: with fewer than two the ranks run on the CPU (gloo); with two
# or more (scripts/gpu_check.sh) they run NCCL and the Triton kernels, one GPU each.
DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
ENGINE_KWARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=512, device=DEVICE)


def generate(path: str, prompts: list[list[int]], params: SamplingParams, tensor_parallel_size: int, **kwargs):
    llm = LLM(path, tensor_parallel_size=tensor_parallel_size, **ENGINE_KWARGS | kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def assert_same_greedy_tokens(reference, outputs) -> float:
    """Equal tokens, or a message naming the first divergence and the two logprobs there;
    returns the largest difference of the sampled tokens' log-probs."""
    max_diff = 0.0
    for i, (want, got) in enumerate(zip(reference, outputs)):
        for j, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
            la, lb = want.logprobs[j].logprob, got.logprobs[j].logprob
            assert a == b, (f"prompt {i} diverged at output token {j}: {a} (logprob {la:.6f}) vs {b} "
                            f"(logprob {lb:.6f})")
            max_diff = max(max_diff, abs(la - lb))
        assert want.token_ids == got.token_ids
    return max_diff


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_models_tp2_match_tp1(case, tmp_path):
    architecture, overrides = TINY_CASES[case]
    path, _ = make_tiny_model(tmp_path, architecture, **overrides)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    # Chunked prefill and mixed batches: 16 tokens a step.
    reference = generate(path, prompts, params, 1, max_num_batched_tokens=16)
    outputs = generate(path, prompts, params, 2, max_num_batched_tokens=16)
    max_diff = assert_same_greedy_tokens(reference, outputs)
    print(f"{case}: TP=2 tokens equal TP=1; max |logprob difference| {max_diff:.2e}")
    assert max_diff < 1e-3


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(default_model_path):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
               "List three colors: red,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kwargs = dict(skip_tokenizer_init=False, num_kv_blocks=256, block_size=16)
    reference = generate(default_model_path, prompts, params, 1, **kwargs)
    outputs = generate(default_model_path, prompts, params, 3, **kwargs)
    max_diff = assert_same_greedy_tokens(reference, outputs)
    print(f"smollm2: TP=3 tokens equal TP=1; max |logprob difference| {max_diff:.2e}")


def test_a_model_that_does_not_split_is_refused_before_anything_starts(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")  # 8 heads, 2 KV heads
    with pytest.raises(ValueError, match="8 attention heads are not divisible by 3"):
        LLM(path, tensor_parallel_size=3, **ENGINE_KWARGS)
    config = ModelConfig.from_folder(path)
    check_tensor_parallel(config, 4)  # 2 KV heads replicate over 4 ranks
    with pytest.raises(ValueError, match="intermediate size 250 is not divisible by 4"):
        check_tensor_parallel(dataclasses.replace(config, intermediate_size=250), 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3, nnodes=2, master_port=1), "do not divide evenly over 2 nodes"),
    (dict(tensor_parallel_size=2, nnodes=2), "fixed master_port"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1), "node_rank must be in"),
    (dict(tensor_parallel_size=2, compile=True), "compile is not supported"),
])
def test_parallel_config_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_simulator_prices_as_many_all_reduces_per_step_as_a_tp2_engine_makes(tmp_path):
    # engine.simulator prices TP on GPUs from this count: it must be the engine's own.
    from engine.simulator.model_shape import ModelShape

    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        group = llm.engine.executor.group
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        before = group.num_all_reduces
        llm.generate([[6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        num_all_reduces = group.num_all_reduces - before  # one step: a prefill that samples its token
        shape = ModelShape.from_config(llm.engine.model_config, "float32")
    finally:
        llm.shutdown()
    assert num_all_reduces == shape.num_allreduces_per_step == 2 * shape.num_layers + 1
