"""Gemma 3 (text) and real sliding-window attention, end to end: tokenloom's greedy tokens
equal transformers' in fp32 on tiny random Gemma 3 checkpoints with an 8-token window
(prompts and outputs well past it), under chunked prefill, 4-token blocks and prefix
caching, on the C++ kernels and on the torch backend, and at TP = 2; bf16 drifts from
transformers' fp32 answer no more than transformers' own bf16 does; config.json in both
layouts (rope_parameters per layer type, or rope_local_base_freq and
sliding_window_pattern) gives the same model; what no kernel computes is refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.models import make_tiny_model
from tests.models.test_bf16_fidelity import mean_leading_matches
from tests.models.test_model_families import ENGINE_KWARGS, GREEDY, NUM_NEW_TOKENS, tp2_greedy_token_ids

WINDOW = 8
# Layers 0 and 1 slide (local rotary base 10k), layer 2 is global (base 1M, linear-scaled x2).
GEMMA_SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
    hidden_activation="gelu_pytorch_tanh", initializer_range=0.2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)
# Untied here: tied to sqrt(hidden)-scaled embeddings, a random tiny model's greedy answer
# repeats one token; the tied checkpoint (Gemma's own layout) is read in the softcapping test.


def prompts() -> list[list[int]]:
    """Shorter than the window, just past it, and many windows long."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 11, 100)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path, hf_model = make_tiny_model(tmp_path_factory.mktemp("gemma3"), "Gemma3ForCausalLM", **GEMMA_SMALL)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts()]
    assert all(len(set(tokens)) >= 4 for tokens in expected)  # answers that vary: a real check
    return path, hf_model, expected


def test_gemma3_config_is_read(gemma):
    config = ModelConfig.from_folder(gemma[0])
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.layer_windows == (WINDOW, WINDOW, 0) and config.sliding_window == WINDOW
    assert config.activation == "gelu_tanh" and config.query_pre_attn_scalar == 24
    assert config.rope_theta == 1e6 and config.rope_scaling["factor"] == 2.0
    assert config.local_rope_theta == 1e4 and config.local_rope_scaling is None


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_gemma3_matches_transformers(backend, gemma, caplog):
    path, _, expected = gemma
    with caplog.at_level(logging.INFO, logger="engine.cpu.fast_paths"):
        llm = LLM(path, attention_backend=backend, **ENGINE_KWARGS)  # 16 tokens a step: the 100-token prompt in chunks
    assert llm.engine.max_model_len > WINDOW * 4  # the window no longer caps the context
    # The first pass fills the prefix cache; the second reads the prompts' full blocks from it.
    for attempt in ("cold", "cached"):
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, attempt
    assert outputs[2].num_cached_tokens >= 96
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks
    (log_line,) = [r.getMessage() for r in caplog.records if "fast paths" in r.getMessage()]
    if backend == "cpu":  # no fused kernel for (1 + w) norms or GELU-tanh: the torch ops, said so
        assert "torch ops (no fused kernel) for (1 + w) RMSNorm ×19, gelu_tanh×up ×3" in log_line
        assert "q/k norm other than RMSNorm before rotary" in log_line
    model = llm.engine.model_runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW, WINDOW, 0]
    assert all(layer.mlp.fused is None and not layer.self_attn.is_rotary_fused for layer in model.layers)


def test_gemma3_tp2_matches_transformers(gemma):
    path, _, expected = gemma
    assert tp2_greedy_token_ids(path, prompts()) == expected


def test_gemma3_bf16_drifts_no_more_than_transformers_bf16(gemma):
    path, hf_model, expected = gemma
    hf_bf16 = [hf_greedy(hf_model.to(torch.bfloat16), p, NUM_NEW_TOKENS) for p in prompts()]
    hf_model.float()
    # Plain F.linear: oneDNN's prepacked bf16 matmuls need AVX-512 (or AVX-NE-CONVERT), which not every CPU has.
    llm = LLM(path, **ENGINE_KWARGS | dict(dtype="bfloat16", cpu_prepack=False))
    ours = [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    hf_score, our_score = mean_leading_matches(hf_bf16, expected), mean_leading_matches(ours, expected)
    print(f"mean leading tokens equal to fp32 (of {NUM_NEW_TOKENS}): ours bf16 {our_score:.1f}, "
          f"transformers bf16 {hf_score:.1f}")
    assert our_score >= 0.8 * hf_score


def test_final_logit_softcapping_caps_the_logprobs_as_transformers(tmp_path):
    """Also a tied checkpoint (no lm_head.weight), as Gemma 3's own are."""
    path, hf_model = make_tiny_model(tmp_path, "Gemma3ForCausalLM", **GEMMA_SMALL | dict(
        final_logit_softcapping=2.0, tie_word_embeddings=True))
    prompt = prompts()[1]
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1]  # capped by transformers
    assert logits.abs().max() < 2.0
    llm = LLM(path, **ENGINE_KWARGS)
    (output,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), use_tqdm=False)
    token = output.token_ids[0]
    assert token == int(logits.argmax())
    torch.testing.assert_close(output.logprobs[0].logprob, float(logits.log_softmax(-1)[token]), atol=1e-4, rtol=0)


def test_older_gemma3_config_layout_reads_the_same(gemma, tmp_path):
    """Hub configs from before transformers 5: rope_theta, rope_local_base_freq, rope_scaling
    and sliding_window_pattern instead of layer_types and per-type rope_parameters."""
    cfg = json.loads(open(f"{gemma[0]}/config.json").read())
    for key in ("layer_types", "rope_parameters"):
        cfg.pop(key)
    cfg |= dict(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
                rope_scaling={"rope_type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old, new = ModelConfig.from_folder(str(tmp_path)), ModelConfig.from_folder(gemma[0])
    for field in ("layer_windows", "rope_theta", "local_rope_theta", "local_rope_scaling", "activation"):
        assert getattr(old, field) == getattr(new, field), field
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"]


@pytest.mark.parametrize("key, message", [("attn_logit_softcapping", "attn_logit_softcapping is not supported"),
                                          ("use_bidirectional_attention", "causal attention only")])
def test_what_no_kernel_computes_is_refused(gemma, tmp_path, key, message):
    cfg = json.loads(open(f"{gemma[0]}/config.json").read()) | {key: 50.0 if "softcap" in key else True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_folder(str(tmp_path))
