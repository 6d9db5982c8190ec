"""Token sampling for one step's sampled rows: greedy, temperature, top-k, top-p, min-p, seeds, log-probs.

Randomness is one uniform draw per sampled token, taken through the row's
cumulative distribution (inverse-CDF sampling). Each seeded request owns a
generator that draws exactly that one number per sampled token, so the same
seed gives the same tokens alone or inside any batch. (The exponential race,
argmax of p / Exp(1) noise, needs a vocabulary's worth of noise per row: with
48 rows of a 49,152-token vocabulary that was 2.4M serial draws, a quarter of a
served decode step on this project's CPU.)

On the CPU, rows without top-k, top-p or min-p go through one C++ kernel
(engine/cpu/csrc/sample_rows.cpp): the same draw (the first token whose
cumulative mass reaches the row's target) and the same argmax for greedy rows,
one pass per row where torch made several (figures: docs/performance.md, "Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.sample.logits_processing import LogitsProcessing, LogitsProcessingState, apply_logits_processing
from engine.core.scheduler_output import SampledToken
from ipc.messages import TokenLogprobs


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, built by the model runner."""

    temperatures: torch.Tensor  # [num_rows] float; 0 for greedy rows
    top_ks: torch.Tensor  # [num_rows] int; vocab_size when disabled
    top_ps: torch.Tensor  # [num_rows] float
    min_ps: torch.Tensor  # [num_rows] float
    generators: list[torch.Generator | None]  # per row; None: the engine's shared generator
    banned_token_ids: list[list[int]]  # per row: bad words' tokens, EOS/stop ids until min_tokens is reached
    num_logprobs: list[int | None]  # per row
    is_all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    processing: LogitsProcessing | None = None  # allowed tokens, biases, grammar, penalties (None: no row has any)


def sampling_kernels(device: torch.device) -> ModuleType | None:
    """The C++ CPU kernels where they apply (on the CPU, where they build), else None."""
    if device.type != "cpu":
        return None
    from engine.cpu.extension import load_cpu_kernels_or_none

    return load_cpu_kernels_or_none("sampling with torch ops")  # the same draws, slower


class Sampler:
    def __init__(self, generator: torch.Generator, kernels: ModuleType | None = None,
                 logits_state: LogitsProcessingState | None = None) -> None:
        self.generator = generator  # for rows without a seed of their own
        self._kernels = kernels  # engine/cpu/csrc/sample_rows.cpp's module, or None: torch ops only
        self.logits_state = logits_state  # the penalties' counts, kept across steps
        self._zeros: dict[int, torch.Tensor] = {}  # sample_greedy's zeros by row count, made once

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        # logits: [num_rows, vocab_size]
        logits, raw_logprobs = self.process(logits, batch)
        token_ids = self.draw(logits, batch)
        if self.logits_state is not None and batch.processing is not None:  # penalised rows' counts
            self.logits_state.record(batch.processing, token_ids)
        return self._collect(token_ids.tolist(), raw_logprobs, batch)

    def sample_greedy(self, logits: torch.Tensor) -> list[SampledToken]:
        """Each row's argmax, for a step whose rows are all plain greedy (`is_plain_greedy`): no
        SamplingBatch, one kernel call. A one-user decode's step ran six torch calls here, each
        tens of µs on the cache the forward's weights just flushed."""
        # logits: [num_rows, vocab_size]
        logits = logits.float()
        if self._kernels is not None and logits.device.type == "cpu":
            zeros = self._zeros.get(logits.shape[0])
            if zeros is None:  # temperature 0 (greedy) and an unused uniform per row
                zeros = self._zeros[logits.shape[0]] = torch.zeros(logits.shape[0])  # [num_rows]
            token_ids = self._kernels.sample_rows(logits, zeros, zeros)
        else:
            token_ids = logits.argmax(dim=-1)
        return [SampledToken(token_id, None) for token_id in token_ids.tolist()]

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits after bans and the logits pipeline, the raw log-probs when a row asks for them)."""
        logits = logits.float()
        raw_logprobs = None
        if any(n is not None for n in batch.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # of the model's own distribution, as vLLM reports
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
        if batch.processing is not None:
            apply_logits_processing(logits, batch.processing, self.logits_state)
        return logits, raw_logprobs

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of processed logits: argmax for greedy rows, else a draw. [num_rows] int64."""
        filtered = batch.needs_top_k or batch.needs_top_p or batch.needs_min_p
        if self._kernels is not None and logits.device.type == "cpu" and not filtered:
            uniforms = torch.zeros(logits.shape[0]) if batch.is_all_greedy else self._draw_uniforms(batch)
            return self._kernels.sample_rows(logits, batch.temperatures.float(), uniforms)
        if batch.is_all_greedy:
            return logits.argmax(dim=-1)
        return self._sample_random(logits, batch)

    def generator_of(self, batch: SamplingBatch, row: int) -> torch.Generator:
        """The generator a row draws from: its request's seeded one, else the shared one."""
        return batch.generators[row] or self.generator

    def _draw_uniforms(self, batch: SamplingBatch) -> torch.Tensor:
        """One draw in [0, 1) per row, on the CPU, where the generators live, so a seed
        gives the same tokens on any device: the shared generator's rows in one call,
        each seeded row from its own."""
        uniforms = torch.empty(len(batch.generators))  # [num_rows]
        shared_rows = [row for row, g in enumerate(batch.generators) if g is None]
        if shared_rows:
            uniforms[shared_rows] = torch.rand(len(shared_rows), generator=self.generator)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                uniforms[row] = torch.rand(1, generator=generator)
        return uniforms

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = batch.temperatures == 0
        probs = self.probabilities(logits, batch)  # [num_rows, vocab_size]
        # 1 - u in (0, 1], scaled by the row's mass (below 1 after min-p), picks the first
        # token whose cumulative mass reaches it: never a token of probability 0.
        sampled = sample_from(probs, self._draw_uniforms(batch))
        if not bool(greedy.any()):
            return sampled
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row draws from: temperature, top-k / top-p, min-p applied to processed
        logits (greedy rows at temperature 1). Unnormalized after min-p. [num_rows, vocab_size]"""
        greedy = batch.temperatures == 0
        temperatures = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
        if not bool((temperatures == 1).all()):  # a vocabulary-wide pass per row, skipped when it changes nothing
            logits = logits / temperatures.unsqueeze(1)
        if batch.needs_top_k or batch.needs_top_p:
            logits = self._apply_top_k_top_p(logits, batch)
        probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab_size]
        if batch.needs_min_p:
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
        vocab_size = logits.shape[1]
        if batch.needs_top_k:
            ks = batch.top_ks.clamp(1, vocab_size)
            kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))  # [num_rows, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if batch.needs_top_p:
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the first always stays.
            # Rows with top_p 1 drop nothing: float32 cumsum reaches 1.0 before the tail ends.
            mass_before = probs.cumsum(dim=-1) - probs
            top_ps = batch.top_ps.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill((mass_before >= top_ps) & (top_ps < 1.0), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)

    @staticmethod
    def _collect(token_ids: list[int], raw_logprobs, batch: SamplingBatch) -> list[SampledToken]:
        results = []
        for row, token_id in enumerate(token_ids):
            results.append(SampledToken(token_id, token_logprobs(raw_logprobs, row, token_id, batch.num_logprobs[row])))
        return results


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: per row, the first token whose cumulative mass reaches (1 - u) * the row's mass.
    probs: [num_rows, vocab_size] (need not sum to 1), uniforms: [num_rows] in [0, 1) -> [num_rows] int64."""
    cdf = probs.cumsum(dim=-1)  # [num_rows, vocab_size]
    targets = (1.0 - uniforms.to(probs.device)) * cdf[:, -1]  # [num_rows]
    return torch.searchsorted(cdf, targets.unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[1] - 1)


def token_logprobs(raw_logprobs: torch.Tensor | None, row: int, token_id: int, num: int | None) -> TokenLogprobs | None:
    """Row `row`'s log-prob of `token_id` and its top `num` (None: the row did not ask)."""
    if num is None:
        return None
    row_logprobs = raw_logprobs[row]
    top_ids, top_values = [], []
    if num > 0:
        values, ids = row_logprobs.topk(num)
        top_ids, top_values = ids.tolist(), values.tolist()
    return TokenLogprobs(token_id, float(row_logprobs[token_id]), top_ids, top_values)
