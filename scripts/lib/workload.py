"""Deterministic benchmark workloads: the same seed gives the same requests, every run.

Two output-length shapes:
  uniform    every length drawn uniformly from [lo, hi]
  long_tail  "nine short and one very long": 90% of the outputs at `lo`, 10% at `hi`,
             in a seeded shuffled order. This is where static batching hurts most: a
             batch runs as long as its longest member while the short ones sit idle.
Input lengths are always uniform.

Prompts are random token ids from [FIRST_SAFE_TOKEN_ID, vocab_size), which skips the
special tokens at the start of Llama-family vocabularies, or (`real_prompts`) English
text from a small built-in list of sentences, tokenized and cut to length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DISTRIBUTIONS = ("uniform", "long_tail")
WORKLOADS = ("random", "shared_prefix", "multi_turn")
FIRST_SAFE_TOKEN_ID = 100  # ids below this are special or control tokens in most vocabularies
LONG_TAIL_FRACTION = 0.1  # share of long outputs in "long_tail"

SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France and one of the most visited cities in the world.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
    "A binary search halves the remaining interval at every comparison.",
    "The Pacific Ocean is the largest and deepest of the world's oceans.",
    "Bread rises because yeast ferments sugar and releases carbon dioxide.",
    "Write a short poem about the first snow of winter in the mountains.",
    "Explain why the sky looks blue during the day and red at sunset.",
    "The library opens at nine in the morning and closes at eight in the evening.",
    "Transformers process every token of a sequence in parallel during training.",
    "Summarize the plot of a detective story set in a small coastal town.",
    "Honey never spoils if it is kept sealed and away from moisture.",
    "The train to the airport leaves every fifteen minutes from platform four.",
    "List three reasons why regular exercise improves sleep quality.",
    "Mount Everest grows a few millimetres taller every year.",
    "A good cache keeps the data that will be needed again soon close at hand.",
)


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str | None = None  # the text, for real prompts (decoded from the cut token ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(
    num_requests: int,
    input_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (16, 256),
    distribution: str = "uniform",
    seed: int = 0,
    vocab_size: int = 49152,
    real_prompts: bool = False,
    tokenizer=None,
) -> list[WorkloadRequest]:
    """`num_requests` requests; lengths are inclusive ranges. `tokenizer` is needed for
    `real_prompts` (anything with `encode(text, add_special_tokens=...)` and `decode(ids)`)."""
    _check_range("input_len", input_len)
    _check_range("output_len", output_len)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if real_prompts and tokenizer is None:
        raise ValueError("real_prompts needs a tokenizer")
    if not real_prompts and vocab_size <= FIRST_SAFE_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_SAFE_TOKEN_ID}")
    rng = random.Random(seed)
    input_lens = [rng.randint(*input_len) for _ in range(num_requests)]
    output_lens = _output_lens(rng, num_requests, output_len, distribution)
    text_ids = _text_token_ids(tokenizer, max(input_lens, default=0)) if real_prompts else None
    requests = []
    for num_input, num_output in zip(input_lens, output_lens):
        if real_prompts:
            start = rng.randrange(len(text_ids) - num_input + 1)
            token_ids = text_ids[start : start + num_input]
            requests.append(WorkloadRequest(token_ids, num_output, tokenizer.decode(token_ids)))
        else:
            token_ids = [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(num_input)]
            requests.append(WorkloadRequest(token_ids, num_output))
    return requests


def length_mix(text: str, num_requests: int) -> list[tuple[int, int]]:
    """"64:16,256:128,512:512" -> num_requests (prompt, output) pairs, cycling through them
    (that one is the seed's example: short chats, medium answers, long generations)."""
    pairs = [tuple(int(n) for n in part.split(":")) for part in text.split(",") if part.strip()]
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"a length mix is PROMPT:OUTPUT,... with both at least 1, got {text!r}")
    return [pairs[i % len(pairs)] for i in range(num_requests)]


def make_length_mix_workload(text: str, num_requests: int, seed: int = 0,
                             vocab_size: int = 49152) -> list[WorkloadRequest]:
    """Random prompts of the mix's lengths, in its cycling order."""
    rng = random.Random(seed)
    return [WorkloadRequest([rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(p)], o)
            for p, o in length_mix(text, num_requests)]


def _check_range(name: str, value: tuple[int, int]) -> None:
    lo, hi = value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= lo <= hi, got {value}")


def _output_lens(rng: random.Random, num_requests: int, output_len: tuple[int, int], distribution: str) -> list[int]:
    lo, hi = output_len
    if distribution == "uniform":
        return [rng.randint(lo, hi) for _ in range(num_requests)]
    num_long = max(1, round(num_requests * LONG_TAIL_FRACTION)) if num_requests else 0
    lens = [hi] * num_long + [lo] * (num_requests - num_long)
    rng.shuffle(lens)
    return lens


def _text_token_ids(tokenizer, min_len: int) -> list[int]:
    """The sentences, over and over, as one token stream at least 2 * min_len long,
    so each prompt can start at a seeded offset."""
    sentence_ids = tokenizer.encode(" ".join(SENTENCES) + " ", add_special_tokens=False)
    num_copies = 2 * min_len // len(sentence_ids) + 1
    return sentence_ids * num_copies


# ---- prefix-sharing workloads (prefix caching) ----


def make_shared_prefix_workload(
    num_requests: int = 64,
    num_groups: int = 4,
    prefix_len: int = 1024,
    question_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
    vocab_size: int = 49152,
) -> list[WorkloadRequest]:
    """`num_groups` system prompts of `prefix_len` tokens; each request is one of them
    (round-robin) followed by its own `question_len`-token question. Random token ids;
    the order is shuffled by `seed`, as requests from different users would interleave."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(n)]

    prefixes = [tokens(prefix_len) for _ in range(num_groups)]
    requests = [WorkloadRequest(prefixes[i % num_groups] + tokens(question_len), output_len) for i in range(num_requests)]
    rng.shuffle(requests)
    return requests


@dataclass(frozen=True)
class Conversation:
    """A chat of several turns: turn t's prompt is the whole history (every earlier user
    turn and the model's own replies) plus `user_turns[t]`, built as the replies come in."""

    user_turns: list[list[int]]
    max_tokens: int


def make_multi_turn_workload(
    num_conversations: int = 16,
    num_turns: int = 6,
    turn_len: int = 64,
    output_len: int = 32,
    seed: int = 0,
    vocab_size: int = 49152,
) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation([[rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size) for _ in range(turn_len)] for _ in range(num_turns)],
                     output_len)
        for _ in range(num_conversations)
    ]  # fmt: skip


def add_random_workload_args(p) -> None:
    """The random workload's flags, the same in every benchmark; the defaults are bench_offline's
    reference workload (64 requests, 16-256 tokens in and out, seed 0)."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="uniform")
    p.add_argument("--seed", type=int, default=0)


def add_prefix_workload_args(p, workloads: tuple[str, ...] = WORKLOADS) -> None:
    """The flags of the workloads that share prefixes (those of `workloads`), the same in every benchmark."""
    p.add_argument("--workload", choices=workloads, default="random",
                   help="random: --num-requests with --input-len/--output-len; the others share prefixes")
    p.add_argument("--num-groups", type=int, default=4, help="shared_prefix: system prompts")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared_prefix: tokens per system prompt")
    p.add_argument("--question-len", type=int, default=32, help="shared_prefix: tokens per question")
    if "multi_turn" in workloads:
        p.add_argument("--num-conversations", type=int, default=16, help="multi_turn")
        p.add_argument("--num-turns", type=int, default=6, help="multi_turn")
        p.add_argument("--turn-len", type=int, default=64, help="multi_turn: tokens per user turn")
    p.add_argument("--shared-output-len", type=int, default=32,
                   help=", ".join(w for w in workloads if w != "random") + ": tokens out")
