"""Write a Llama-family Hugging Face folder as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py does, for tests that feed GGUFs back into tokenloom.

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


def _add_tokenizer(writer: GGUFWriter, folder: Path, vocab_size: int) -> None:
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
    if template.is_file():
        writer.add_chat_template(template.read_text())
