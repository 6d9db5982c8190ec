"""Speculative decoding's draft model: `{"method": "draft", "model": "self-int4" | PATH, ...}`.

A second, smaller or cheaper model (self-int4: the served checkpoint in int4,
engine.spec_decode.draft_model) proposes each request's next tokens greedily; the target
verifies them all in one step. Its KV pool has the target's block count and block size and is
addressed by the target's block tables, so the draft needs no allocator: a request's draft KV
lives in the request's own blocks (engine.spec_decode.draft_kv says how much of it still
stands). Positions past the request's blocks (the step's last token and proposals, which the
scheduler allocates only when it schedules them) go to scratch blocks past the target's count,
handed out afresh each propose.

Each propose, batched over the requests:

    catch-up   every request's tokens the draft has not computed (usually 1 or 2: the tokens
               the last verification emitted), in prefill chunks of at most
               max_num_batched_tokens; each request's last row gives its first proposal
    decode     k - 1 steps of one token a request (the C++ decode stack where it applies),
               each row the previous step's argmax

The draft is greedy (q is one-hot), which the verifier's rejection sampling takes as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.core.block_manager import num_blocks_for
from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.core.request import Request
from engine.spec_decode.draft_kv import DraftKv
from engine.spec_decode.draft_model import load_draft_runner
from engine.worker.step_inputs import ChunkBatch
from ipc.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

ROWS_CATCH_UP = 4  # catch-ups no longer than this run as one-token rows (ModelRunner.forward_step's as_rows)


@dataclass
class _Row:
    """One request's part of a propose."""

    request: Request
    num_tokens: int  # proposals wanted
    block_table: list[int]  # the request's blocks, then its scratch blocks
    num_real_blocks: int  # how many of block_table are the request's
    start: int  # the first position the catch-up computes
    token_ids: list[int] = field(default_factory=list)  # proposed so far


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig, num_kv_blocks: int,
                 max_model_len: int) -> None:
        """Loads the draft beside the target; raises ValueError naming speculative_config.model
        when it cannot draft for the target."""
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_kv_blocks = num_kv_blocks
        # Enough for every running request's proposals past its blocks, and a block more.
        self.num_scratch_blocks = config.max_num_seqs * (num_blocks_for(spec.num_speculative_tokens, self.block_size) + 1)
        self.runner: ModelRunner = load_draft_runner(config, spec, target, num_kv_blocks + self.num_scratch_blocks,
                                                     max_model_len)
        self.kv: dict[str, DraftKv] = {}
        # What proposing costs: time in propose over the tokens it proposed.
        self.num_proposed_tokens = 0
        self.num_forward_steps = 0
        self.propose_seconds = 0.0

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] greedy draft tokens to follow requests[i]'s tokens."""
        start_time = time.perf_counter()
        rows: list[_Row | None] = []
        num_free_scratch = self.num_scratch_blocks
        for request, num in zip(requests, num_tokens):
            num = min(num, self.max_model_len - request.num_tokens)  # proposals past the model's length: never verified
            row = self._make_row(request, num, self.num_scratch_blocks - num_free_scratch) if num > 0 else None
            if row is not None and len(row.block_table) - row.num_real_blocks > num_free_scratch:
                row = None  # out of scratch (a request mid-prompt): it proposes next time
            if row is not None:
                num_free_scratch -= len(row.block_table) - row.num_real_blocks
            rows.append(row)
        active = [row for row in rows if row is not None]
        if active:
            self._catch_up(active)
            for _ in range(1, max(row.num_tokens for row in active)):
                decoding = [row for row in active if len(row.token_ids) < row.num_tokens]
                positions = [row.request.num_tokens + len(row.token_ids) - 1 for row in decoding]
                tokens = self._forward([(row, [row.token_ids[-1]], p, True) for row, p in zip(decoding, positions)])
                for row, token_id in zip(decoding, tokens):
                    row.token_ids.append(token_id)
            for row in active:
                self._remember(row)
            self.num_proposed_tokens += sum(len(row.token_ids) for row in active)
        self.propose_seconds += time.perf_counter() - start_time
        return [row.token_ids if row is not None else [] for row in rows]

    def release(self, request_id: str) -> None:
        self.kv.pop(request_id, None)

    def keep_only(self, request_ids: set[str]) -> None:
        """Drop the state of every request but these (the running ones)."""
        for request_id in [i for i in self.kv if i not in request_ids]:
            del self.kv[request_id]

    def _make_row(self, request: Request, num_tokens: int, first_scratch: int) -> _Row:
        """The request's row: its blocks, scratch blocks for the positions past them that this
        propose writes (up to the KV of its second-last proposal), and where its catch-up starts."""
        kv = self.kv.get(request.request_id)
        start = kv.num_valid_tokens(request, self.block_size) if kv is not None else 0
        num_real_blocks = len(request.block_ids)
        num_needed = num_blocks_for(request.num_tokens + num_tokens - 1, self.block_size)
        first = self.num_kv_blocks + first_scratch
        scratch = list(range(first, first + max(0, num_needed - num_real_blocks)))
        return _Row(request, num_tokens, request.block_ids + scratch, num_real_blocks, start)

    def _catch_up(self, rows: list[_Row]) -> None:
        """Compute each row's tokens from its start to its last, in passes of at most
        max_num_batched_tokens tokens; a row's last token gives its first proposal."""
        next_positions = [row.start for row in rows]
        while True:
            budget = self.max_num_batched_tokens
            chunks = []
            for i, row in enumerate(rows):
                num_tokens = row.request.num_tokens
                num = min(num_tokens - next_positions[i], budget)
                if num <= 0:
                    continue
                start = next_positions[i]
                chunks.append((row, row.request.all_token_ids[start: start + num], start, start + num == num_tokens))
                next_positions[i] += num
                budget -= num
            if not chunks:
                return
            finished = [row for row, _, _, is_last in chunks if is_last]
            for row, token_id in zip(finished, self._forward(chunks)):
                row.token_ids.append(token_id)

    def _forward(self, chunks: list[tuple[_Row, list[int], int, bool]]) -> list[int]:
        """One draft step over (row, token ids, first position, is sampled) chunks; the argmax
        of each sampled chunk's last row, in order."""
        batch = ChunkBatch(self.block_size)
        sample_rows: list[int] = []
        for row, token_ids, start, is_sampled in chunks:
            end = start + len(token_ids)
            batch.add(token_ids, start, row.block_table[: num_blocks_for(end, self.block_size)])
            if is_sampled:
                sample_rows.append(len(batch.input_ids) - 1)
        # Catch-ups of a token or two, the usual case, run on the decode stack as one-token rows.
        as_rows = max(batch.query_lens) <= ROWS_CATCH_UP
        logits = self.runner.forward_step(batch.to_inputs(sample_rows), as_rows=as_rows)  # [num_sampled, vocab]
        self.num_forward_steps += 1
        return logits.argmax(dim=-1).tolist() if sample_rows else []

    def _remember(self, row: _Row) -> None:
        """What the row's propose left in the request's blocks: its tokens, then every proposal
        but the last, up to the end of its own blocks (scratch is handed out again)."""
        request = row.request
        num_kept = row.num_real_blocks * self.block_size
        num_real = min(request.num_tokens, num_kept)
        proposed = row.token_ids[:-1][: max(0, num_kept - request.num_tokens)]
        self.kv[request.request_id] = DraftKv(num_real, proposed, request.block_ids[: row.num_real_blocks],
                                              request.num_preemptions)
