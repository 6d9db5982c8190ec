"""A GGUF served from its own blocks (engine/loader/gguf_model.py): no fp32 folder, each tensor in
its own type, base models without a chat template, and honest errors at start.

The files are written here with random weights (scripts/lib/gguf_writer.write_random_llama_gguf:
valid blocks of any type, the K-quants too) at a tiny Llama shape whose rows are whole K-quant
super-blocks (256 inputs). The reference is transformers in fp32 on the file's dequantized
weights: engine/loader/gguf_convert.convert_gguf's folder, gguf-py's values exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.cpu.gguf_kernels import load_gguf_kernels
from engine.loader.gguf_convert import convert_gguf
from engine.loader.gguf_file import open_gguf
from engine.loader.model_files import gguf_folder, resolve_model
from scripts.lib.gguf_writer import q4_k_m_types, write_random_llama_gguf
from tests.helpers.server import REAL_ENGINE_ARGS
from tests.models.test_gguf_files import write_tiny_llama
from scripts.lib.fake_engine import FrontendServer

TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2)
# Where a kernel runs the blocks it quantizes the activations to 8 bits a block, as llama.cpp does
# (about 0.7% relative error a matmul on these weights): near ties flip. Measured on this tiny random
# model with the gguf-kernels branch: 0.95-0.98. The loader's own part, the blocks, is checked exactly.
MIN_KEPT_AGREEMENT = 0.93
NUM_PROMPTS, PROMPT_LEN = 4, 64


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder, _ = write_tiny_llama(tmp_path_factory.mktemp("gguf-direct-tokenizer"))
    return folder


def write_tiny(path: Path, tokenizer_folder: Path, types, **kwargs) -> Path:
    vocab_size = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    return write_random_llama_gguf(path, tokenizer_folder, vocab_size=vocab_size, **SHAPE, types=types, **kwargs)


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (NUM_PROMPTS, PROMPT_LEN), generator=generator).tolist()


def our_top1(llm: LLM, token_ids: list[list[int]]) -> list[int]:
    """The engine's most likely next token at each teacher-forced position of each prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(token_ids, params, use_tqdm=False)
    return [entry.top_token_ids[0] for o in outputs for entry in o.prompt_logprobs[1:]]


def reference_top1(gguf_path: Path, work: Path, token_ids: list[list[int]]) -> list[int]:
    """transformers in fp32 on the file's dequantized weights, position by position."""
    from transformers import AutoModelForCausalLM

    convert_gguf(gguf_path, work / "fp32")
    model = AutoModelForCausalLM.from_pretrained(work / "fp32", dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor(token_ids)).logits  # [prompts, tokens, vocab]
    return logits[:, :-1].argmax(-1).flatten().tolist()


def assert_kept_blocks_are_the_files(model: nn.Module, path: Path) -> None:
    """Each matmul kept in blocks dequantizes, bit for bit, to the weight the dequantizing path
    builds from the same file (rows permuted and merged alike)."""
    from engine.loader.gguf_model import load_gguf_model
    from engine.models.config import ModelConfig

    gguf_linear = load_gguf_kernels().linear
    if gguf_linear is None:
        return
    dense = load_gguf_model(ModelConfig.from_folder(gguf_folder(path)), path, torch.float32, torch.device("cpu"))
    for name in model.gguf_types:
        module = model.get_submodule(name)
        if isinstance(module, gguf_linear):
            assert torch.equal(module.dequantize(), dense.get_submodule(name).weight), name


def kept_and_dense(model: nn.Module) -> tuple[int, int]:
    """How many of the file's matmuls (and embedding) run on its blocks, and how many were dequantized."""
    gguf_linear = load_gguf_kernels().linear
    kept = sum(gguf_linear is not None and isinstance(m, gguf_linear) for m in model.modules())
    return kept, len(model.gguf_types) - kept


@pytest.mark.slow
@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_agrees_with_fp32_on_the_dequantized_file(type_name, tokenizer_folder, in_gguf_cache, tmp_path):
    path = write_tiny(tmp_path / f"tiny.{type_name}.gguf", tokenizer_folder, type_name)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    model = llm.engine.model_runner.model
    assert_kept_blocks_are_the_files(model, path)
    token_ids = prompts(llm.engine.vocab_size)
    ours = our_top1(llm, token_ids)
    llm.shutdown()
    expected = reference_top1(path, tmp_path, token_ids)
    agreement = sum(a == b for a, b in zip(ours, expected)) / len(expected)
    kept, dense = kept_and_dense(model)
    print(f"{type_name}: top-1 agreement {agreement:.4f} over {len(expected)} positions; "
          f"{kept} matmuls kept in blocks, {dense} dequantized")
    if type_name in load_gguf_kernels().types:
        assert kept > 0 and agreement >= MIN_KEPT_AGREEMENT
    else:  # dequantized into fp32: gguf-py's values, the reference's own weights
        assert kept == 0 and agreement == 1.0


def test_q8_0_file_serves_exactly_and_writes_no_weights(tokenizer_folder, in_gguf_cache, tmp_path):
    path = write_tiny(tmp_path / "tiny.q8_0.gguf", tokenizer_folder, "Q8_0", tie_word_embeddings=True)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    token_ids = prompts(llm.engine.vocab_size)
    ours = our_top1(llm, token_ids)
    llm.shutdown()
    expected = reference_top1(path, tmp_path, token_ids)
    if "Q8_0" in load_gguf_kernels().types:  # its kernel quantizes activations: near, not exact
        assert sum(a == b for a, b in zip(ours, expected)) >= MIN_KEPT_AGREEMENT * len(expected)
    else:  # dequantized into fp32: the reference's own weights
        assert ours == expected
    # The cache holds the small files only: no weights, no fp32 folder.
    folder = gguf_folder(path)
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["chat_template.jinja", "config.json", "generation_config.json", "gguf_source.json",
                     "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((folder / "gguf_source.json").read_text())["path"] == str(path.resolve())
    assert not list((in_gguf_cache / "models").rglob("*.safetensors"))
    assert sum(p.stat().st_size for p in folder.iterdir()) < path.stat().st_size


def test_q4_k_m_file_keeps_each_tensors_own_type(tokenizer_folder, in_gguf_cache, tmp_path):
    types = q4_k_m_types(SHAPE["num_layers"])
    path = write_tiny(tmp_path / "tiny.q4_k_m.gguf", tokenizer_folder, types)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    model = llm.engine.model_runner.model
    kernels = load_gguf_kernels()
    for i in range(SHAPE["num_layers"]):
        name = f"layers.{i}"
        expected = {
            "self_attn.qkv_proj": (types[f"blk.{i}.attn_q"], types[f"blk.{i}.attn_k"], types[f"blk.{i}.attn_v"]),
            "self_attn.o_proj": (types[f"blk.{i}.attn_output"],),
            "mlp.gate_up_proj": (types[f"blk.{i}.ffn_gate"], types[f"blk.{i}.ffn_up"]),
            "mlp.down_proj": (types[f"blk.{i}.ffn_down"],),
        }
        for module_name, module_types in expected.items():
            assert model.gguf_types[f"{name}.{module_name}"] == module_types
            module = model.get_submodule(f"{name}.{module_name}")
            is_kept = all(t in kernels.types for t in module_types)
            assert is_kept == (kernels.linear is not None and isinstance(module, kernels.linear)), module_name
    assert model.gguf_types["lm_head"] == ("Q6_K",) and model.gguf_types["embed_tokens"] == ("Q4_K",)
    assert {"Q6_K"} <= {t for types_ in model.gguf_types.values() for t in types_}
    llm.shutdown()


def test_base_model_without_chat_template_serves_completions(tokenizer_folder, in_gguf_cache, tmp_path):
    path = write_tiny(tmp_path / "base.gguf", tokenizer_folder, "Q8_0", chat_template=False)
    with FrontendServer(path, *REAL_ENGINE_ARGS, "--dtype", "float32") as server:
        completion = requests.post(f"{server.url}/v1/completions", json={
            "model": "smollm2", "prompt": "hello world", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}, timeout=120)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 5
        generate = requests.post(f"{server.url}/generate", json={"prompt": "hello", "max_tokens": 3,
                                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
        assert generate.status_code == 200, generate.text
        chat = requests.post(f"{server.url}/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}, timeout=120)
        assert chat.status_code == 400
        assert "no chat template" in chat.json()["error"]["message"]
    assert not (gguf_folder(path) / "chat_template.jinja").exists()


# ---------------------------------------------------------------- honest errors at start


def test_truncated_gguf_is_named(tokenizer_folder, in_gguf_cache, tmp_path):
    path = write_tiny(tmp_path / "cut.gguf", tokenizer_folder, "Q4_K")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"cut\.gguf: the gguf package .* cannot read it: .* A truncated or corrupt"):
        resolve_model(str(path))
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated GGUF: tensor .* ends at byte \d+, the file has"):
        open_gguf(path)  # the loader's own reader of the header, as the engine opens the file
    path.write_bytes(data[:200])  # the header itself cut
    with pytest.raises(ValueError, match=r"cut\.gguf: the gguf package .* cannot read it: .* A truncated or corrupt"):
        resolve_model(str(path))
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated GGUF: its header ends early"):
        open_gguf(path)
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # garbage after the magic
    with pytest.raises(ValueError, match=r"cut\.gguf: the gguf package .* cannot read it"):
        resolve_model(str(path))
    with pytest.raises(ValueError, match=r"cut\.gguf: corrupt GGUF header"):
        open_gguf(path)
    assert not gguf_folder(path).exists()


def test_file_larger_than_the_memory_left_is_refused(tokenizer_folder, in_gguf_cache, tmp_path, monkeypatch):
    import engine.loader.gguf_model as gguf_model

    path = write_tiny(tmp_path / "big.gguf", tokenizer_folder, "Q8_0")
    allocated = []
    monkeypatch.setattr(gguf_model, "available_memory_bytes", lambda: 1 << 20)  # a machine with 1 MiB left
    monkeypatch.setattr(gguf_model, "_fill_matmul", lambda *args: allocated.append(args))
    with pytest.raises(ValueError, match=r"big\.gguf \(0\.00 GB\) needs \d+\.\d\d GB of memory: .* KV pool; only 0\.00 "
                                         r"GB is available \(MemAvailable\)"):
        LLM(model=str(path), dtype="float32", block_size=4)
    assert not allocated  # refused before reading a single matmul's blocks


def test_type_with_no_kernel_and_no_dequantizer_is_named(tokenizer_folder, in_gguf_cache, tmp_path, monkeypatch):
    import engine.loader.gguf_model as gguf_model

    path = write_tiny(tmp_path / "odd.gguf", tokenizer_folder, "Q4_K")
    # No dequantizer for Q4_K (as for a type newer than the gguf package): only a kernel could run it.
    monkeypatch.setattr(gguf_model, "can_dequantize", lambda type_name: type_name != "Q4_K")
    if "Q4_K" in load_gguf_kernels().types:
        LLM(model=str(path), dtype="float32", block_size=4).shutdown()  # its kernel runs it
        return
    with pytest.raises(ValueError, match=r"odd\.gguf: tensor .* is quantized as Q4_K, which has no kernel on this "
                                         r"CPU and which the gguf package cannot dequantize"):
        LLM(model=str(path), dtype="float32", block_size=4)


def test_unknown_architecture_is_named(tmp_path, in_gguf_cache):
    from tests.models.test_gguf_files import write_minimal_gguf
    from gguf import GGMLQuantizationType

    path = write_minimal_gguf(tmp_path / "rwkv.gguf", "rwkv7", GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match=r"rwkv\.gguf: transformers' GGUF loader cannot read architecture 'rwkv7'"):
        resolve_model(str(path))
