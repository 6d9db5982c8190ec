"""Speculative decoding: proposed tokens verified in the same flat step (docs/speculative-decoding.md).

A proposer (n-gram lookup, the request's prediction, a draft model) fills `Request.spec_token_ids`
after each step; the scheduler computes them after the request's last token (`scheduling.py`);
the model runner returns logits for each of those positions and `rejection_sampler.py` keeps the
longest run the target model agrees with, plus one token of its own.
"""
