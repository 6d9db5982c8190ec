"""What one step's attention needs to know about its flat, unpadded batch.

The batch is a flat list of query tokens grouped by sequence: sequence i owns
query tokens [query_start_loc[i], query_start_loc[i+1]). Its context after this
step is seq_lens[i] tokens; the last query_len of them are the new ones, so query
token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends
causally to context positions 0..that position. A decode is a query_len of 1, a
prefill chunk a longer one: no special case.

KV cache: one tensor for K and one for V per layer, each a pool of blocks whose
layout the backend chooses (`backend.kv_cache_shape`): the Triton kernels use
[num_blocks, block_size, num_kv_heads, head_dim], the torch path keeps blocks
head-major, [num_blocks, num_kv_heads, block_size, head_dim]. Either way, token
t of sequence i lives in block block_tables[i, t // block_size] at offset
t % block_size, i.e. flat slot block_id * block_size + offset.

Sliding windows are per layer, not per step: each attention layer passes its window to
the backend (NO_WINDOW for full attention), and a query at position p then sees keys
p - window < k <= p, as transformers' sliding-window mask does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_WINDOW = 0  # a layer's window when it attends to the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32; row i valid up to ceil(seq_lens[i] / block_size)
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so the torch backend can loop without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
