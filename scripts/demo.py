"""`make demo`: a few chat questions through the offline API, greedy, batched together.

    python -m scripts.demo --model smollm2
"""

from __future__ import annotations

import argparse
import logging
import time

from ipc.engine_config import DEFAULT_MODEL


QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why do leaves change color in autumn?",
    "Write a haiku about the sea.",
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from engine.llm import LLM
    from ipc.sampling_params import SamplingParams

    llm = LLM(model=args.model)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, output in zip(QUESTIONS, outputs):
        print(f"Q: {question}\nA: {output.text.strip()}")
        print(f"   ({len(output.token_ids)} tokens, {output.finish_reason})\n")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{num_tokens} tokens for {len(outputs)} prompts in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
