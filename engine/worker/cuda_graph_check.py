"""The CUDA-graph start-up self-check: every captured bucket replayed once against the eager forward.

A graph replays fixed kernels on fixed addresses, so a wrong static buffer or a stale
address would give silently wrong tokens. Right after capture, `check_replays` runs
each bucket's graph on a synthetic decode batch (the smallest batch that lands in
the bucket: the most padding) and compares its hidden states with the eager forward;
`CudaGraphRunner.capture` turns graphs off for good on any error or mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.worker.cuda_graphs import DecodeInputs, cdiv, pad_decode_inputs

if TYPE_CHECKING:
    from engine.worker.cuda_graphs import CudaGraphRunner

# Largest per-row relative L2 error of the replayed hidden states against the
# eager ones. The two differ by split-K and matmul shapes, so 16-bit types get a
# loose bound; a wrong buffer or stale address gives an error near 1 or NaN.
VALIDATION_TOLERANCES = {torch.float32: 1e-2, torch.float16: 0.1, torch.bfloat16: 0.1}


def make_validation_batch(
    num_seqs: int, block_size: int, max_model_len: int, num_kv_blocks: int, vocab_size: int, generator: torch.Generator
) -> tuple[DecodeInputs, list[int]]:
    """A synthetic decode batch (on the CPU) that touches only blocks 0..num_seqs, and its seq_lens.

    Sequence i writes its new token into its own block i (its last block) and
    reads earlier context from one shared block, num_seqs, repeated: no sequence
    reads a slot another one writes, so the eager and replayed runs agree
    whatever order the kernels run in. Sequence 0 spans the whole max_model_len
    (every split of the decode kernel); the others vary around 1-3 blocks.
    Needs num_seqs + 1 blocks, or num_seqs == 1 with the context in one block.
    """
    has_shared_block = num_seqs + 1 <= num_kv_blocks
    assert has_shared_block or num_seqs == 1 <= num_kv_blocks, f"{num_seqs} sequences over {num_kv_blocks} blocks"
    longest = max_model_len if has_shared_block else min(max_model_len, block_size)
    seq_lens = [longest] + [min(longest, 1 + (i % 3) * block_size + (5 * i) % block_size) for i in range(1, num_seqs)]
    num_blocks = [cdiv(n, block_size) for n in seq_lens]
    block_tables = torch.zeros(num_seqs, max(num_blocks), dtype=torch.int32)
    for i, n in enumerate(num_blocks):
        block_tables[i, : n - 1] = num_seqs  # the shared, read-only block
        block_tables[i, n - 1] = i
    last = torch.tensor(seq_lens) - 1  # [num_seqs]: the new token's position
    batch = DecodeInputs(
        input_ids=torch.randint(0, vocab_size, (num_seqs,), generator=generator),
        positions=last,
        slot_mapping=torch.arange(num_seqs) * block_size + last % block_size,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
    )
    return batch, seq_lens


def max_row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-row relative L2 error; NaN if either side has a NaN."""
    actual, expected = actual.float(), expected.float()  # [num_rows, hidden_size]
    errors = (actual - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)
    return float(errors.max())



def check_replays(runner: CudaGraphRunner) -> None:
    """Replay each bucket on a synthetic batch and compare with the eager forward.

    The batch reads and writes KV blocks 0..n, filled with random values
    first and zeroed after: at start-up no request owns a block yet.
    """
    num_kv_blocks = runner.kv_caches[0][0].shape[0]
    most_seqs = max(1, num_kv_blocks - 1)  # make_validation_batch needs a block per sequence, plus one
    # The smallest batch that lands in each bucket: the most padding.
    num_seqs_per_size = {
        size: min(most_seqs, previous + 1)
        for previous, size in zip([0] + runner.capture_sizes, runner.capture_sizes)
    }
    num_blocks_used = min(num_kv_blocks, max(num_seqs_per_size.values()) + 1)
    cache_generator = torch.Generator(device=runner.device).manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:num_blocks_used].normal_(generator=cache_generator)
        v_cache[:num_blocks_used].normal_(generator=cache_generator)
    generator = torch.Generator().manual_seed(0)  # the batches are built on the CPU
    try:
        tolerance = VALIDATION_TOLERANCES.get(runner.kv_caches[0][0].dtype, 0.1)
        for size, num_seqs in num_seqs_per_size.items():
            error = _replay_error(runner, size, num_seqs, generator)
            if not error <= tolerance:  # also catches NaN
                raise RuntimeError(
                    f"replay of the {size}-sequence graph differs from the eager forward "
                    f"(largest row error {error:.3g}, tolerance {tolerance})"
                )
    finally:
        for k_cache, v_cache in runner.kv_caches:
            k_cache[:num_blocks_used].zero_()
            v_cache[:num_blocks_used].zero_()
        torch.cuda.synchronize()


def _replay_error(runner: CudaGraphRunner, size: int, num_seqs: int, generator: torch.Generator) -> float:
    batch, seq_lens = make_validation_batch(
        num_seqs, runner.block_size, runner.max_model_len, runner.kv_caches[0][0].shape[0],
        runner.model.config.vocab_size, generator,
    )
    batch = batch.to(runner.device)
    pad_decode_inputs(
        runner.static, batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.block_tables, size
    )
    runner.graphs[size].replay()
    replayed = runner.outputs[size][:num_seqs].clone()  # [num_seqs, hidden_size]
    runner.backend.prepare(batch.metadata(num_seqs, seq_lens))
    eager = runner.model(batch.input_ids, batch.positions, runner.kv_caches, runner.backend)
    return max_row_error(replayed, eager)

