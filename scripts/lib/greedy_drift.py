"""The greedy-drift yardstick shared by the bf16 and int8 fidelity tests and
`python -m scripts.bench.probes.quant_drift`: chat questions, transformers' own token-by-token
greedy answer, and how many leading tokens another answer shares with it."""

from __future__ import annotations

NUM_NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
]


def hf_greedy(model, prompt_token_ids: list[int], num_new_tokens: int) -> list[int]:
    """Token-by-token greedy decoding with transformers' own forward and KV cache (EOS ignored)."""
    import torch

    input_ids = torch.tensor([prompt_token_ids])
    output_ids = []
    past = None
    with torch.inference_mode():
        for _ in range(num_new_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
            output_ids.append(next_id)
            input_ids = torch.tensor([[next_id]])
    return output_ids


def leading_matches(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def mean_leading_matches(answers: list[list[int]], references: list[list[int]]) -> float:
    return sum(leading_matches(a, r) for a, r in zip(answers, references)) / len(references)
