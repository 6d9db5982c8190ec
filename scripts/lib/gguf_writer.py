"""Write a Llama-family Hugging Face folder as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py does, for the tests and benchmarks that feed GGUFs back into tokenloom.

    write_llama_gguf(folder, "model.f16.gguf", GGMLQuantizationType.F16)

- tensor names from gguf-py's TensorNameMap (`model.layers.0.self_attn.q_proj.weight`
  -> `blk.0.attn_q.weight`); a tied `lm_head` is left out, as llama.cpp does;
- q_proj/k_proj rows permuted from HF's rotary layout (first half / second half of each
  head) to llama.cpp's interleaved pairs: the inverse of transformers'
  `LlamaTensorProcessor._reverse_permute_weights`;
- 1-D tensors (norms) stay F32; 2-D weights are F16, or quantized with gguf-py's
  `gguf.quants.quantize` (Q8_0, Q4_0, ...);
- the tokenizer as llama.cpp's `gpt2` (byte-level BPE) metadata, read from tokenizer.json:
  tokens in id order, token types, merges, special token ids, the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType, get_tensor_name_map
from gguf.quants import quantize

FILE_TYPES = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
}


def permute_for_llama_cpp(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: per head, rows (x0..x_{d/2-1}, y0..y_{d/2-1}) -> (x0, y0, x1, y1, ...)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_llama_gguf(folder: Path, out_path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F16,
                     name: str = "tokenloom test model") -> Path:
    from safetensors.numpy import load_file

    folder, out_path = Path(folder), Path(out_path)
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        raise ValueError(f"only LlamaForCausalLM folders, not {config['architectures']}")
    num_layers, num_heads = config["num_hidden_layers"], config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    writer = GGUFWriter(out_path, "llama")
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, folder, config["vocab_size"])

    tensor_names = get_tensor_name_map(MODEL_ARCH.LLAMA, num_layers)
    state_dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        state_dict.update(load_file(path))
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{tensor_names.get_name(base)}.{suffix}"
        data = tensor.astype(np.float32)
        if hf_name.endswith("self_attn.q_proj.weight"):
            data = permute_for_llama_cpp(data, num_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            data = permute_for_llama_cpp(data, num_kv_heads)
        if data.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_tokenizer(writer: GGUFWriter, folder: Path, vocab_size: int, chat_template: bool = True) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    if tokenizer["model"]["type"] != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers, not {tokenizer['model']['type']}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # llama.cpp's filler for ids the vocab lacks
    types = [TokenType.UNUSED] * vocab_size
    for token, token_id in tokenizer["model"]["vocab"].items():
        tokens[token_id], types[token_id] = token, TokenType.NORMAL
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    token_config = json.loads((folder / "tokenizer_config.json").read_text())
    ids = {token: i for i, token in enumerate(tokens)}
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if token_config.get(key) in ids:
            add(ids[token_config[key]])
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"
    if chat_template and template.is_file():
        writer.add_chat_template(template.read_text())


# ---------------------------------------------------------------- random weights, any block type

# Where a block keeps its fp16 scale d and, for the types with one, its fp16 minimum (dmin or m),
# with the minimum's ratio to d that centres the weights near zero (ggml-common.h's layouts).
FP16_FIELDS = {
    "Q4_0": (0, None), "Q5_0": (0, None), "Q8_0": (0, None),
    "Q4_1": (0, (2, -7.5)), "Q5_1": (0, (2, -15.5)),  # w = d q + m
    "Q2_K": (80, (82, 1.5)), "Q4_K": (0, (2, 7.5)), "Q5_K": (0, (2, 15.5)),  # w = d sc q - dmin m
    "Q3_K": (108, None), "Q6_K": (208, None),
}


def random_blocks(shape: tuple[int, int], type_name: str, rng: np.random.Generator, std: float = 0.05,
                  centred: bool = False) -> np.ndarray:
    """[rows, bytes per row] uint8: valid blocks of `type_name` with random codes and sub-block
    scales, and fp16 scales set so the weights' standard deviation is about `std` (the gguf
    package cannot quantize to the K-quants, so they are made, not quantized). `centred`: each
    Q4_K/Q5_K sub-block's min equals its scale, so its weights centre on zero as a quantizer's
    fit of zero-mean data does (otherwise a random min per 32 weights outweighs their spread, and
    a row is nearly constant in each sub-block), and Q4_0's codes avoid -8 (otherwise every
    weight leans by -d/2, a mean shared by all rows)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, columns = shape
    num_blocks = columns // block_size
    blocks = rng.integers(0, 256, size=(rows, num_blocks, type_size), dtype=np.uint8)
    if centred and type_name in ("Q4_K", "Q5_K"):  # 12 bytes of 6-bit scales and mins at 4..16
        from engine.cpu.gguf_repack import pack_q4_k_scales_mins, q4_k_scales_mins

        scales, _ = q4_k_scales_mins(blocks[..., 4:16])
        blocks[..., 4:16] = pack_q4_k_scales_mins(scales, scales)
    if centred and type_name == "Q4_0":  # d (q - 8): code 0 (-8) made 8 (0), so -7..7 evenly, no mean of -d/2
        codes = blocks[..., 2:]
        low, high = codes & 0x0F, codes >> 4
        blocks[..., 2:] = np.where(low == 0, 8, low) | (np.where(high == 0, 8, high) << 4)
    d_offset, minimum = FP16_FIELDS[type_name]
    d = rng.uniform(0.5, 1.5, size=(rows, num_blocks)).astype(np.float32)
    # Measure the weights at d = 1 on a few rows, then scale d (and the minimum with it) to `std`.
    sample = min(rows, 16)
    _set_fp16(blocks[:sample], d_offset, d[:sample])
    if minimum is not None:
        _set_fp16(blocks[:sample], minimum[0], d[:sample] * minimum[1])
    measured = float(dequantize(blocks[:sample].reshape(sample, -1), qtype).std())
    d *= std / measured
    _set_fp16(blocks, d_offset, d)
    if minimum is not None:
        _set_fp16(blocks, minimum[0], d * minimum[1])
    return blocks.reshape(rows, num_blocks * type_size)


def _set_fp16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, :, offset:offset + 2] = values.astype(np.float16)[:, :, None].view(np.uint8)


def random_tensor(shape: tuple[int, ...], type_name: str, rng: np.random.Generator, std: float = 0.05,
                  centred: bool = False) -> np.ndarray:
    """A tensor's data as GGUFWriter takes it: float values for F32/F16, blocks otherwise."""
    if type_name in ("F32", "F16"):
        return (rng.standard_normal(shape) * std).astype(np.float32 if type_name == "F32" else np.float16)
    return random_blocks(shape, type_name, rng, std, centred)


def q4_k_m_types(num_layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M recipe, near enough: Q4_K, with Q6_K for the LM head and for attn_v
    and ffn_down in a few layers (the first and last eighth, and every third between)."""
    def more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2

    types = {"output": "Q6_K", "token_embd": "Q4_K"}
    for i in range(num_layers):
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{name}"] = "Q4_K"
        for name in ("attn_v", "ffn_down"):
            types[f"blk.{i}.{name}"] = "Q6_K" if more_bits(i) else "Q4_K"
    return types


def write_random_llama_gguf(out_path: Path, tokenizer_folder: Path, *, vocab_size: int, hidden_size: int,
                            intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                            types: str | dict[str, str] = "Q8_0", tie_word_embeddings: bool = False,
                            chat_template: bool = True, seed: int = 0, context_length: int = 2048,
                            std: float = 0.05, stds: dict[str, float] | None = None, centred: bool = False) -> Path:
    """A Llama GGUF with random weights in any ggml type (`types`: one name for every matmul
    weight, or llama.cpp tensor name without ".weight" -> type, e.g. q4_k_m_types), the tokenizer
    of `tokenizer_folder` padded to `vocab_size`, norms in F32, weights of about `std` (`stds`: another std
    for the tensors whose name ends with a key, e.g. {"ffn_down": 0.01}; `centred`: random_blocks'). Tensors are streamed to the file
    one at a time, so an 8B-shaped file needs no more memory than its largest tensor."""
    rng = np.random.default_rng(seed)
    head_dim = hidden_size // num_heads
    shapes = {"token_embd": (vocab_size, hidden_size)}
    if not tie_word_embeddings:
        shapes["output"] = (vocab_size, hidden_size)
    for i in range(num_layers):
        shapes.update({
            f"blk.{i}.attn_q": (num_heads * head_dim, hidden_size), f"blk.{i}.attn_k": (num_kv_heads * head_dim, hidden_size),
            f"blk.{i}.attn_v": (num_kv_heads * head_dim, hidden_size), f"blk.{i}.attn_output": (hidden_size, num_heads * head_dim),
            f"blk.{i}.ffn_gate": (intermediate_size, hidden_size), f"blk.{i}.ffn_up": (intermediate_size, hidden_size),
            f"blk.{i}.ffn_down": (hidden_size, intermediate_size),
        })
    norms = ["output_norm", *(f"blk.{i}.{n}" for i in range(num_layers) for n in ("attn_norm", "ffn_norm"))]
    type_of = (lambda name: types) if isinstance(types, str) else types.__getitem__

    writer = GGUFWriter(out_path, "llama")
    writer.add_name("tokenloom random llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab_size)
    _add_tokenizer(writer, tokenizer_folder, vocab_size, chat_template)
    for name, shape in shapes.items():
        type_name = type_of(name)
        qtype = GGMLQuantizationType[type_name]
        if type_name in ("F32", "F16"):
            dtype = np.float32 if type_name == "F32" else np.float16
            writer.add_tensor_info(f"{name}.weight", shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        else:
            from gguf import GGML_QUANT_SIZES

            block_size, type_size = GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // block_size * type_size)
            writer.add_tensor_info(f"{name}.weight", byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    for name in norms:
        writer.add_tensor_info(f"{name}.weight", (hidden_size,), np.dtype(np.float32), hidden_size * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in shapes.items():
        std_of = next((value for key, value in (stds or {}).items() if name.endswith(key)), std)
        writer.write_tensor_data(random_tensor(shape, type_of(name), rng, std_of, centred))
    for name in norms:
        writer.write_tensor_data(rng.uniform(0.5, 1.5, hidden_size).astype(np.float32))
    writer.close()
    return out_path
