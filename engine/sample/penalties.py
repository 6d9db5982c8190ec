"""Repetition, frequency and presence penalties over persistent per-request token counts.

Each penalised request owns a slot, a row of two tensors that live across steps:
its output tokens' counts ([num_slots, vocab_size] float32) and which tokens its
prompt holds ([num_slots, vocab_size] bool). A step adds the sampled tokens with
one scatter; applying the penalties is a few vectorised passes over the penalised
rows, with no vocabulary-wide Python work. Tokens never change, so a slot stays
right across preemption and recompute; it is freed when the request ends.

vLLM's semantics: a token seen in the prompt or the output has a positive logit
divided by `repetition_penalty` and a negative one multiplied by it; then
`frequency_penalty * count + presence_penalty * (count > 0)` is subtracted, over
output tokens only.
"""

from __future__ import annotations

from types import ModuleType

import torch

INITIAL_NUM_SLOTS = 8


class PenaltyState:
    """The slots of the requests that asked for penalties."""

    def __init__(self, vocab_size: int, device: torch.device, kernels: ModuleType | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # engine/cpu/csrc/apply_penalties.cpp: one pass per row, in place. The torch ops
        # give the same bits but allocate a vocabulary-sized temporary per op.
        self._kernels = kernels if device.type == "cpu" else None
        self.output_counts = torch.zeros(0, vocab_size, device=device)  # [num_slots, vocab_size]
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [num_slots, vocab_size]
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []

    def slot_for(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """The request's slot, made (and filled from its tokens so far) on first use."""
        slot = self.slots.get(request_id)
        if slot is not None:
            return slot
        if not self.free_slots:
            self._grow()
        slot = self.slots[request_id] = self.free_slots.pop()
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)] = True
        self.output_counts[slot] = 0
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64, device=self.device)
            self.output_counts[slot].index_add_(0, ids, torch.ones(len(ids), device=self.device))
        return slot

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot (slots are distinct within a step)."""
        self.output_counts.index_put_((slots, token_ids), torch.ones(len(slots), device=self.device), accumulate=True)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor, has_repetition: bool) -> None:
        """Penalise `logits[rows]` in place; rows[i] uses slots[i] and the i-th penalties."""
        # logits: [num_rows, vocab_size]; rows, slots, repetition, frequency, presence: [num_penalised]
        if self._kernels is not None and logits.is_contiguous():
            self._kernels.apply_penalties(logits, rows, slots, self.output_counts, self.prompt_mask,
                                          repetition, frequency, presence)
            return
        is_every_row = len(rows) == logits.shape[0]
        values = logits if is_every_row else logits.index_select(0, rows)  # [num_penalised, vocab_size]
        counts = self.output_counts.index_select(0, slots)  # [num_penalised, vocab_size]
        is_in_output = counts > 0
        if has_repetition:
            is_seen = self.prompt_mask.index_select(0, slots).logical_or_(is_in_output)
            penalty = repetition.unsqueeze(1)
            values = torch.where(is_seen, torch.where(values > 0, values / penalty, values * penalty), values)
        values = values - counts * frequency.unsqueeze(1) - is_in_output * presence.unsqueeze(1)
        if is_every_row:
            logits.copy_(values)
        else:
            logits.index_copy_(0, rows, values)

    def _grow(self) -> None:
        num_slots = self.output_counts.shape[0]
        new_num_slots = max(INITIAL_NUM_SLOTS, 2 * num_slots)
        counts = torch.zeros(new_num_slots, self.vocab_size, device=self.device)
        counts[:num_slots] = self.output_counts
        mask = torch.zeros(new_num_slots, self.vocab_size, dtype=torch.bool, device=self.device)
        mask[:num_slots] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self.free_slots.extend(range(new_num_slots - 1, num_slots - 1, -1))
