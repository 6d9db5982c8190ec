"""The CPU attention backend: the head-major cache layout (head_major.py, shared with the
torch backend), with attention in C++ kernels.

The kernels read each sequence's blocks in place through its block table
instead of gathering them into copies:

- decodes (one query token) in engine/cpu/csrc/paged_decode_attention.cpp,
  one (sequence, KV head) per task, the whole GQA group per K/V row;
- prefill chunks (a whole prompt, a chunk after earlier context or after a
  cached prefix) in engine/cpu/csrc/paged_prefill_attention.cpp, flash-style
  over tiles of queries, causal by position with no mask tensor. The torch path
  gathered every context block per layer and ran SDPA with a boolean mask, which
  on a short chunk after a long cached prefix reached a small part of the
  matmul rate;
- decodes whose sequences share a cached prefix (a system prompt: their block
  tables start with the same blocks) in paged_shared_decode_attention.cpp, on the
  prefill kernel's tiles (attention_tiles.h): the group's query rows go through
  each shared block together, as a prompt's do, so the block is read and scored
  once per group, not once per sequence (a decode of 64 sequences behind four
  1,024-token prompts spent most of its time re-scoring the prompts). Each
  sequence's own blocks follow, for its rows only.

A sliding-window layer passes its window to the decode and prefill kernels, which then
read only the blocks inside it. Its decodes skip the shared-prefix kernel (a shared
prompt soon lies outside every window) and go to the decode kernel, all of them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention import head_major
from engine.attention.backend import KVCache
from engine.attention.metadata import NO_WINDOW, AttentionMetadata


@dataclass
class _KernelDecodePlan:
    rows: torch.Tensor | None  # [num_decode_seqs] query row of each decode sequence; None: row i is sequence i
    block_tables: torch.Tensor  # [num_decode_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_decode_seqs] int32


@dataclass
class _SharedDecodePlan:
    members: torch.Tensor  # [num_members] int32: decode sequences, group by group
    group_starts: torch.Tensor  # [num_groups + 1] int32: each group's first member
    shared_blocks: torch.Tensor  # [num_groups] int32: leading blocks every member of the group holds


# A group of decodes goes through the shared-decode tiles when it shares at least this many
# tokens: below it, scoring each sequence on its own costs no more than the tile's transposes.
MIN_SHARED_TOKENS = 64


class CpuAttentionBackend:
    name = "cpu"
    can_rotate_and_store = True

    def __init__(self, kernels: ModuleType, block_size: int, windows: tuple[int, ...] = (NO_WINDOW,)) -> None:
        """`windows`: those the model's layers use (any window > 0: its decodes are planned per step)."""
        self._kernels = kernels
        self._block_size = block_size
        self._has_windows = any(window > 0 for window in windows)
        self._metadata: AttentionMetadata | None = None
        self._slots: head_major.Slots | None = None
        self._prefill_seq_indices: torch.Tensor | None = None  # [num_prefill_seqs] int32
        self._shared: _SharedDecodePlan | None = None
        self._decode: _KernelDecodePlan | None = None  # decodes outside every shared group
        self._windowed_decode: _KernelDecodePlan | None = None  # every decode, for windowed layers

    kv_cache_shape = staticmethod(head_major.kv_cache_shape)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Split the step, once, into decodes (alone or in groups sharing a prefix) and
        prefill chunks; every layer reuses it."""
        block_size = self._block_size
        self._metadata = metadata
        self._slots = head_major.split_slots(metadata.slot_mapping, block_size)
        decode_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
        prefill_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n > 1]
        self._prefill_seq_indices = torch.tensor(prefill_seqs, dtype=torch.int32) if prefill_seqs else None
        self._shared = self._plan_shared_decodes(decode_seqs, metadata, block_size)
        alone = decode_seqs
        if self._shared is not None:
            grouped = set(self._shared.members.tolist())
            alone = [i for i in decode_seqs if i not in grouped]
        needs_rows = bool(decode_seqs) and (prefill_seqs or self._shared is not None)
        starts = metadata.query_start_loc.tolist() if needs_rows else []
        self._decode = self._plan_decodes(alone, starts, metadata) if alone else None
        # Windowed layers send every decode to the decode kernel, shared or not.
        self._windowed_decode = None
        if self._has_windows and decode_seqs:
            self._windowed_decode = self._plan_decodes(decode_seqs, starts, metadata)

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block_tables, seq_lens) of a prepared decode-only step whose decodes all take the plain
        decode kernel (row i: sequence i), else None. engine/cpu/decode_stack.py runs such steps."""
        decode = self._decode
        if self._prefill_seq_indices is not None or self._shared is not None or decode is None or decode.rows is not None:
            return None
        return decode.block_tables, decode.seq_lens

    def store_kv(self, key, value, kv_cache: KVCache) -> None:
        head_major.store_kv(key, value, kv_cache, self._slots)

    def rotary_store_kv(self, qkv, cos_sin, kv_cache: KVCache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        return head_major.rotary_store_kv(self._kernels, qkv, cos_sin, kv_cache, self._slots, num_heads, num_kv_heads)

    def forward(self, query, key, value, kv_cache: KVCache, scale: float, window: int = NO_WINDOW) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape; key and value unused (the kernels read the cache)
        k_cache, v_cache = kv_cache
        metadata = self._metadata
        decode, shared = self._decode, self._shared
        if window > 0:  # every decode in the decode kernel, which reads only the window's blocks
            decode, shared = self._windowed_decode, None
        if self._prefill_seq_indices is None and shared is None:  # decode-only: query row i is sequence i
            return self._decode_attention(decode, query, k_cache, v_cache, scale, window)
        out = torch.empty_like(query)
        if decode is not None:
            out[decode.rows] = self._decode_attention(decode, query[decode.rows], k_cache, v_cache, scale, window)
        # Prefill chunks' and shared decodes' rows, written in place; their keys are already in the cache.
        if shared is not None:
            self._kernels.paged_shared_decode_attention(
                out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                shared.members, shared.group_starts, shared.shared_blocks, scale,
            )
        if self._prefill_seq_indices is not None:
            self._kernels.paged_prefill_attention(
                out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                self._prefill_seq_indices, scale, window,
            )
        return out

    @staticmethod
    def _plan_shared_decodes(
        seq_indices: list[int], metadata: AttentionMetadata, block_size: int
    ) -> _SharedDecodePlan | None:
        """Groups of two or more decodes whose block tables start with the same blocks
        (prefix caching hands sequences with a common prompt the same block ids)."""
        if len(seq_indices) < 2:
            return None
        tables = metadata.block_tables
        by_first_block: dict[int, list[int]] = defaultdict(list)
        for seq, first_block in zip(seq_indices, tables[seq_indices, 0].tolist()):
            by_first_block[first_block].append(seq)
        members, group_starts, shared_blocks = [], [0], []
        for group in by_first_block.values():
            if len(group) < 2:
                continue
            # Only blocks before every member's last token: the block a decode writes is its own.
            limit = min(metadata.seq_lens_cpu[i] - 1 for i in group) // block_size
            rows = tables[group, :limit]  # [num_members, limit]
            num_shared = int((rows == rows[0]).all(dim=0).int().cumprod(dim=0).sum())
            if num_shared * block_size < MIN_SHARED_TOKENS:
                continue
            members.extend(group)
            group_starts.append(len(members))
            shared_blocks.append(num_shared)
        if not shared_blocks:
            return None
        return _SharedDecodePlan(
            torch.tensor(members, dtype=torch.int32),
            torch.tensor(group_starts, dtype=torch.int32),
            torch.tensor(shared_blocks, dtype=torch.int32),
        )

    @staticmethod
    def _plan_decodes(seq_indices: list[int], starts: list[int], metadata: AttentionMetadata) -> _KernelDecodePlan:
        device = metadata.block_tables.device
        if len(seq_indices) == metadata.num_seqs:  # decode-only step: every sequence, in order
            return _KernelDecodePlan(None, metadata.block_tables, metadata.seq_lens)
        rows = torch.tensor([starts[i] for i in seq_indices], device=device)
        index = torch.tensor(seq_indices, device=device)
        return _KernelDecodePlan(rows, metadata.block_tables[index], metadata.seq_lens[index])

    def _decode_attention(self, plan: _KernelDecodePlan, query, k_cache, v_cache, scale: float,
                          window: int) -> torch.Tensor:
        # query: [num_decode_seqs, num_heads, head_dim] -> same shape
        return self._kernels.paged_decode_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale,
                                                    window)
