"""A GGUF file's tensors, read one at a time into buffers we own.

    open_gguf(path)                     the tensors' names, types, shapes and byte ranges;
                                        ValueError for a truncated or corrupt file
    read_tensor(path, info)             [rows, bytes per row] uint8: a tensor's blocks
    dequantize_rows(raw, type, dtype)   [rows, columns] in `dtype`, gguf-py's values

Why not GGUFReader's `tensor.data`: it is a view into a memory map of the whole file, and
the pages of a memory-mapped file count in a process's RSS once touched; a loader that reads
every tensor through it and copies it keeps the whole file resident beside the model (twice
the file at the peak). `read_tensor` reads with `readinto` straight into a tensor, so the
file's bytes pass through the page cache only, and the peak is the model plus one tensor.

A row is the last dimension (ggml's ne0, what a matmul reduces over); every block type packs
whole rows, so rows can be permuted or split (q, k, v) without touching the blocks.

Reference: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.loader.model_files import GGUF_MAGIC

# Output rows per dequantized chunk: gguf-py's numpy dequantizers make a few temporaries the
# chunk's size, so a large tensor (an 8B model's embedding, 2 GB in fp32) is done in pieces.
DEQUANTIZE_CHUNK_VALUES = 1 << 22
MAX_COUNT = 1 << 24  # more tensors or metadata fields than this: a corrupt header


@dataclass(frozen=True)
class GgufTensorInfo:
    """Where one tensor lies in the file, and its shape as rows of blocks."""

    index: int  # its place in the file's tensor list (transformers' loader visits them in this order)
    name: str  # llama.cpp's name: "blk.0.attn_q.weight"
    type_name: str  # ggml type: "Q4_K", "F32"
    shape: tuple[int, ...]  # numpy order, rows first: (out_features, in_features) for a matmul weight
    offset: int  # of its first byte in the file
    num_bytes: int

    @property
    def num_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.num_bytes // self.num_rows


@dataclass(frozen=True)
class GgufFile:
    path: Path
    tensors: tuple[GgufTensorInfo, ...]
    metadata: dict[str, str | int | float | bool]  # the scalar and string fields ("general.architecture")

    @property
    def num_bytes(self) -> int:
        return self.path.stat().st_size


def open_gguf(path: Path) -> GgufFile:
    """The tensors and scalar metadata of a GGUF file, checked against the file's size; ValueError
    naming the file when it is truncated or corrupt. Its own reader of the header: GGUFReader
    makes a numpy view of every token of the vocabulary (30 s for a 128k-token file)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = _HeaderReader(f, path.name, size)
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
        version, num_tensors, num_fields = header.unpack("<IQQ")
        if version not in (2, 3) or num_tensors > MAX_COUNT or num_fields > MAX_COUNT:
            raise ValueError(f"{path.name}: corrupt GGUF header (version {version}, {num_tensors} tensors, "
                             f"{num_fields} metadata fields)")
        metadata = {}
        for _ in range(num_fields):
            key = header.string()
            value = header.value(header.unpack("<I")[0])
            if value is not None:
                metadata[key] = value
        raw_infos = []
        for _ in range(num_tensors):
            name = header.string()
            (num_dims,) = header.unpack("<I")
            if num_dims > 4:
                raise ValueError(f"{path.name}: corrupt GGUF: tensor {name} has {num_dims} dimensions")
            dims = header.unpack(f"<{num_dims}Q")
            type_id, offset = header.unpack("<IQ")
            raw_infos.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
    tensors = []
    for index, (name, dims, type_id, offset) in enumerate(raw_infos):
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path.name}: tensor {name} has ggml type {type_id}, which the gguf package "
                             "does not know (a newer type?)") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_elements = int(np.prod(dims, dtype=np.int64))
        info = GgufTensorInfo(index=index, name=name, type_name=qtype.name, shape=tuple(reversed(dims)),
                              offset=data_start + offset, num_bytes=num_elements // block_size * type_size)
        if info.offset + info.num_bytes > size:
            raise ValueError(f"{path.name}: truncated GGUF: tensor {info.name} ends at byte "
                             f"{info.offset + info.num_bytes}, the file has {size}")
        tensors.append(info)
    return GgufFile(path, tuple(tensors), metadata)


class _HeaderReader:
    """Reads a GGUF header's records; scalars and strings kept, arrays skipped over."""

    SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
    FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9

    def __init__(self, f, name: str, size: int) -> None:
        self.f, self.name, self.size = f, name, size

    def read(self, count: int) -> bytes:
        data = self.f.read(count)
        if len(data) != count:
            raise ValueError(f"{self.name}: truncated GGUF: its header ends early ({self.size} bytes)")
        return data

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        if length > self.size:
            raise ValueError(f"{self.name}: corrupt GGUF: a string of {length} bytes")
        return self.read(length).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type == self.STRING:
            return self.string()
        if value_type == self.ARRAY:  # the vocabulary, merges, token types: not needed here
            item_type, count = self.unpack("<IQ")
            if item_type == self.STRING:
                for _ in range(count):
                    (length,) = self.unpack("<Q")
                    self.f.seek(length, os.SEEK_CUR)
            elif item_type in self.SIZES and count * self.SIZES[item_type] <= self.size:
                self.f.seek(count * self.SIZES[item_type], os.SEEK_CUR)
            else:
                raise ValueError(f"{self.name}: corrupt GGUF: an array of {count} items of type {item_type}")
            return None
        if value_type not in self.FORMATS:
            raise ValueError(f"{self.name}: corrupt GGUF: metadata value type {value_type}")
        return self.unpack(self.FORMATS[value_type])[0]


def read_tensor(path: Path, info: GgufTensorInfo) -> torch.Tensor:
    """[rows, bytes per row] uint8: the tensor's bytes as they are in the file."""
    raw = torch.empty(info.num_rows, info.row_bytes, dtype=torch.uint8)
    view = memoryview(raw.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(info.offset)
        done = 0
        while done < info.num_bytes:  # readinto may return less than asked for
            count = f.readinto(view[done:])
            if not count:
                raise ValueError(f"{Path(path).name}: truncated GGUF: tensor {info.name} ends early")
            done += count
    return raw


def can_dequantize(type_name: str) -> bool:
    """Whether the gguf package has a dequantizer for this ggml type."""
    import gguf
    from gguf.quants import _type_traits

    qtype = gguf.GGMLQuantizationType[type_name]
    return qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or qtype in _type_traits


def dequantize_rows(raw: torch.Tensor, type_name: str, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, bytes per row] uint8 of one ggml type -> [rows, columns] in `dtype` (into `out`
    when given): gguf-py's fp32 values, a chunk of rows at a time, then cast."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_rows = raw.shape[0]
    num_columns = raw.shape[1] // type_size * block_size
    if out is None:
        out = torch.empty(num_rows, num_columns, dtype=dtype)
    chunk = max(1, DEQUANTIZE_CHUNK_VALUES // max(num_columns, 1))
    source = raw.numpy()
    for start in range(0, num_rows, chunk):
        values = dequantize(source[start:start + chunk], qtype)  # [chunk, columns] fp32
        out[start:start + chunk].copy_(torch.from_numpy(np.ascontiguousarray(values)))
    return out


def available_memory_bytes() -> int:
    """The kernel's estimate of memory that can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")
