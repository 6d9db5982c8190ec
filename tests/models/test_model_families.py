"""The families beyond Llama's (Qwen3 tied and untied, Phi-3, Phi-4-mini's partial rotary
with longrope, Qwen3-MoE, Mixtral): greedy tokens equal transformers' in fp32 on tiny
random checkpoints, under chunked prefill, 4-token blocks and prefix caching; each model
gets the CPU fast paths its blocks allow, and says so at start-up; the MoE block runs each
expert on its own tokens only."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.cpu.packing import PackedLinear
from engine.models.moe import MoEBlock
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.models import make_tiny_model

# Small enough that each case runs in seconds; head_dim 16 unless a case says otherwise.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PHI4_ROTARY_HALF = 12  # head_dim 32 (hidden 128 over 4 heads) x 0.75 = 24 rotary features, 12 frequencies

CASES = {
    # An explicit head_dim (32) that is not hidden / heads (16): q is 128 wide on a 64-wide model.
    "qwen3_tied": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, initializer_range=0.2)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3ForCausalLM", {}),
    # Phi-4-mini's shape of rotary: the first 3/4 of each head, longrope-scaled (prompts stay
    # within the 256-token pretraining context, where transformers and the engine agree).
    "phi4_mini": ("Phi3ForCausalLM", dict(
        hidden_size=128, partial_rotary_factor=0.75, original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 256,
            "short_factor": [1.0 + 0.1 * i for i in range(PHI4_ROTARY_HALF)],
            "long_factor": [2.0 + 0.5 * i for i in range(PHI4_ROTARY_HALF)],
        },
    )),
    # Layer 1 keeps a dense MLP (mlp_only_layers), as Qwen3-MoE's config allows.
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                              norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
# Which attention layers take the fused rotary + KV store kernel, and why not.
# Qwen3's q/k RMSNorm runs before the fused kernel, written back into qkv: fused too.
ROTARY_NOT_FUSED = {"phi4_mini": "partial rotary"}
NUM_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
ENGINE_KWARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_num_batched_tokens=16,
                     num_kv_blocks=128)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 23, 100)]


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(case, tmp_path, caplog):
    architecture, overrides = CASES[case]
    path, hf_model = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts()]
    assert all(len(set(tokens)) >= 4 for tokens in expected)  # answers that vary: a real check
    with caplog.at_level(logging.INFO, logger="engine.cpu.fast_paths"):
        llm = LLM(path, **ENGINE_KWARGS)  # 16 tokens a step: the 100-token prompt prefills in chunks
    # The first pass fills the prefix cache; the second reads the prompts' full blocks from it.
    for attempt in ("cold", "cached"):
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, attempt
    assert outputs[2].num_cached_tokens >= 96
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks

    model = llm.engine.model_runner.model
    (log_line,) = [r.getMessage() for r in caplog.records if "fast paths" in r.getMessage()]
    assert log_line.startswith(f"{architecture} fast paths: ") and "matmuls on oneDNN" in log_line
    for layer in model.layers:
        assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
        assert layer.input_layernorm.fused is not None
        reason = ROTARY_NOT_FUSED.get(case)
        assert layer.self_attn.is_rotary_fused == (reason is None)
        if reason is not None:
            assert reason in log_line
        if isinstance(layer.mlp, MoEBlock):  # experts are MLPs like any other: packed and fused
            assert all(isinstance(e.gate_up_proj, PackedLinear) and e.fused is not None for e in layer.mlp.experts)
            assert "MoE" in log_line


def test_grouped_experts_run_each_expert_on_its_own_tokens():
    """Each expert sees exactly the tokens routed to it (none: not called), and the sum
    equals the dense reference: every expert over every token, weighted by the router."""
    from engine.models.config import MoEConfig

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=16, norm_topk_prob=True)
    block = MoEBlock(32, moe)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(5, 32)  # [num_tokens, hidden]
    weights, expert_ids = block.route(x)
    rows_seen = {}
    for e, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda module, args, e=e: rows_seen.setdefault(e, []).append(args[0].shape[0]))
    out = block(x)
    chosen = torch.bincount(expert_ids.flatten(), minlength=8)
    assert rows_seen == {e: [int(n)] for e, n in enumerate(chosen) if n > 0}  # one call per chosen expert
    assert sum(n for calls in rows_seen.values() for n in calls) == 5 * 2
    dense = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        weight = (weights * (expert_ids == e)).sum(-1, keepdim=True)  # [num_tokens, 1]: 0 where not chosen
        dense += weight * expert(x)
    torch.testing.assert_close(out, dense)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # renormalised top-k


def test_router_stays_fp32_in_bf16(tmp_path):
    from engine.models import load_model

    path, _ = make_tiny_model(tmp_path, "MixtralForCausalLM", **SMALL | dict(num_local_experts=4, num_experts_per_tok=2))
    model = load_model(ModelConfig.from_folder(path), torch.bfloat16, torch.device("cpu"))
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    assert model.layers[0].mlp.experts[0].gate_up_proj.weight.dtype == torch.bfloat16
    assert model.rotary.cos_cache.dtype == torch.float32


def test_longrope_uses_the_long_factors_past_the_pretraining_context():
    from engine.models.rotary import RotaryEmbedding

    half = 4
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half}
    rotary = RotaryEmbedding(2 * half, 64, 10000.0, scaling, original_max_positions=16)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half))
    attention_factor = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))) ** 0.5  # factor 64 / 16
    for position, factor in ((15, 1.0), (16, 4.0), (63, 4.0)):
        expected = torch.cos(position * inv_freq / factor) * attention_factor
        torch.testing.assert_close(rotary.cos_cache[position, :half], expected)


def test_unsupported_rotary_scaling_and_activations_are_refused(tmp_path):
    from engine.models.rotary import RotaryEmbedding

    with pytest.raises(NotImplementedError, match="'yarn' is not supported"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL | dict(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_folder(path)


@pytest.mark.parametrize("case", ["phi4_mini", "qwen3_moe"])
def test_family_tp2_matches_transformers(case, tmp_path):
    """TP = 2 (gloo on the CPU): Phi-3's fused qkv_proj and gate_up_proj split part by part,
    Qwen3-MoE's replicated q/k norms and router, and its experts split like dense MLPs."""
    architecture, overrides = CASES[case]
    path, hf_model = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts()]
    assert tp2_greedy_token_ids(path, prompts()) == expected


def tp2_greedy_token_ids(path, prompt_token_ids: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of an engine at TP = 2 on the CPU (gloo), shut down after."""
    llm = LLM(path, tensor_parallel_size=2, device="cpu", **ENGINE_KWARGS)
    try:
        return [o.token_ids for o in llm.generate(prompt_token_ids, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_tensor_parallel_refuses_experts_that_do_not_split(tmp_path):
    from engine.parallel.parallel_layers import check_tensor_parallel

    path, _ = make_tiny_model(tmp_path, "Qwen3MoeForCausalLM", **SMALL | dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24))
    config = ModelConfig.from_folder(path)
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="expert intermediate size 24 is not divisible by 16"):
        check_tensor_parallel(config, 16)
