"""CUDA graphs for decode steps: the model forward captured once per batch-size bucket.

A decode step of a small model is mostly kernel-launch overhead: a few hundred
small kernels, each costing the host several microseconds to launch. A CUDA
graph replays the whole captured forward with one launch.

A graph replays fixed kernels on fixed addresses with fixed host-side arguments, so:

- Inputs live in static buffers sized for the largest bucket. A decode batch of
  n sequences is copied into the first n rows and padded up to its bucket (the
  smallest captured size >= n); the padded rows' outputs are ignored:

      row           0    1    2  | 3 (padding)
      input_ids     t0   t1   t2 | 0
      positions     p0   p1   p2 | 0
      slot_mapping  s0   s1   s2 | -1      store_kv skips slots < 0: nothing is written
      seq_lens      L0   L1   L2 | 1       the decode kernel reads one token ...
      block_tables  b0.. b1.. b2.. | 0 ..  ... of block 0, which it never writes

- The decode kernel's host-side arguments are its grid (num_seqs x KV heads x
  num_splits) and num_blocks_per_split, computed from max_seq_len. Each bucket
  is captured with num_splits chosen for max_model_len and with max_seq_len =
  max_model_len; the kernel bounds its loop by each sequence's own seq_len (read
  on the device), so one capture serves every context up to max_model_len.

Only decode-only steps (every query_len 1) on the Triton backend are replayed.
Steps with a prefill chunk, batches past the largest bucket, the torch backend
(it plans each step on the host), the CPU and `enforce_eager` run eagerly.
After capture every bucket's graph is replayed once on a synthetic batch and
compared with the eager forward (`engine.worker.cuda_graph_check`); any error or
mismatch logs a warning and turns graphs off for good. Logits stay eager, on the sampled rows only.

References: vLLM's CUDA graph runner (capture sizes, shared memory pool,
largest first); PyTorch's `torch.cuda.graph` notes on warm-up and static inputs.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch

from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1  # store_kv skips negative slots: padded rows write nothing
PAD_BLOCK_ID = 0  # padded rows read (never write) one token of this block
PAD_SEQ_LEN = 1  # one context token: the decode kernel visits only block-table column 0
# Past this batch size the forward's work dwarfs its launch overhead: run eagerly.
MAX_CAPTURE_SIZE = 512
# Runs before each capture: Triton compiles (and loads) its kernels on first
# call, which must not happen while the stream is being captured.
NUM_WARMUP_RUNS = 2


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    size = 1
    while size < largest:
        sizes.append(size)
        size *= 2
    sizes.append(largest)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None past the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def disabled_reason(device_type: str, backend_name: str, enforce_eager: bool) -> str | None:
    """Why CUDA graphs cannot be used for this engine, or None if they can."""
    if enforce_eager:
        return "enforce_eager is set"
    if device_type != "cuda":
        return f"the device is {device_type}, not cuda"
    if backend_name != "triton":
        return f"the {backend_name} attention backend plans each step on the host"
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class DecodeInputs:
    """A decode-only batch's model inputs: one query token per sequence, so row i is sequence i."""

    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_rows] int64
    slot_mapping: torch.Tensor  # [num_rows] int64
    seq_lens: torch.Tensor  # [num_rows] int32
    block_tables: torch.Tensor  # [num_rows, max_num_blocks] int32
    query_start_loc: torch.Tensor  # [num_rows + 1] int32: 0, 1, ..., num_rows

    @classmethod
    def padding(cls, num_rows: int, max_num_blocks: int, device: torch.device | str) -> DecodeInputs:
        """Buffers whose every row is a padding row (the state warm-up and capture see)."""
        return cls(
            input_ids=torch.zeros(num_rows, dtype=torch.int64, device=device),
            positions=torch.zeros(num_rows, dtype=torch.int64, device=device),
            slot_mapping=torch.full((num_rows,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            seq_lens=torch.full((num_rows,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
            block_tables=torch.full((num_rows, max_num_blocks), PAD_BLOCK_ID, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
        )

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> DecodeInputs:
        return DecodeInputs(*(getattr(self, f.name).to(device) for f in fields(self)))

    def metadata(self, num_rows: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        """Metadata over the first num_rows rows (views, so a graph reads the buffers themselves).

        seq_lens_cpu is what the host is told: the real lengths for an eager run,
        max_model_len for every row when capturing (the Triton backend reads only
        their count and maximum, which then holds for any replay).
        """
        assert len(seq_lens_cpu) == num_rows <= self.num_rows
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_rows],
            query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=self.seq_lens[:num_rows],
            block_tables=self.block_tables[:num_rows],
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=[1] * num_rows,
            seq_lens_cpu=seq_lens_cpu,
        )


def pad_decode_inputs(
    static: DecodeInputs,
    input_ids: torch.Tensor,  # [num_seqs] int64
    positions: torch.Tensor,  # [num_seqs] int64
    slot_mapping: torch.Tensor,  # [num_seqs] int64
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, num_blocks] int32, num_blocks <= static's width
    num_padded: int,
) -> None:
    """Copy a decode batch into the first rows of the static buffers and pad them to num_padded rows.

    Block-table columns past the batch's width keep stale ids: the decode kernel
    reads only the first ceil(seq_len / block_size) of each row. query_start_loc
    is 0, 1, 2, ... for any decode batch, so it is never rewritten.
    """
    num_seqs, num_blocks = block_tables.shape
    assert num_seqs <= num_padded <= static.num_rows, f"{num_seqs} rows padded to {num_padded} of {static.num_rows}"
    max_num_blocks = static.block_tables.shape[1]
    assert num_blocks <= max_num_blocks, f"{num_blocks} blocks per row, room for {max_num_blocks}"
    assert input_ids.shape == positions.shape == slot_mapping.shape == seq_lens.shape == (num_seqs,)
    static.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
    static.positions[:num_seqs].copy_(positions, non_blocking=True)
    static.slot_mapping[:num_seqs].copy_(slot_mapping, non_blocking=True)
    static.seq_lens[:num_seqs].copy_(seq_lens, non_blocking=True)
    static.block_tables[:num_seqs, :num_blocks].copy_(block_tables, non_blocking=True)
    if num_padded > num_seqs:
        pad = slice(num_seqs, num_padded)
        static.input_ids[pad].fill_(0)
        static.positions[pad].fill_(0)
        static.slot_mapping[pad].fill_(PAD_SLOT_ID)
        static.seq_lens[pad].fill_(PAD_SEQ_LEN)
        static.block_tables[pad, 0].fill_(PAD_BLOCK_ID)


def decode_forward(model, kv_caches, static: DecodeInputs, num_rows: int, max_model_len: int) -> torch.Tensor:
    """The forward a graph captures: the first num_rows static rows, with host-side arguments
    that hold for every replay (num_splits chosen for max_model_len, max_seq_len = max_model_len)."""
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.kernels.decode_attention import choose_num_splits

    backend = TritonAttentionBackend(num_splits=choose_num_splits(num_rows, model.config.num_kv_heads, max_model_len))
    backend.prepare(static.metadata(num_rows, [max_model_len] * num_rows))
    input_ids, positions = static.input_ids[:num_rows], static.positions[:num_rows]
    return model(input_ids, positions, kv_caches, backend)  # [num_rows, hidden_size]


class CudaGraphRunner:
    """Captures the decode forward per bucket at start-up and replays it for decode-only steps.

    `capture()` does the work; until it succeeds `is_enabled` is False and
    `can_run` refuses everything, so a ModelRunner can always ask.
    """

    def __init__(
        self,
        model,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend,
        *,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend  # the eager one, for validation
        self.device = device
        self.block_size = block_size
        # Validation puts a token at max_model_len - 1: keep it inside the rotary tables.
        self.max_model_len = min(max_model_len, model.config.max_position_embeddings)
        self.max_num_blocks_per_seq = cdiv(self.max_model_len, block_size)
        self.capture_sizes = capture_sizes(max_num_seqs)
        self.disabled_reason = disabled_reason(device.type, backend.name, enforce_eager)
        self.static: DecodeInputs | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden_size] each, rewritten by every replay
        self.pool = None

    @property
    def is_enabled(self) -> bool:
        return bool(self.graphs)

    def capture(self, check_replays: Callable[[CudaGraphRunner], None]) -> None:
        """Capture every decode batch size, then `check_replays(self)` (engine/worker/cuda_graph_check.py,
        handed in: it builds on this module's inputs) before any graph serves a step."""
        if self.disabled_reason is not None:
            # Only news on CUDA; on the CPU graphs never apply.
            log = logger.info if self.device.type == "cuda" else logger.debug
            log("CUDA graphs off: %s", self.disabled_reason)
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                self._capture_all()
                check_replays(self)
        except Exception as e:  # noqa: BLE001 - any failure here only costs speed
            logger.warning("CUDA graphs off, decode steps run eagerly: %s", e, exc_info=True)
            self._disable(f"capture failed: {e}")
            return
        logger.info(
            "captured CUDA graphs for decode batches of %s sequences (contexts up to %d tokens) in %.1f s",
            self.capture_sizes, self.max_model_len, time.perf_counter() - start,
        )

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and metadata.is_decode_only
            and metadata.num_seqs <= self.capture_sizes[-1]
            and metadata.max_seq_len <= self.max_model_len
            and metadata.block_tables.shape[1] <= self.max_num_blocks_per_seq
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, hidden_size]: a view, valid until the next replay
        num_seqs = metadata.num_seqs
        size = bucket_for(num_seqs, self.capture_sizes)
        pad_decode_inputs(
            self.static, input_ids, positions, metadata.slot_mapping, metadata.seq_lens, metadata.block_tables, size
        )
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]

    def _capture_all(self) -> None:
        self.static = DecodeInputs.padding(self.capture_sizes[-1], self.max_num_blocks_per_seq, self.device)
        # One pool for every graph: they never run at once, so each reuses the
        # largest one's activations, which is why the largest is captured first.
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            self.graphs[size], self.outputs[size] = self._capture(size)
        torch.cuda.synchronize()

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Every static row is padding here, so warm-up writes nothing to the KV cache.
        for _ in range(NUM_WARMUP_RUNS):
            decode_forward(self.model, self.kv_caches, self.static, size, self.max_model_len)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = decode_forward(self.model, self.kv_caches, self.static, size, self.max_model_len)
        return graph, output  # output: [size, hidden_size]

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self.graphs.clear()
        self.outputs.clear()
        self.static = None
        self.pool = None
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - already falling back; nothing more to do
            logger.debug("could not release CUDA graph memory", exc_info=True)
