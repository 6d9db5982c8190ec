"""A GGUF's Q8_0, Q4_0 and Q4_1 blocks kept as they are under `--quantization int8|int4`
(engine/loader/gguf_blocks.py): unpacked to exactly gguf-py's dequantized values; placed into our
merged weights (q/k rows un-permuted as transformers' loader does, q, k, v and gate, up merged,
the tied head from the embedding) so each quantized linear reads back the converted folder's
weights bit for bit; and the engine on them gives the same tokens as on the folder's weights
requantized, where that requantization is exact (Q4_1), and runs from the blocks where it is not."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.loader.gguf_blocks import read_gguf_blocks, unpack_blocks
from engine.loader.gguf_convert import convert_gguf
from engine.loader.model_files import resolve_model
from engine.loader.gguf_model import load_gguf_model
from engine.models.config import ModelConfig
from engine.cpu.gguf_linear import GgufLinear
from engine.cpu.int8_linear import QuantizedLinear
from scripts.lib.gguf_writer import write_llama_gguf
from tests.helpers.models import quantization_runs
from tests.models.test_gguf_files import write_tiny_llama

needs_vnni = pytest.mark.skipif(not (quantization_runs("int8") and quantization_runs("int4")),
                                reason="int8/int4 need AVX512_VNNI or AVX2")
# The quantized matmuls: the vpdpbusd panels (AVX512_VNNI), or llama.cpp blocks on the AVX2 kernels.
QUANTIZED = (QuantizedLinear, GgufLinear)
SCHEME = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_unpacked_blocks_are_gguf_py_values(type_name):
    qtype = GGMLQuantizationType[type_name]
    weights = np.random.default_rng(0).normal(0, 0.1, (40, 96)).astype(np.float32)
    weights[3, :32] = 0  # an all-zero block
    raw = quantize(weights, qtype)  # [40, bytes per row]
    blocks = unpack_blocks(raw, type_name)
    assert blocks.codes.shape == (40, 96) and blocks.d.shape == (40, 3) and blocks.d.dtype == torch.float16
    if blocks.m is not None:
        assert int(blocks.codes.min()) >= 0 and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-blocks")
    folder, _ = write_tiny_llama(root)
    files = {name: write_llama_gguf(folder, root / f"tiny.{name}.gguf", GGMLQuantizationType[name])
             for name in SCHEME}
    return folder, files


def our_fp32_weights(folder, gguf_path) -> dict[str, torch.Tensor]:
    """Our model's weights from the GGUF, every tensor dequantized to fp32 (gguf-py's values)."""
    model = load_gguf_model(ModelConfig.from_folder(folder), gguf_path, torch.float32, torch.device("cpu"))
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize("type_name", list(SCHEME))
def test_blocks_map_onto_the_checkpoint_names(type_name, tiny, in_gguf_cache, tmp_path):
    _, files = tiny
    converted = tmp_path / "fp32"  # the file dequantized, as the default model's folder is made
    convert_gguf(files[type_name], converted)
    blocks = read_gguf_blocks(files[type_name], converted, SCHEME[type_name])
    # Every 2-D weight of the tiny Llama: 7 a layer, and the (tied) embedding.
    assert len(blocks) == 2 * 7 + 1 and "model.embed_tokens.weight" in blocks
    from safetensors.torch import load_file

    folder_weights = load_file(f"{converted}/model.safetensors")
    for name, b in blocks.items():  # the q/k rows un-permuted: the folder's rows, in its order
        assert torch.equal(b.dequantize(), folder_weights[name]), name
    assert read_gguf_blocks(files[type_name], converted, "int4" if SCHEME[type_name] == "int8" else "int8") == {}


@needs_vnni
@pytest.mark.parametrize("type_name", list(SCHEME))
def test_engine_keeps_the_gguf_blocks(type_name, tiny, in_gguf_cache, caplog, monkeypatch):
    _, files = tiny
    with caplog.at_level(logging.INFO):
        llm = LLM(str(files[type_name]), quantization=SCHEME[type_name], skip_tokenizer_init=True)
    model = llm.engine.model_runner.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QUANTIZED)}
    assert len(linears) == 2 * 4 + 1 and all(m.from_gguf for m in linears.values())
    kind = "Q8_0 blocks" if type_name == "Q8_0" else "Q4_0/Q4_1 blocks"
    assert any(f"9 of them the GGUF's own {kind}" in r.getMessage() for r in caplog.records)
    if type_name == "Q8_0":
        assert all(m.quantized.group_size == 32 if isinstance(m, QuantizedLinear) else m.type_names == ["Q8_0"]
                   for m in linears.values())
    # Each matmul's weight, read back from its panels or blocks, is the file's, bit for bit.
    reference = our_fp32_weights(llm.engine.model_path, files[type_name])
    for name, linear in linears.items():
        expected = reference["embed_tokens.weight" if name == "lm_head" else f"{name}.weight"]
        assert torch.equal(linear.dequantize_rows(torch.arange(linear.out_features)), expected), name
    tokens = [o.token_ids for o in llm.generate([[5, 17, 42, 9], [100, 3]], GREEDY, use_tqdm=False)]
    llm.shutdown()
    if type_name == "Q4_1":  # requantizing the dequantized weights gives the same blocks: the same tokens
        import engine.loader.gguf_blocks as gguf_blocks

        monkeypatch.setattr(gguf_blocks, "read_gguf_blocks", lambda *args: {})
        requantized = LLM(str(files[type_name]), quantization="int4", skip_tokenizer_init=True)
        assert not any(m.from_gguf for m in requantized.engine.model_runner.model.modules()
                       if isinstance(m, QUANTIZED))
        assert [o.token_ids for o in requantized.generate([[5, 17, 42, 9], [100, 3]], GREEDY,
                                                          use_tqdm=False)] == tokens
        requantized.shutdown()


@needs_vnni
def test_folder_and_other_schemes_quantize_as_before(tiny, in_gguf_cache):
    """A folder, or a GGUF whose blocks are not the scheme's (Q8_0 under int4), is quantized
    from the weights as before."""
    folder, files = tiny
    for model, quantization in ((str(folder), "int8"), (str(files["Q8_0"]), "int4")):
        llm = LLM(model, quantization=quantization, skip_tokenizer_init=True)
        linears = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, QUANTIZED)]
        assert linears and not any(m.from_gguf for m in linears)
        llm.shutdown()


@needs_vnni
def test_blocks_that_disagree_with_the_folder_are_not_kept(tiny, in_gguf_cache, monkeypatch, caplog):
    """A mapping gone wrong (here: one weight's rows reversed) is caught at load: that weight is
    quantized from the folder instead, the others keep their blocks, and the log says so."""
    import engine.loader.gguf_blocks as gguf_blocks

    _, files = tiny
    read = gguf_blocks.read_gguf_blocks

    def one_weight_reversed(*args):
        blocks = read(*args)
        name = "model.layers.0.mlp.down_proj.weight"
        blocks[name] = blocks[name].take_rows(torch.arange(len(blocks[name].d) - 1, -1, -1))
        return blocks

    monkeypatch.setattr(gguf_blocks, "read_gguf_blocks", one_weight_reversed)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(files["Q8_0"]), quantization="int8", skip_tokenizer_init=True)
    model = llm.engine.model_runner.model
    assert not model.layers[0].mlp.down_proj.from_gguf and model.layers[1].mlp.down_proj.from_gguf
    assert any("1 weights' blocks disagree" in r.getMessage() and "layers.0.mlp.down_proj" in r.getMessage()
               for r in caplog.records)
    llm.shutdown()


def test_the_load_check_reads_every_row_in_chunks():
    from engine.loader.gguf_blocks import _equals_weight

    raw = quantize(np.random.default_rng(1).normal(0, 0.1, (10, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    blocks = unpack_blocks(raw, "Q8_0")
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 10, bias=False)
    with torch.no_grad():
        model.proj.weight.copy_(blocks.dequantize())
    assert _equals_weight(model, "proj.weight", blocks, rows_at_a_time=3)
    with torch.no_grad():
        model.proj.weight[9, 5] += 1e-3  # in the last, partial chunk
    assert not _equals_weight(model, "proj.weight", blocks, rows_at_a_time=3)
