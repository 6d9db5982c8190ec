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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


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
    block_ids: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when plainly causal


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._metadata: AttentionMetadata | None = None
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillSeq] = []
        self._slot_mapping: torch.Tensor | None = None
        self._slot_blocks: torch.Tensor | None = None  # [num_tokens] block of each new token
        self._slot_offsets: torch.Tensor | None = None  # [num_tokens] its offset in the block

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        # key, value: [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, num_kv_heads, block_size, head_dim]
        if slot_mapping is not self._slot_mapping:  # a new step: split the slots once, not per layer
            block_size = k_cache.shape[2]
            self._slot_mapping = slot_mapping
            self._slot_blocks, self._slot_offsets = slot_mapping // block_size, slot_mapping % block_size
        # Two advanced indices around a slice: the token dimension comes first, matching key.
        k_cache[self._slot_blocks, :, self._slot_offsets] = key
        v_cache[self._slot_blocks, :, self._slot_offsets] = value

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Work out, once per step, what every layer's forward reuses."""
        self._metadata = metadata
        device = metadata.block_tables.device
        starts = metadata.query_start_loc.tolist()
        decode_seqs: list[int] = []
        self._prefills = []
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 1:
                decode_seqs.append(i)
                continue
            num_blocks = -(-seq_len // block_size)
            mask = None
            if query_len != seq_len:  # a chunk after a cached prefix: causal, offset by the prefix
                positions = torch.arange(seq_len - query_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
            block_ids = metadata.block_tables[i, :num_blocks].long()
            self._prefills.append(_PrefillSeq(starts[i], starts[i + 1], seq_len, block_ids, mask))
        self._decode = self._plan_decodes(decode_seqs, starts, metadata, block_size) if decode_seqs else None

    def _plan_decodes(
        self, seq_indices: list[int], starts: list[int], metadata: AttentionMetadata, block_size: int
    ) -> _DecodePlan:
        # starts: query_start_loc as a list, already read back by prepare
        device = metadata.block_tables.device
        decode_lens = [metadata.seq_lens_cpu[i] for i in seq_indices]
        num_blocks = [-(-n // block_size) for n in decode_lens]
        owners = torch.repeat_interleave(torch.arange(len(seq_indices), device=device), torch.tensor(num_blocks, device=device))
        offsets = torch.arange(block_size, device=device)
        # Token index of each slot within its sequence, compared with the sequence length.
        block_index = torch.cat([torch.arange(n, device=device) for n in num_blocks])
        seq_lens = torch.tensor(decode_lens, device=device)[owners]
        valid = block_index[:, None] * block_size + offsets[None, :] < seq_lens[:, None]
        block_ids = [metadata.block_tables[i, :n] for i, n in zip(seq_indices, num_blocks)]
        return _DecodePlan(
            rows=torch.tensor([starts[i] for i in seq_indices], device=device),
            block_ids=torch.cat(block_ids).long(),
            owners=owners,
            valid=valid,
        )

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float, key=None, value=None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape
        # key, value: [num_tokens, num_kv_heads, head_dim], the step's own (already in the cache), or None
        if metadata is not self._metadata:
            self.prepare(metadata, k_cache.shape[2])
        if not self._prefills:  # decode-only: query row i is sequence i
            return self._decode_attention(query, k_cache, v_cache, scale)
        out = torch.empty_like(query)
        if self._decode is not None:
            out[self._decode.rows] = self._decode_attention(query[self._decode.rows], k_cache, v_cache, scale)
        for seq in self._prefills:
            rows = slice(seq.query_start, seq.query_end)
            if key is not None and seq.query_end - seq.query_start == seq.seq_len:  # the whole context is new
                k, v = key[rows].transpose(0, 1), value[rows].transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
            else:
                k, v = self._gather(k_cache, seq.block_ids, seq.seq_len), self._gather(v_cache, seq.block_ids, seq.seq_len)
            out[rows] = self._prefill_attention(query[rows], k, v, seq, scale)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        num_kv_heads, head_dim = cache.shape[1], cache.shape[3]
        blocks = cache[block_ids].transpose(0, 1)  # [num_kv_heads, num_blocks, block_size, head_dim]
        return blocks.reshape(num_kv_heads, -1, head_dim)[:, :seq_len]  # [num_kv_heads, seq_len, head_dim]

    @staticmethod
    def _prefill_attention(query, key, value, seq: _PrefillSeq, scale: float) -> torch.Tensor:
        # key, value: [num_kv_heads, seq_len, head_dim]
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

    def _decode_attention(self, query, k_cache, v_cache, scale: float) -> torch.Tensor:
        plan = self._decode
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
