"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

This backend keeps each block head-major, [num_blocks, num_kv_heads, block_size,
head_dim], so a gathered block is already laid out for the batched matmuls
(keys are used transposed through BLAS, with no copy).

Sequences with one query token (decodes) are done together, block by block,
as PagedAttention does: each block's scores come from one batched matmul
against its owner's query, and the softmax is combined across a sequence's
blocks with a segment max and sum. Work is proportional to the blocks actually
held, never to the longest sequence in the batch. Sequences with several query
tokens (prefill chunks) run causal SDPA, one call each: a prompt computed whole
in this step attends to the step's own keys and values, as they came out of the
projection; only a chunk that follows earlier context (chunked prefill, a cached
prefix) gathers its blocks from the cache.

A sliding-window layer passes its `window` (NO_WINDOW, 0: none): a query at position p
then sees keys p - window < k <= p, a decode reads only the blocks that hold its last
`window` positions, and a prefill chunk only those from its first query's window on.
Plans are made once per step for each window the model's layers use.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.attention import head_major
from engine.attention.backend import KVCache
from engine.attention.metadata import NO_WINDOW, AttentionMetadata


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # [num_decode_seqs] query row of each decode sequence
    block_ids: torch.Tensor  # [num_decode_blocks] every block of every decode sequence, in order
    owners: torch.Tensor  # [num_decode_blocks] index (into rows) of the sequence owning each block
    valid: torch.Tensor  # [num_decode_blocks, block_size] bool: slot holds a token of the context


@dataclass
class _PrefillSeq:
    query_start: int
    query_end: int
    seq_len: int
    first_key: int  # the first position any query of the chunk sees (0 but for a window); a block's start
    block_ids: torch.Tensor  # [num_blocks] the blocks from first_key's on
    mask: torch.Tensor | None  # [query_len, seq_len - first_key] bool, None when plainly causal


@dataclass
class _StepPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillSeq]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, block_size: int, windows: tuple[int, ...] = (NO_WINDOW,),
                 kernels: ModuleType | None = None) -> None:
        """`windows`: those the model's layers use, each planned per step; `kernels`: the C++
        module, for the fused rotary + KV store (None: `store_kv` alone)."""
        self._block_size = block_size
        self._windows = windows
        self._kernels = kernels
        self.can_rotate_and_store = kernels is not None
        self._plans: dict[int, _StepPlan] = {}  # by window
        self._slots: head_major.Slots | None = None

    kv_cache_shape = staticmethod(head_major.kv_cache_shape)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Split the step's slots and make one plan per window; every layer reuses them."""
        self._slots = head_major.split_slots(metadata.slot_mapping, self._block_size)
        self._plans = {window: self._plan_step(metadata, self._block_size, window) for window in self._windows}

    def store_kv(self, key, value, kv_cache: KVCache) -> None:
        head_major.store_kv(key, value, kv_cache, self._slots)

    def rotary_store_kv(self, qkv, cos_sin, kv_cache: KVCache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        return head_major.rotary_store_kv(self._kernels, qkv, cos_sin, kv_cache, self._slots, num_heads, num_kv_heads)

    def _plan_step(self, metadata: AttentionMetadata, block_size: int, window: int) -> _StepPlan:
        device = metadata.block_tables.device
        starts = metadata.query_start_loc.tolist()
        decode_seqs: list[int] = []
        prefills = []
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 1:
                decode_seqs.append(i)
                continue
            first_query = seq_len - query_len
            first_block = max(0, first_query - window + 1) // block_size if window > 0 else 0
            first_key = first_block * block_size
            mask = None
            if query_len != seq_len or window > 0:  # not plainly causal from key 0: by position
                positions = torch.arange(first_query, seq_len, device=device)[:, None]  # [query_len, 1]
                keys = torch.arange(first_key, seq_len, device=device)[None, :]  # [1, seq_len - first_key]
                mask = keys <= positions
                if window > 0:
                    mask &= keys > positions - window
            block_ids = metadata.block_tables[i, first_block : -(-seq_len // block_size)].long()
            prefills.append(_PrefillSeq(starts[i], starts[i + 1], seq_len, first_key, block_ids, mask))
        decode = self._plan_decodes(decode_seqs, starts, metadata, block_size, window) if decode_seqs else None
        return _StepPlan(decode, prefills)

    def _plan_decodes(
        self, seq_indices: list[int], starts: list[int], metadata: AttentionMetadata, block_size: int, window: int
    ) -> _DecodePlan:
        # starts: query_start_loc as a list, already read back by _plan_step
        device = metadata.block_tables.device
        decode_lens = [metadata.seq_lens_cpu[i] for i in seq_indices]
        # With a window, only the blocks holding a decode's last `window` positions.
        first_blocks = [max(0, n - window) // block_size if window > 0 else 0 for n in decode_lens]
        num_blocks = [-(-n // block_size) - first for n, first in zip(decode_lens, first_blocks)]
        owners = torch.repeat_interleave(torch.arange(len(seq_indices), device=device), torch.tensor(num_blocks, device=device))
        offsets = torch.arange(block_size, device=device)
        # Position of each slot within its sequence, compared with the sequence length (and the window's start).
        block_index = torch.cat([torch.arange(first, first + n, device=device) for first, n in zip(first_blocks, num_blocks)])
        seq_lens = torch.tensor(decode_lens, device=device)[owners]
        positions = block_index[:, None] * block_size + offsets[None, :]  # [num_decode_blocks, block_size]
        valid = positions < seq_lens[:, None]
        if window > 0:
            valid &= positions >= seq_lens[:, None] - window
        block_ids = [metadata.block_tables[i, first : first + n] for i, first, n in zip(seq_indices, first_blocks, num_blocks)]
        return _DecodePlan(
            rows=torch.tensor([starts[i] for i in seq_indices], device=device),
            block_ids=torch.cat(block_ids).long(),
            owners=owners,
            valid=valid,
        )

    def forward(self, query, key, value, kv_cache: KVCache, scale: float, window: int = NO_WINDOW) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape
        # key, value: [num_tokens, num_kv_heads, head_dim], the step's own (already in the cache), or None
        k_cache, v_cache = kv_cache
        plan = self._plans[window]
        if not plan.prefills:  # decode-only: query row i is sequence i
            return self._decode_attention(plan.decode, query, k_cache, v_cache, scale)
        out = torch.empty_like(query)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode_attention(plan.decode, query[plan.decode.rows], k_cache, v_cache, scale)
        for seq in plan.prefills:
            rows = slice(seq.query_start, seq.query_end)
            if key is not None and seq.query_end - seq.query_start == seq.seq_len:  # the whole context is new
                k = key[rows][seq.first_key :].transpose(0, 1)  # [num_kv_heads, seq_len - first_key, head_dim]
                v = value[rows][seq.first_key :].transpose(0, 1)
            else:
                num_keys = seq.seq_len - seq.first_key
                k = head_major.gather(k_cache, seq.block_ids, num_keys)  # [num_kv_heads, num_keys, head_dim]
                v = head_major.gather(v_cache, seq.block_ids, num_keys)
            out[rows] = self._prefill_attention(query[rows], k, v, seq, scale)
        return out

    @staticmethod
    def _prefill_attention(query, key, value, seq: _PrefillSeq, scale: float) -> torch.Tensor:
        # key, value: [num_kv_heads, seq_len - first_key, head_dim]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # [1, num_heads, query_len, head_dim]
            key.unsqueeze(0),  # [1, num_kv_heads, seq_len, head_dim]
            value.unsqueeze(0),
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [query_len, num_heads, head_dim]

    @staticmethod
    def _decode_attention(plan: _DecodePlan, query, k_cache, v_cache, scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        k = k_cache.index_select(0, plan.block_ids)  # [num_blocks, num_kv_heads, block_size, head_dim]
        v = v_cache.index_select(0, plan.block_ids)
        q = query.view(num_seqs, num_kv_heads, group, head_dim)[plan.owners]  # [num_blocks, num_kv_heads, group, head_dim]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [num_blocks, num_kv_heads, group, block_size]
        scores.masked_fill_(~plan.valid[:, None, None, :], float("-inf"))
        # Softmax across each sequence's blocks: a segment max, then a segment sum.
        block_max = scores.amax(-1)  # [num_blocks, num_kv_heads, group]
        seq_max = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=query.device)
        seq_max.scatter_reduce_(0, plan.owners.view(-1, 1, 1).expand_as(block_max), block_max, "amax")
        probs = torch.exp(scores - seq_max[plan.owners].unsqueeze(-1))
        seq_sum = torch.zeros_like(seq_max).index_add_(0, plan.owners, probs.sum(-1))
        partial = torch.matmul(probs.to(v.dtype), v)  # [num_blocks, num_kv_heads, group, head_dim]
        out = torch.zeros(num_seqs, num_kv_heads, group, head_dim, device=query.device, dtype=partial.dtype)
        out.index_add_(0, plan.owners, partial)
        out = out / seq_sum.unsqueeze(-1).to(out.dtype)
        return out.view(num_seqs, num_heads, head_dim).to(query.dtype)
