"""Tokenizing abuse: two clients loop 1 MiB prompts, one sends 1,000-prompt lists of 1 KB each,
while a normal client streams. Every abusive request must get its 400 quickly and the stream
must keep flowing (its largest gap between events is the measure).

    python -m scripts.hostile.run ...                  # one of scripts/hostile/run.py's cases
    python -m scripts.hostile.tokenizing --base-url http://127.0.0.1:8000 [--strict] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import requests

from scripts.hostile.client import Target

MAX_STREAM_GAP_S = 0.3  # issue #30's targets, on a quiet 2-core machine
MAX_REFUSAL_S = 0.2
# What the suite asserts (scripts/hostile/run.py, run by the tests on a shared CI machine) is
# looser, because timings there swing: refusals within 1 s still catch tokenizing whole
# bodies again (#30 found 1.5-6.5 s); the 2 s gap bound only catches a frozen stream. The
# targets are reported beside it ("meets_targets") and enforced with --strict.
STALL_STREAM_GAP_S = 2.0
STALL_REFUSAL_S = 1.0


def varied_words(num_chars: int, seed: int) -> str:
    """Words of random letters: no tokenizer cache or repeated merge helps."""
    rng = random.Random(seed)
    words, total = [], 0
    while total < num_chars:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
        total += len(words[-1]) + 1
    return " ".join(words)[:num_chars]


def stream_gaps(base_url: str, num_tokens: int) -> list[float]:
    """One normal streamed completion: the gaps between its SSE events, first event included."""
    body = {"prompt": "Once upon a time", "max_tokens": num_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    gaps, last = [], time.monotonic()
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
    return gaps


def tokenizing_abuse(target: Target, duration_s: float = 10.0, num_stream_tokens: int = 48,
                     strict: bool = False) -> dict:
    big = {"prompt": varied_words(1_000_000, 0), "max_tokens": 1}
    many = {"prompt": [varied_words(1024, seed) for seed in range(1, 1001)], "max_tokens": 1}
    refusals: list[tuple[str, int, float]] = []  # (kind, status, seconds)
    stop = threading.Event()

    def abuse(kind: str, body: dict) -> None:
        data = json.dumps(body).encode()
        while not stop.is_set():
            started = time.monotonic()
            response = requests.post(f"{target.url}/v1/completions", data=data, timeout=60,
                                     headers={"content-type": "application/json"})
            refusals.append((kind, response.status_code, time.monotonic() - started))

    baseline_gaps = stream_gaps(target.url, num_stream_tokens)
    abusers = [threading.Thread(target=abuse, args=("1MiB", big), daemon=True) for _ in range(2)]
    abusers.append(threading.Thread(target=abuse, args=("1000x1KB", many), daemon=True))
    for thread in abusers:
        thread.start()
    gaps: list[float] = []
    deadline = time.monotonic() + duration_s
    time.sleep(0.5)  # the abuse is under way before the first stream starts
    while time.monotonic() < deadline:
        gaps.extend(stream_gaps(target.url, num_stream_tokens)[1:])  # the first event waits for the prompt
    stop.set()
    for thread in abusers:
        thread.join(timeout=60)
    by_kind = {}
    for kind in ("1MiB", "1000x1KB"):
        times = sorted(s for k, _, s in refusals if k == kind)
        by_kind[kind] = {"num": len(times), "max_s": round(max(times, default=0.0), 3),
                         "median_s": round(times[len(times) // 2], 3) if times else None,
                         "statuses": sorted({st for k, st, _ in refusals if k == kind})}
    worst_refusal = max((s for _, _, s in refusals), default=0.0)
    all_4xx = all(400 <= status < 500 for _, status, _ in refusals)
    worst_gap = max(gaps, default=0.0)
    meets_targets = worst_refusal <= MAX_REFUSAL_S and worst_gap <= MAX_STREAM_GAP_S
    no_stall = worst_refusal <= STALL_REFUSAL_S and worst_gap <= STALL_STREAM_GAP_S
    return {
        "passed": bool(refusals) and bool(gaps) and all_4xx and (meets_targets if strict else no_stall),
        "meets_targets": meets_targets,
        "stream_max_gap_s": round(worst_gap, 3), "stream_max_gap_idle_s": round(max(baseline_gaps[1:], default=0), 3),
        "num_stream_events": len(gaps), "refusals": by_kind,
        "targets": {"stream_max_gap_s": MAX_STREAM_GAP_S, "refusal_max_s": MAX_REFUSAL_S},
        "stall_bounds": {"stream_max_gap_s": STALL_STREAM_GAP_S, "refusal_max_s": STALL_REFUSAL_S},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--strict", action="store_true", help="pass only within #30's targets")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = tokenizing_abuse(Target(args.base_url), args.duration, strict=args.strict)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
