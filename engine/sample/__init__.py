"""From logits to tokens: logits processing, penalties, the sampler and prompt log-probs."""
