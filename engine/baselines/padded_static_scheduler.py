"""Static batching as systems ran it before vLLM: padded batches, preallocated KV, and
finished rows computing until the batch ends. The seed's baseline, on our model code.

`StaticScheduler` only blocks the head of the line; this one also pays for padding:

- A batch of up to `max_num_seqs` requests is admitted only when the last one has ended.
- Each request reserves its prompt plus `max_tokens` of KV at admission, and the batch
  a shared scratch area for its padding; a request joins only while the pool holds all
  of that, so memory bounds the batch size (nothing is allocated, nothing preempted later).
- Prefill is padded to the batch's longest prompt. A row's left padding is a pseudo-
  sequence of pad tokens (`PaddingRow`, in the step's `PaddedSchedulerOutput`; run by
  `engine.baselines.padded_static_runner`) computed through every layer, its KV written to
  the scratch area, in the same step as the row's real prompt; the real tokens attend
  only to their own sequence, so the padding is masked out of their attention, as a
  varlen kernel masks a left-padded row. Rows are prefilled whole, as many a step as
  the token budget takes (at least one).
- Then every row decodes in lockstep. A finished row keeps a decode row: a pad token at
  its next position, attending to its whole row (its own blocks, then the scratch), its
  KV written to its reserved-but-unused slots and then the scratch, its logits computed
  and sampled, the token dropped. Its blocks stay held until the batch ends.

    rows:   A  [pad pad  a  a  a ] a' a' .  .        prompt 3, 2 out: then pad decodes
            B  [ b  b  b  b  b  ] b' b' b' b'        the longest: the batch ends with B
            prefill (5 tokens a row)   decode steps (every row, every step)

Real rows compute exactly what the other modes compute, so greedy outputs are equal
(tests/unit/test_padded_static.py). No prefix caching: a padded row is laid out whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.core.block_manager import num_blocks_for
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, is_compiling
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.step_stats import PaddedStepStats

logger = logging.getLogger(__name__)


@dataclass
class PaddingRow:
    """Tokens a padded static batch computes for nothing: a row's left padding, or a finished
    row's pad-token decode. Pad tokens at positions `start`.., their KV written through
    `block_ids`, which no real token ever reads."""

    block_ids: list[int]
    start: int
    num_tokens: int
    is_sampling: bool  # a finished row's decode: its logits are computed and sampled, the token dropped


@dataclass
class PaddedSchedulerOutput(SchedulerOutput):
    """A padded static step: the real rows (`scheduled`), then the pad rows computed beside them
    (engine.baselines.padded_static_runner runs them; continuous steps never carry any)."""

    padding: list[PaddingRow] = field(default_factory=list)

    @property
    def num_padding_tokens(self) -> int:
        """Rows' left padding."""
        return sum(p.num_tokens for p in self.padding if not p.is_sampling)

    @property
    def num_finished_row_tokens(self) -> int:
        """Finished rows' pad-token decodes."""
        return sum(p.num_tokens for p in self.padding if p.is_sampling)

    def step_stats(self, **fields) -> PaddedStepStats:
        """The record with the pad tokens, computed for nothing."""
        return PaddedStepStats(**fields, num_padding_tokens=self.num_padding_tokens,
                               num_finished_row_tokens=self.num_finished_row_tokens)


@dataclass
class PaddedRow:
    request: Request
    block_ids: list[int]  # its reservation, held until the batch ends
    is_prefilled: bool = False
    next_position: int = 0  # once finished: where its next pad-token decode goes

    @property
    def is_finished(self) -> bool:
        return self.request.status.is_finished


@dataclass
class PaddedBatch:
    rows: list[PaddedRow]
    scratch_block_ids: list[int]
    max_prompt_len: int
    rows_by_id: dict[str, PaddedRow] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows_by_id = {row.request.request_id: row for row in self.rows}


def reservation_blocks(request: Request, block_size: int) -> int:
    return num_blocks_for(request.num_prompt_tokens + request.max_tokens, block_size)


def scratch_blocks(requests: list[Request], block_size: int) -> int:
    """Blocks for a batch's padding: the longest left padding, and the longest run of pad
    decodes a finished row makes past its own reservation (up to the batch's longest output)."""
    if len(requests) < 2:
        return 0  # a lone row has no padding and ends its batch when it finishes
    prompt_lens = [r.num_prompt_tokens for r in requests]
    max_tokens = max(r.max_tokens for r in requests)
    # A finished row's last pad decode sits at its prompt + the batch's longest output - 2.
    past_reservation = max(num_blocks_for(r.num_prompt_tokens + max_tokens - 1, block_size)
                           - reservation_blocks(r, block_size) for r in requests)
    return max(num_blocks_for(max(prompt_lens) - min(prompt_lens), block_size), past_reservation)


class PaddedStaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enable_prefix_caching = False
        self.batch: PaddedBatch | None = None

    def batch_fits(self, requests: list[Request]) -> bool:
        """The batch's reservations and scratch fit the free pool, and its padded rows the context."""
        block_size = self.block_manager.block_size
        longest_row = max(r.num_prompt_tokens for r in requests) + max(r.max_tokens for r in requests) - 1
        if len(requests) > 1 and longest_row > self.max_model_len:
            return False
        num_blocks = sum(reservation_blocks(r, block_size) for r in requests) + scratch_blocks(requests, block_size)
        return self.block_manager.can_allocate(num_blocks)

    # ---- schedule ----

    def schedule(self) -> PaddedSchedulerOutput:
        output = PaddedSchedulerOutput()
        if self.batch is None:
            self._admit_batch()
        if self.batch is None:
            return output
        if any(not row.is_prefilled and not row.is_finished for row in self.batch.rows):
            self._schedule_prefill(output)
        else:
            self._schedule_decode(output)
        return output

    def _admit_batch(self) -> None:
        chosen: list[Request] = []
        num_compiling = 0  # requests passed over while their grammar compiles: they keep their place
        while len(self.waiting) > num_compiling and len(chosen) < self.max_num_seqs:
            request = self.waiting[num_compiling]
            if is_compiling(request):
                num_compiling += 1
                continue
            if not self.batch_fits(chosen + [request]):
                break  # in order: the next batch starts with it
            del self.waiting[num_compiling]
            chosen.append(request)
        if not chosen:
            return
        block_size = self.block_manager.block_size
        rows = []
        for request in chosen:
            self._start(request, self.block_manager.allocate(reservation_blocks(request, block_size)), 0)
            self.running.append(request)
            rows.append(PaddedRow(request, request.block_ids))
        scratch = self.block_manager.allocate(scratch_blocks(chosen, block_size))
        self.batch = PaddedBatch(rows, scratch, max(r.num_prompt_tokens for r in chosen))
        logger.debug("padded batch of %d rows, %d scratch blocks", len(rows), len(scratch))

    def _schedule_prefill(self, output: PaddedSchedulerOutput) -> None:
        """Whole padded rows, in order, while the token budget lasts (the first one always)."""
        batch, budget = self.batch, self.max_num_batched_tokens
        for row in batch.rows:
            if row.is_prefilled or row.is_finished:
                continue
            if output.scheduled and budget < batch.max_prompt_len:
                break
            request = row.request
            num_pad_tokens = batch.max_prompt_len - request.num_prompt_tokens
            if num_pad_tokens:
                output.padding.append(PaddingRow(batch.scratch_block_ids, 0, num_pad_tokens, False))
            output.scheduled.append(ScheduledRequest(request, request.num_tokens - request.num_computed_tokens))
            row.is_prefilled = True
            budget -= batch.max_prompt_len

    def _schedule_decode(self, output: PaddedSchedulerOutput) -> None:
        """Every row, every step: a real decode or a finished row's pad-token decode."""
        for row in self.batch.rows:
            if not row.is_finished:
                output.scheduled.append(ScheduledRequest(row.request, 1))
                continue
            output.padding.append(PaddingRow(row.block_ids + self.batch.scratch_block_ids, row.next_position, 1, True))
            row.next_position += 1

    # ---- finish ----

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """A row of the batch keeps its blocks (its pad decodes write there) until the last row ends."""
        batch = self.batch
        row = batch.rows_by_id.get(request.request_id) if batch is not None else None
        if row is None:
            super()._finish(request, status)  # a waiting request, aborted
            return
        row.next_position = request.num_computed_tokens
        request.block_ids = []
        super()._finish(request, status)
        if not self.running:
            self._end_batch()

    def _end_batch(self) -> None:
        for row in self.batch.rows:
            self.block_manager.free(row.block_ids)
        self.block_manager.free(self.batch.scratch_block_ids)
        self.batch = None
