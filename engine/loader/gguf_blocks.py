"""A GGUF's quantized blocks, kept as they are, for `--model x.gguf --quantization int8|int4`.

The converted folder (engine/loader/gguf_convert.py) holds the GGUF's weights dequantized to fp32;
quantizing those again would round a second time. Where the file's blocks are a format our
kernels run, the quantized linears take the blocks themselves instead:

    Q8_0 (d fp16, 32 int8)            -> int8, groups of 32 (engine/cpu/int8_linear.py)
    Q4_1 (d, m fp16, 32 4-bit codes)  -> int4 (engine/cpu/int4_linear.py): w = d q + m
    Q4_0 (d fp16, 32 4-bit codes)     -> int4 with m = -8 d: d (q - 8) = d q - 8 d, exact

What a weight's rows are called, and in which order, is transformers' GGUF loader's business
(names, llama.cpp's q/k row permutation, experts): `hf_row_sources` runs that loader on row
numbers instead of values, so the blocks follow the very path the folder's weights took.
`place_blocks` then writes each checkpoint tensor's rows into our merged weights (qkv_proj,
gate_up_proj) with the model's own loader. A weight whose rows are not all in blocks of the
scheme (Q6_K beside Q4_0, an F32 tensor) is quantized from the folder as before.

Reference for the block layouts: ggml/src/ggml-common.h (block_q4_0, block_q4_1, block_q8_0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.loader.gguf_model import ROW_SPAN

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per block, in all three types
SCHEME_OF_TYPE = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


@dataclass
class GgufBlocks:
    """One weight's blocks, unpacked row by row."""

    codes: torch.Tensor  # [rows, num_blocks * 32]: uint8 codes 0..15 (Q4_x) or int8 values (Q8_0)
    d: torch.Tensor  # [rows, num_blocks] fp16
    m: torch.Tensor | None  # [rows, num_blocks] fp16: Q4_1's minimum, Q4_0's -8 d; None for Q8_0

    def take_rows(self, rows: torch.Tensor) -> GgufBlocks:
        return GgufBlocks(self.codes[rows], self.d[rows], None if self.m is None else self.m[rows])

    def dequantize(self) -> torch.Tensor:
        """[rows, num_blocks * 32] fp32: d q (+ m), gguf-py's values bit for bit (each product
        of an fp16 and a small integer is exact in fp32; adding m rounds once, as it does)."""
        values = self.codes.float() * self.d.float().repeat_interleave(BLOCK, dim=1)
        if self.m is not None:
            values += self.m.float().repeat_interleave(BLOCK, dim=1)
        return values


def unpack_blocks(raw: np.ndarray, type_name: str) -> GgufBlocks:
    """A GGUF tensor's bytes ([rows, bytes per row] uint8) -> its blocks per row."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)  # [rows, num_blocks, bytes per block]
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0])  # [rows, num_blocks]
    if type_name == "Q8_0":
        values = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8))  # [rows, num_blocks, 32]
        return GgufBlocks(values.reshape(rows, -1), d, None)
    start = 2 if type_name == "Q4_0" else 4
    packed = torch.from_numpy(blocks[:, :, start:].copy())  # [rows, num_blocks, 16]: byte j = codes j, j + 16
    codes = torch.cat([packed & 15, packed >> 4], dim=2)  # [rows, num_blocks, 32]
    if type_name == "Q4_0":
        m = (d * -8).half()  # exact: a power-of-two multiple of an fp16
    else:
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0])
    return GgufBlocks(codes.reshape(rows, -1), d, m)


def read_gguf_blocks(gguf_path: Path, folder: Path, scheme: str) -> dict[str, GgufBlocks]:
    """Hugging Face parameter name -> its blocks, for every 2-D weight of the GGUF whose rows all
    come from one tensor quantized in a type `scheme` ("int8" or "int4") runs as it is."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    wanted = {i: tensor for i, tensor in enumerate(reader.tensors)
              if SCHEME_OF_TYPE.get(tensor.tensor_type.name) == scheme and tensor.data.ndim == 2}
    if not wanted:
        return {}
    unpacked: dict[int, GgufBlocks] = {}
    out = {}
    for hf_name, sources in hf_row_sources(gguf_path, folder).items():
        if sources.dim() != 1:
            continue
        indices = torch.unique(sources // ROW_SPAN)
        if len(indices) != 1 or int(indices[0]) not in wanted:
            continue
        index = int(indices[0])
        if index not in unpacked:
            unpacked[index] = unpack_blocks(wanted[index].data, wanted[index].tensor_type.name)
        out[hf_name] = unpacked[index].take_rows(sources % ROW_SPAN)
    return out


def hf_row_sources(gguf_path: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Hugging Face parameter name -> int64 row ids (GGUF tensor index * ROW_SPAN + row there),
    [rows] for a 2-D weight: transformers' GGUF loader run on row numbers (module docstring), as
    the GGUF loader itself maps the file (engine/loader/gguf_model.py)."""
    from engine.loader.gguf_file import open_gguf
    from engine.loader.gguf_model import map_checkpoint

    return map_checkpoint(open_gguf(gguf_path), folder).rows


def place_blocks(model: nn.Module, hf_blocks: dict[str, GgufBlocks]) -> dict[str, GgufBlocks]:
    """Our weight name (`layers.0.self_attn.qkv_proj.weight`) -> its blocks, through the
    model's own loader (which merges q, k, v and gate, up); only weights whose every row has
    blocks. A tied LM head takes the embedding's (the GGUF holds only `token_embd`)."""
    if not hf_blocks:
        return {}
    shapes = {f"{name}.weight": module.weight.shape for name, module in model.named_modules()
              if isinstance(module, nn.Linear)}
    is_tied = getattr(model.config, "tie_word_embeddings", False)
    if is_tied:  # the loader writes the checkpoint's embedding there, and skips lm_head
        shapes["embed_tokens.weight"] = shapes.pop("lm_head.weight")
    sample = next(iter(hf_blocks.values()))
    is_q4 = sample.m is not None
    codes, d, m = {}, {}, {}
    for name, (num_rows, num_inputs) in shapes.items():
        if num_inputs % BLOCK:
            continue
        codes[name] = torch.zeros(num_rows, num_inputs, dtype=sample.codes.dtype)
        d[name] = torch.full((num_rows, num_inputs // BLOCK), float("nan"), dtype=torch.float16)
        m[name] = torch.zeros(num_rows, num_inputs // BLOCK, dtype=torch.float16)
    model.load_weights(((n, b.codes) for n, b in hf_blocks.items()), into=codes)
    model.load_weights(((n, b.d) for n, b in hf_blocks.items()), into=d)
    if is_q4:
        model.load_weights(((n, b.m) for n, b in hf_blocks.items()), into=m)
    placed = {name: GgufBlocks(codes[name], d[name], m[name] if is_q4 else None)
              for name in codes if not d[name].isnan().any()}
    if is_tied and "embed_tokens.weight" in placed:
        placed["lm_head.weight"] = placed.pop("embed_tokens.weight")
    return placed


def blocks_for_model(model: nn.Module, model_arg: str, folder: str, scheme: str) -> dict[str, GgufBlocks]:
    """The blocks `place_blocks` gives, where `model_arg` (what the user passed as --model) is a
    GGUF file; else none. A file the loader cannot map row by row is quantized from the folder
    instead, and the log says so."""
    path = Path(model_arg).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return {}
    try:
        placed = place_blocks(model, read_gguf_blocks(path, Path(folder), scheme))
    except Exception as error:  # noqa: BLE001 - the folder's weights serve instead
        logger.warning("%s: its blocks could not be mapped onto the model (%s); quantizing the converted "
                       "folder's weights instead", path.name, error)
        return {}
    # The folder holds the same file dequantized: each weight's blocks must give its values
    # exactly, else the mapping went wrong somewhere and that weight is quantized from the folder.
    matching = {name: b for name, b in placed.items() if _equals_weight(model, name, b)}
    if len(matching) < len(placed):
        logger.warning("%s: %d weights' blocks disagree with the converted folder (%s); those are quantized "
                       "from the folder", path.name, len(placed) - len(matching),
                       ", ".join(sorted(set(placed) - set(matching))[:3]))
    logger.info("%s: %d weights keep the GGUF's own blocks (%s)", path.name, len(matching), scheme)
    return matching


def _equals_weight(model: nn.Module, name: str, blocks: GgufBlocks, rows_at_a_time: int = 4096) -> bool:
    """Whether the blocks give the model's loaded weight exactly; a few thousand rows at a time,
    so a large vocabulary's head is not dequantized whole."""
    weight = model.get_submodule(name.removesuffix(".weight")).weight  # a tied head: the embedding's tensor
    for start in range(0, weight.shape[0], rows_at_a_time):
        rows = slice(start, start + rows_at_a_time)
        part = GgufBlocks(blocks.codes[rows], blocks.d[rows], None if blocks.m is None else blocks.m[rows])
        if not torch.equal(part.dequantize().to(weight.dtype), weight[rows].detach().cpu()):
            return False
    return True
