"""Verification of proposed tokens against the target model's logits, one flat set of rows per step.

A request with k proposed tokens d1..dk has k + 1 rows of logits: row 0 at its last real token
(the distribution of d1), row i at di (the distribution of the token after it).

Greedy rows keep d1..da while each equals its row's argmax, then add the argmax of row a: exactly
the tokens decoding one at a time would give, when the logits are the same.

Sampled rows use rejection sampling (Leviathan et al. 2023, vLLM's rejection sampler) with a
deterministic draft (n-gram, prediction: q puts all its mass on di). With p the row's target
distribution after temperature, top-k, top-p and min-p, di is accepted with probability
min(1, p(di) / q(di)) = p(di); on a rejection the token comes from the residual max(p - q, 0),
that is p without di, renormalized; all k accepted, the bonus token comes from row k. Every
emitted token is then distributed as the target's own next token, so output follows p exactly.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import Sampler, SamplingBatch, sample_from, token_logprobs
from engine.core.scheduler_output import SampledToken


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]]) -> list[SampledToken]:
    """logits: [sum(len(d) + 1 for d in drafts), vocab_size], each request's rows together and in
    order; `batch` has one row per logits row (a request's parameters repeated). One SampledToken
    per request: its last token, with the accepted proposed tokens before it in `.accepted`."""
    logits, raw_logprobs = sampler.process(logits, batch)  # [num_rows, vocab_size] fp32
    argmax = logits.argmax(dim=-1).tolist()  # [num_rows]
    probs = None if batch.is_all_greedy else sampler.probabilities(logits, batch)  # [num_rows, vocab_size]
    temperatures = batch.temperatures.tolist()
    results = []
    first_row = 0
    for draft in drafts:
        rows = range(first_row, first_row + len(draft) + 1)
        first_row += len(draft) + 1
        if temperatures[rows[0]] == 0:
            token_ids = _verify_greedy(draft, [argmax[r] for r in rows])
        else:
            token_ids = _verify_sampled(draft, probs[rows.start : rows.stop], sampler.generator_of(batch, rows[0]))
        tokens = [SampledToken(t, token_logprobs(raw_logprobs, rows[i], t, batch.num_logprobs[rows[i]]))
                  for i, t in enumerate(token_ids)]
        last = tokens.pop()
        last.accepted = tokens
        results.append(last)
    return results


def _verify_greedy(draft: list[int], argmax: list[int]) -> list[int]:
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == argmax[num_accepted]:
        num_accepted += 1
    return draft[:num_accepted] + [argmax[num_accepted]]


def _verify_sampled(draft: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """probs: [len(draft) + 1, vocab_size], each row's (unnormalized) target distribution."""
    masses = probs.sum(dim=-1)  # [len(draft) + 1]
    uniforms = torch.rand(len(draft) + 1, generator=generator)  # [len(draft) + 1]: one per position, the bonus's too
    for i, token_id in enumerate(draft):
        if float(uniforms[i]) < float(probs[i, token_id] / masses[i]):
            continue
        residual = probs[i].clone()  # [vocab_size]
        residual[token_id] = 0.0
        resampled = sample_from(residual.unsqueeze(0), torch.rand(1, generator=generator))  # [1]
        return draft[:i] + [int(resampled)]
    bonus = sample_from(probs[-1:], uniforms[-1:])  # [1]
    return draft + [int(bonus)]
