"""LoRA under tensor parallelism (engine/lora/parallel_lora.py): at TP = 2 on the CPU (gloo), greedy
fp32 tokens under peft-made adapters (rank 8 and 16, every projection, B random, alpha != r, one
rsLoRA) equal transformers + peft's on a tiny Llama (KV heads split, and replicated) and a tiny
Phi-3 (q/k/v and gate/up fused in its checkpoint); 48 requests mixing the base and 4 adapters over
2 slots, preempted, each give the tokens they get alone; ngram proposals verified under adapters;
each rank's shards add up to the adapter."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.lora.adapter_files import load_adapter
from engine.lora.parallel_lora import AdapterSharding
from engine.models.config import ModelConfig
from engine.parallel.parallel_state import TensorParallelGroup
from ipc.engine_config import EngineConfig
from ipc.lora_adapter import ModelShape
from tests.helpers.lora import LLAMA_MODULES, PHI3_MODULES, make_peft_adapter
from tests.helpers.models import make_tiny_model
from tests.models.test_lora import ENGINE_KWARGS, GREEDY, SMALL, adapters, check_each_then_mixed

TP_KWARGS = {**ENGINE_KWARGS, "tensor_parallel_size": 2, "device": "cpu"}
CASES = {
    "llama": ("LlamaForCausalLM", LLAMA_MODULES, {}),
    "llama_kv_replicated": ("LlamaForCausalLM", LLAMA_MODULES, dict(num_key_value_heads=1)),
    "phi3": ("Phi3ForCausalLM", PHI3_MODULES, {}),
}


@pytest.mark.parametrize("architecture, modules, overrides", list(CASES.values()), ids=list(CASES))
def test_each_rank_holds_the_shard_its_base_layer_would_and_they_add_up(tmp_path, architecture, modules, overrides):
    path, hf_model = make_tiny_model(tmp_path, architecture, **{**SMALL, **overrides})
    adapter_path, _ = make_peft_adapter(hf_model, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=modules)
    shape, config = ModelShape.from_folder(path), ModelConfig.from_folder(path)
    whole = load_adapter(adapter_path, shape, 16, torch.float32)
    shards = [AdapterSharding(shape, config, TensorParallelGroup(rank, 2)).shard(whole) for rank in range(2)]
    local = AdapterSharding(shape, config, TensorParallelGroup(0, 2)).local_shape
    for key, parts in whole.layers.items():
        module = key[1]
        in_features = shape.in_features(module)
        x = torch.randn(3, in_features)  # [n, in]
        want = torch.zeros(3, shape.out_slice(module, None)[1])
        for part in parts:
            want[:, part.out_start : part.out_end] += (x @ part.a.t()) @ part.b_t
        if module in ("o_proj", "down_proj"):  # row-parallel: each rank's input slice, the partial products summed
            width = in_features // 2
            got = sum((x[:, r * width : (r + 1) * width] @ p.a.t()) @ p.b_t
                      for r, rank_parts in enumerate(s.layers[key] for s in shards) for p in rank_parts)
            assert torch.allclose(got, want, atol=1e-5), key
            continue
        # Column-parallel: each rank's local outputs are the base layer's rows of q, k, v (gate, up) for that rank.
        for rank, shard in enumerate(shards):
            got = torch.zeros(3, local.out_slice(module, None)[1])
            for whole_part, p in zip(parts, shard.layers[key], strict=True):
                assert torch.equal(p.a, whole_part.a)  # A whole
                got[:, p.out_start : p.out_end] += (x @ p.a.t()) @ p.b_t
            names = ("q", "k", "v") if module == "qkv_proj" else ("gate", "up")
            for name in names:
                start, end = shape.out_slice(module, name)
                local_start, local_end = local.out_slice(module, name)
                size = local_end - local_start
                if name in ("k", "v") and config.num_kv_heads < 2:
                    first = start  # one KV head, replicated: each rank holds it whole
                else:
                    first = start + rank * size
                assert torch.allclose(got[:, local_start:local_end], want[:, first : first + size], atol=1e-5), \
                    (key, name, rank)


@pytest.mark.parametrize("architecture, modules, overrides", list(CASES.values()), ids=list(CASES))
def test_tp2_greedy_tokens_equal_peft_for_each_adapter_and_mixed(tmp_path, architecture, modules, overrides):
    path, hf_model = make_tiny_model(tmp_path, architecture, **{**SMALL, **overrides})
    made = adapters(tmp_path, hf_model, modules)
    llm = LLM(path, **TP_KWARGS)
    try:  # the base and three adapters alone, then at once over two slots: slots refilled, on both ranks alike
        batch_prompts, batch_loras, expected = check_each_then_mixed(llm, hf_model, made, check_base=True)
    finally:
        llm.shutdown()
    # ngram speculative decoding verifies under each row's adapter on both ranks: the same tokens.
    speculative = LLM(path, **TP_KWARGS, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    try:
        outputs = speculative.generate(batch_prompts, GREEDY, use_tqdm=False, lora_request=batch_loras)
        assert [o.token_ids for o in outputs] == expected
        assert sum(s.num_drafts for s in speculative.engine.stats().spec_decode) > 0  # proposals were verified
    finally:
        speculative.shutdown()


@pytest.mark.slow
def test_tp2_a_mixed_batch_of_48_under_preemption_gives_each_request_its_own_tokens(tmp_path):
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    made = adapters(tmp_path, hf_model, LLAMA_MODULES, count=4)
    generator = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, 512, (int(n),), generator=generator).tolist()
             for n in torch.randint(5, 30, (48,), generator=generator)]
    loras = [None if i % 5 == 0 else made[i % 5 - 1][0] for i in range(len(batch))]  # the base and 4 adapters
    alone = LLM(path, **TP_KWARGS)
    try:
        expected = [alone.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0].token_ids
                    for p, lora in zip(batch, loras)]
    finally:
        alone.shutdown()
    assert len({tuple(t) for t in expected[:5]}) == 5  # the base and the 4 adapters answer differently
    # 24 blocks of 4 tokens cannot hold 48 sequences of up to 45 tokens: preemptions; 2 slots for 4 adapters.
    tight = LLM(path, **{**TP_KWARGS, "num_kv_blocks": 24, "max_num_batched_tokens": 32})
    try:
        outputs = tight.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
        assert [o.token_ids for o in outputs] == expected
        assert tight.engine.scheduler.num_preemptions > 0
    finally:
        tight.shutdown()


def test_pipeline_parallelism_with_lora_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="enable_lora is not supported with pipeline_parallel_size > 1"):
        EngineConfig(enable_lora=True, pipeline_parallel_size=2)
    EngineConfig(enable_lora=True, tensor_parallel_size=2)  # tensor parallelism is served

