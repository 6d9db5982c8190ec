"""LoRA adapters over a quantized base (QLoRA-style serving): the adapters run in the activations'
dtype beside the base's own linears, here a GGUF file's Q8_0 blocks (engine/cpu/gguf_linear.py);
int8/int4 go through the same LoRALinear, their tests need AVX512_VNNI (tests/helpers/models.py).
The reference is transformers + peft in fp32 on the file's dequantized weights; where the Q8_0
kernel runs the blocks it quantizes the activations too, so the top-1 tokens agree as the base's do
(tests/models/test_gguf_direct.py), else exactly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.cpu.gguf_kernels import load_gguf_kernels
from engine.loader.gguf_convert import convert_gguf
from engine.lora.lora_layers import LoRALinear
from tests.helpers.lora import make_peft_adapter
from tests.models.test_gguf_direct import MIN_KEPT_AGREEMENT, kept_and_dense, prompts, write_tiny
from tests.models.test_gguf_files import write_tiny_llama


def test_an_adapter_over_q8_0_blocks_agrees_with_peft_on_the_dequantized_weights(in_gguf_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer_folder, _ = write_tiny_llama(tmp_path / "tokenizer")
    path = write_tiny(tmp_path / "tiny.q8_0.gguf", tokenizer_folder, "Q8_0")
    convert_gguf(path, tmp_path / "fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    adapter, peft_model = make_peft_adapter(hf_model, tmp_path / "adapter", r=16, lora_alpha=32, std=0.05)
    llm = LLM(model=str(path), dtype="float32", block_size=4, enable_lora=True)
    model = llm.engine.model_runner.model
    assert isinstance(model.layers[0].mlp.down_proj, LoRALinear)
    kept, _ = kept_and_dense(model)
    token_ids = prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(token_ids, params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    ours = [entry.top_token_ids[0] for o in outputs for entry in o.prompt_logprobs[1:]]
    with torch.inference_mode():
        expected = peft_model(torch.tensor(token_ids)).logits[:, :-1].argmax(-1).flatten().tolist()
        base = hf_model(torch.tensor(token_ids)).logits[:, :-1].argmax(-1).flatten().tolist()
    assert sum(a != b for a, b in zip(expected, base)) > len(base) // 4  # the adapter moves many tokens
    if "Q8_0" in load_gguf_kernels().types:
        assert kept > 0
        assert sum(a == b for a, b in zip(ours, expected)) >= MIN_KEPT_AGREEMENT * len(expected)
    else:
        assert ours == expected
