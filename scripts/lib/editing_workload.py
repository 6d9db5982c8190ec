"""Chat workloads for speculative decoding's benchmark: editing tasks that copy their prompt, and free chat.

An editing request holds a 300-600 token text taken from this repository (Python source
or a page of docs/) and asks for an answer that copies most of it:

    fix_typos       "Fix the typos in this code" (letters swapped in a few words of it)
    rename          "Repeat this code with the name X changed to Y"
    summarize       "Summarize this text, quoting its key sentences word for word"

Its `prediction` is the original text (what OpenAI's Predicted Outputs are for: the file being
edited). A free chat request asks an open question whose answer copies nothing. Everything is
deterministic given the seed, so each configuration of a run gets the same requests.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_FILES = ("frontend/serving_utils.py", "frontend/metrics.py", "frontend/request_state.py",
              "frontend/prompt_tokenizer.py", "frontend/engine_connection.py", "ipc/sampling_params.py",
              "engine/core/block_manager.py", "scripts/lib/sse_client.py")
PROSE_FILES = ("README.md", "docs/prefix-caching.md", "docs/reliability.md", "docs/request_fields.md")
TASKS = ("fix_typos", "rename", "summarize")
FREE_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright while moving, for a curious ten-year-old.",
    "What are the pros and cons of living in a big city compared to a small village?",
    "Describe a perfect autumn day in the mountains.",
    "Give me ideas for a birthday party for someone who loves astronomy.",
    "Why do people enjoy music? Give a few different explanations.",
    "Write a letter from a cat to its owner complaining about the new dog.",
    "How would you plan a week-long trip along a coastline by train?",
)


@dataclass
class ChatRequest:
    kind: str  # a task of TASKS, or "free"
    messages: list[dict]
    prediction: str | None  # the text the answer is expected to copy; None for free chat
    source: str = ""  # where the text came from


def make_editing_requests(num_requests: int, tokenizer, seed: int = 0,
                          token_range: tuple[int, int] = (300, 600)) -> list[ChatRequest]:
    """`num_requests` editing requests cycling through TASKS, each over a fresh window of text
    of `token_range` tokens (by `tokenizer`, cut at line ends)."""
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        task = TASKS[index % len(TASKS)]
        files = PROSE_FILES if task == "summarize" else CODE_FILES
        path = files[rng.randrange(len(files))]
        text = text_window((REPO_ROOT / path).read_text(), tokenizer, rng, token_range)
        requests.append(_task_request(task, text, rng, path))
    return requests


def make_free_requests(num_requests: int, seed: int = 0) -> list[ChatRequest]:
    rng = random.Random(seed)
    order = rng.sample(FREE_QUESTIONS, len(FREE_QUESTIONS))
    return [ChatRequest("free", [{"role": "user", "content": order[i % len(order)]}], None)
            for i in range(num_requests)]


def text_window(text: str, tokenizer, rng: random.Random, token_range: tuple[int, int]) -> str:
    """Whole lines of `text` from a random line on, as many as keep the window within `token_range` tokens
    (a shorter text whole)."""
    lines = text.splitlines(keepends=True)
    lo, hi = token_range
    start = rng.randrange(max(1, len(lines) // 2))
    window, num_tokens = [], 0
    for line in lines[start:] + lines[:start]:
        num_line_tokens = len(tokenizer.encode(line, add_special_tokens=False))
        if num_tokens + num_line_tokens > hi and num_tokens >= lo:
            break
        window.append(line)
        num_tokens += num_line_tokens
        if num_tokens >= hi:
            break
    return "".join(window).strip("\n") + "\n"


def _task_request(task: str, text: str, rng: random.Random, source: str) -> ChatRequest:
    if task == "fix_typos":
        prompt = ("Fix the typos in this code. Answer with the whole corrected code and nothing else.\n\n"
                  f"```\n{add_typos(text, rng)}```")
    elif task == "rename":
        old = most_common_name(text)
        new = old.upper() if old.islower() else old.lower() + "_renamed"
        prompt = (f"Repeat this code exactly, with the name `{old}` changed to `{new}` everywhere. "
                  f"Answer with the code only.\n\n```\n{text}```")
    else:
        prompt = ("Summarize this text in a few paragraphs, quoting its key sentences word for word.\n\n"
                  f"---\n{text}---")
    return ChatRequest(task, [{"role": "user", "content": prompt}], text, source)


def add_typos(text: str, rng: random.Random, share: float = 0.04) -> str:
    """Swap two inner letters in about `share` of the words of four letters or more."""
    def swap(match: re.Match) -> str:
        word = match.group(0)
        if rng.random() >= share:
            return word
        i = rng.randrange(1, len(word) - 2)
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]

    return re.sub(r"[A-Za-z]{4,}", swap, text)


def most_common_name(text: str) -> str:
    """The identifier of five letters or more seen most often in `text` (ties: the first seen)."""
    counts: dict[str, int] = {}
    for name in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{4,}\b", text):
        counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get) if counts else "value"
