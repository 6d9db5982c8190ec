"""A KV cache in a dtype of its own (kv_cache_dtype; engine.worker.dtype_policy): bf16 K and V beside
fp32 activations hold twice the tokens in the same bytes, attention runs in bf16 on every
path (fused rotary + KV store, the torch rotary of Gemma 3's (1 + w) q/k norm and local
layers), and the answers move from the fp32 cache's by less than a whole bf16 model's do."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu.host import detect_cpu_features
from tests.helpers.models import make_tiny_model, quantization_runs

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "gemma3": ("Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
}
CPU = detect_cpu_features()
KV_BYTES = 1 << 20


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Each prompt position's log-probability of the token that follows it."""
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([row.logprob for row in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_bf16_cache_beside_fp32_activations(arch, tmp_path):
    architecture, overrides = ARCHITECTURES[arch]
    path, _ = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=KV_BYTES,
                  enable_prefix_caching=False)
    fp32 = LLM(path, kv_cache_dtype="float32", **kwargs)
    bf16 = LLM(path, kv_cache_dtype="bfloat16", **kwargs)
    assert fp32.engine.model_runner.kv_caches[0][0].dtype == torch.float32
    assert bf16.engine.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.engine.model_runner.model.embed_tokens.weight.dtype == torch.float32  # matmuls stay fp32
    assert bf16.engine.num_kv_blocks // 2 == fp32.engine.num_kv_blocks  # half the bytes a block
    all_bf16 = LLM(path, dtype="bfloat16", **{k: v for k, v in kwargs.items() if k != "dtype"})
    want = prompt_logprobs(fp32, prompt)
    gap = (prompt_logprobs(bf16, prompt) - want).abs().max().item()
    bf16_model_gap = (prompt_logprobs(all_bf16, prompt) - want).abs().max().item()
    # bf16 q, k and v move the log-probs (attention really ran in bf16), by less than bf16
    # everywhere (weights, matmuls, residual stream) does.
    assert 0 < gap < bf16_model_gap, (gap, bf16_model_gap)


def test_int8_weights_get_a_bf16_cache_by_default(tmp_path):
    if not quantization_runs("int8"):
        pytest.skip("int8 needs AVX512_VNNI or AVX2; this CPU has neither")
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    kwargs = dict(quantization="int8", skip_tokenizer_init=True, kv_cache_memory_bytes=KV_BYTES)
    auto = LLM(path, **kwargs).engine
    want = torch.bfloat16 if CPU.has_avx512_bf16 or CPU.has_amx_bf16 else torch.float32
    assert auto.model_runner.dtype == torch.float32
    assert auto.model_runner.kv_caches[0][0].dtype == want
    assert LLM(path, kv_cache_dtype="float32", **kwargs).engine.model_runner.kv_caches[0][0].dtype == torch.float32


def test_compile_refuses_a_cache_dtype_of_its_own(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    with pytest.raises(ValueError, match="not supported with compile"):
        LLM(path, dtype="float32", kv_cache_dtype="bfloat16", compile=True, skip_tokenizer_init=True)
