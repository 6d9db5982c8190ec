"""Rejection sampling keeps the target distribution: whatever the proposed tokens, each emitted
token is distributed as the target model's own next token (engine.sample.verifier).

Chi-square tests over a 6-token vocabulary, 6,000 verifications, a fixed seed. Each statistic is
compared with the chi-square critical value at 0.1% (5 degrees of freedom: 20.52), so with a fresh
seed a correct sampler would fail one of the three checks with probability about 0.3%."""

from __future__ import annotations

import torch

from engine.sample.sampler import Sampler, SamplingBatch
from engine.sample.verifier import verify

CRITICAL_5_DOF = 20.515  # chi-square, 5 degrees of freedom, upper 0.1%
NUM_DRAWS = 6000
P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])  # the target's distribution at the first position
P1 = torch.tensor([0.40, 0.05, 0.15, 0.10, 0.20, 0.10])  # after the first proposed token
P2 = torch.tensor([0.10, 0.10, 0.10, 0.30, 0.30, 0.10])  # the bonus row


def batch_of(num_rows: int, temperature: float = 1.0) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((num_rows,), temperature), top_ks=torch.full((num_rows,), 6),
        top_ps=torch.ones(num_rows), min_ps=torch.zeros(num_rows), generators=[None] * num_rows,
        banned_token_ids=[[] for _ in range(num_rows)], num_logprobs=[None] * num_rows,
        is_all_greedy=temperature == 0, needs_top_k=False, needs_top_p=False, needs_min_p=False)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_target_distribution_whatever_the_draft():
    sampler = Sampler(torch.Generator().manual_seed(1234))
    logits = torch.stack([P0, P1, P2]).log()  # [3, 6]: rows for two proposed tokens and the bonus
    draft = [3, 0]  # d1 likely under P0 (0.25), d2 likely under P1 (0.40)
    first = torch.zeros(6)
    second_after_d1 = torch.zeros(6)
    third_after_both = torch.zeros(6)
    for _ in range(NUM_DRAWS):
        token = verify(sampler, logits, batch_of(3), [draft])[0]
        emitted = [t.token_id for t in token.accepted] + [token.token_id]
        first[emitted[0]] += 1
        if emitted[0] == draft[0]:
            second_after_d1[emitted[1]] += 1
            if emitted[1] == draft[1]:
                third_after_both[emitted[2]] += 1
    assert chi_square(first, P0) < CRITICAL_5_DOF
    assert chi_square(second_after_d1, P1) < CRITICAL_5_DOF
    assert chi_square(third_after_both, P2) < CRITICAL_5_DOF
    # The acceptance rates themselves: p(d1) and p(d2).
    assert abs(second_after_d1.sum() / NUM_DRAWS - 0.25) < 0.03
    assert abs(third_after_both.sum() / second_after_d1.sum() - 0.40) < 0.05


def test_greedy_keeps_the_proposed_tokens_while_they_are_the_argmax():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.stack([P0, P1, P2]).log()  # argmaxes 1, 0, 3
    cases = {(1, 0): [1, 0, 3], (1, 4): [1, 0], (2, 0): [1]}
    for draft, expected in cases.items():
        token = verify(sampler, logits, batch_of(3, temperature=0), [list(draft)])[0]
        assert [t.token_id for t in token.accepted] + [token.token_id] == expected
