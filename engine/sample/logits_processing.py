"""The logits pipeline before the draw, in vLLM's order, for the rows that ask for it:

    1. allowed-token mask      allowed_token_ids: every other token -inf
    2. bad words               a word's last token -inf where the output ends with the rest of it
    3. logit_bias, min_tokens  biases added; stop tokens -inf until min_tokens is reached
    4. grammar mask            structured outputs: tokens the grammar rejects -inf (xgrammar's bitmask)
    5. penalties               repetition, frequency, presence (engine.sample.penalties)
    then temperature, top-k / top-p / min-p and the draw (engine.sample.sampler).

Steps 1-3 are masks and additions, so their order changes nothing; the grammar
and penalties leave -inf as it is. Rows that ask for none of it cost nothing: a
step without any such row builds no `LogitsProcessing` at all.

`LogitsProcessingState` is the model runner's per-request cache of what does not
change from step to step (the allowed mask, the bias tensors, the penalty slot),
built on a request's first step and dropped when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from engine.sample.penalties import PenaltyState
from engine.structured_output.bitmask import GrammarBitmask
from engine.core.request import Request
from ipc.sampling_params import clamp_logit_bias


@dataclass
class PenaltyRows:
    rows: torch.Tensor  # [num_penalised] int64: rows of the step's logits
    slots: torch.Tensor  # [num_penalised] int64: their PenaltyState slots
    repetition: torch.Tensor  # [num_penalised] fp32
    frequency: torch.Tensor
    presence: torch.Tensor
    has_repetition: bool


@dataclass
class LogitsProcessing:
    """One step's work for steps 1-5; the sampler applies it."""

    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, [vocab_size] bool: allowed)
    biases: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (row, ids, values)
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list = field(default_factory=list)  # engine.structured_output.RequestGrammar, per grammar row
    penalties: PenaltyRows | None = None


@dataclass
class _RequestTensors:
    allowed_mask: torch.Tensor | None  # [vocab_size] bool
    bias_ids: torch.Tensor | None  # [num_biases] int64
    bias_values: torch.Tensor | None  # [num_biases] fp32


class LogitsProcessingState:
    """Per-request tensors for the logits pipeline, and the penalty slots."""

    def __init__(self, vocab_size: int, device: torch.device, kernels: ModuleType | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.penalty_state = PenaltyState(vocab_size, device, kernels)
        self.grammar_bitmask = GrammarBitmask(kernels)
        self._tensors: dict[str, _RequestTensors] = {}

    def prepare(self, requests: list[Request]) -> LogitsProcessing | None:
        """The step's LogitsProcessing over its sampled rows (request i is row i); None when no row needs any."""
        processing = None
        penalty_rows, slots, repetition, frequency, presence = [], [], [], [], []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if not params.needs_logits_processing:
                continue
            processing = processing or LogitsProcessing()
            tensors = self._tensors_for(request)
            if tensors.allowed_mask is not None:
                processing.allowed.append((row, tensors.allowed_mask))
            if tensors.bias_ids is not None:
                processing.biases.append((row, tensors.bias_ids, tensors.bias_values))
            if has_active_grammar(request):
                processing.grammar_rows.append(row)
                processing.grammars.append(request.grammar)
            if params.has_penalties:
                penalty_rows.append(row)
                slots.append(self.penalty_state.slot_for(request.request_id, request.prompt_token_ids,
                                                         request.output_token_ids))
                repetition.append(params.repetition_penalty)
                frequency.append(params.frequency_penalty)
                presence.append(params.presence_penalty)
        if penalty_rows:
            processing.penalties = PenaltyRows(
                rows=torch.tensor(penalty_rows, dtype=torch.int64, device=self.device),
                slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
                repetition=torch.tensor(repetition, dtype=torch.float32, device=self.device),
                frequency=torch.tensor(frequency, dtype=torch.float32, device=self.device),
                presence=torch.tensor(presence, dtype=torch.float32, device=self.device),
                has_repetition=any(r != 1.0 for r in repetition),
            )
        return processing

    def start_grammar_fill(self, requests: list[Request]) -> None:
        """Before the forward: the grammar rows' bitmasks (request i is row i), filled while it runs."""
        rows = [row for row, request in enumerate(requests) if has_active_grammar(request)]
        if rows:
            self.grammar_bitmask.start_fill(rows, [requests[row].grammar for row in rows], self.vocab_size)

    def record(self, processing: LogitsProcessing | None, token_ids: torch.Tensor) -> None:
        """Count the step's sampled tokens for the penalised rows (token_ids: [num_rows])."""
        if processing is not None and processing.penalties is not None:
            penalties = processing.penalties
            self.penalty_state.record(penalties.slots, token_ids.to(self.device).index_select(0, penalties.rows))

    def release(self, request_id: str) -> None:
        self._tensors.pop(request_id, None)
        self.penalty_state.release(request_id)

    def _tensors_for(self, request: Request) -> _RequestTensors:
        tensors = self._tensors.get(request.request_id)
        if tensors is None:
            params = request.sampling_params
            allowed_mask = bias_ids = bias_values = None
            if params.allowed_token_ids is not None:
                allowed_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                allowed_mask[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)] = True
            if params.logit_bias:
                bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=self.device)
                bias_values = torch.tensor([clamp_logit_bias(b) for _, b in params.logit_bias],
                                           dtype=torch.float32, device=self.device)
            tensors = self._tensors[request.request_id] = _RequestTensors(allowed_mask, bias_ids, bias_values)
        return tensors


def has_active_grammar(request: Request) -> bool:
    return request.grammar is not None and not request.grammar.is_dormant  # dormant: still reasoning


def bad_word_bans(request: Request) -> list[int]:
    """Step 2: the last token of each bad word whose other tokens end the output so far."""
    bans = []
    output = request.output_token_ids if request.sampling_params.bad_words_token_ids else []
    for word in request.sampling_params.bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (len(output) >= prefix_len and output[len(output) - prefix_len:] == word[:-1]):
            bans.append(word[-1])
    return bans


def apply_logits_processing(logits: torch.Tensor, processing: LogitsProcessing, state: LogitsProcessingState) -> None:
    """Steps 1, 3 (the biases; the sampler applies the bans), 4 and 5, in place on fp32 logits."""
    for row, allowed_mask in processing.allowed:
        logits[row].masked_fill_(~allowed_mask, float("-inf"))
    for row, ids, values in processing.biases:
        logits[row].index_add_(0, ids, values)
    if processing.grammars:
        state.grammar_bitmask.apply(logits, processing.grammar_rows, processing.grammars)
    if processing.penalties is not None:
        p = processing.penalties
        state.penalty_state.apply(logits, p.rows, p.slots, p.repetition, p.frequency, p.presence, p.has_repetition)
