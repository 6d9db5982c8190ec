"""Prompt log-probs (vLLM's `prompt_logprobs`): each prompt token's log-prob under the model, plus the top N.

The logits at position p give token p + 1, so a prompt of P tokens has P - 1 of
them (the first token has none). Their rows join the step's logits rows, chunk by
chunk as the prompt is computed; the entries gather here and go out with the
request's first sampled token. A recomputed position (after a preemption) is not
counted twice: an entry is taken only for the next position still missing.
Requests that ask for them skip the prefix cache (the scheduler's lookup), so
every prompt position is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request
from ipc.messages import TokenLogprobs

MAX_ROWS_PER_PASS = 256  # log_softmax over a vocabulary per row: bound the temporary


@dataclass
class PromptLogprobRows:
    """One request's share of a step: logits rows [first_row, first_row + num_rows) give the
    log-probs of prompt tokens first_position + 1 ... first_position + num_rows."""

    request: Request
    first_row: int
    first_position: int
    num_rows: int


class PromptLogprobsCollector:
    def __init__(self) -> None:
        self._entries: dict[str, list[TokenLogprobs]] = {}
        self._delivered: set[str] = set()

    def positions_to_compute(self, request: Request, start: int, end: int) -> range:
        """The positions in [start, end) whose logits this request still needs for its prompt log-probs."""
        if request.sampling_params.prompt_logprobs is None or request.request_id in self._delivered:
            return range(0)
        first = max(start, len(self._entries.get(request.request_id, ())))
        return range(first, min(end, request.num_prompt_tokens - 1))

    def collect(self, logits: torch.Tensor, plans: list[PromptLogprobRows]) -> None:
        """Take each plan's entries from the step's logits ([num_logits_rows, vocab_size])."""
        for plan in plans:
            entries = self._entries.setdefault(plan.request.request_id, [])
            if len(entries) != plan.first_position:
                continue  # not the next missing position (cannot happen while chunks come in order)
            num_top = plan.request.sampling_params.prompt_logprobs
            token_ids = plan.request.all_token_ids
            for begin in range(0, plan.num_rows, MAX_ROWS_PER_PASS):
                end = min(begin + MAX_ROWS_PER_PASS, plan.num_rows)
                rows = logits[plan.first_row + begin : plan.first_row + end].float()
                logprobs = torch.log_softmax(rows, dim=-1)  # [num_rows, vocab_size]
                targets = torch.tensor(token_ids[plan.first_position + begin + 1 : plan.first_position + end + 1],
                                       device=logprobs.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                top_values, top_ids = (logprobs.topk(num_top, dim=-1) if num_top else (None, None))
                for i, (token_id, value) in enumerate(zip(targets.tolist(), chosen)):
                    entries.append(TokenLogprobs(token_id, value, top_ids[i].tolist() if num_top else [],
                                                 top_values[i].tolist() if num_top else []))

    def take(self, request: Request) -> list[TokenLogprobs] | None:
        """The request's entries, once, with its first sampled token (None if it asked for none)."""
        if request.sampling_params.prompt_logprobs is None or request.request_id in self._delivered:
            return None
        self._delivered.add(request.request_id)
        return self._entries.pop(request.request_id, [])

    def release(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
        self._delivered.discard(request_id)
