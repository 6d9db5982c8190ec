"""Does the grammar fill's thread slow the forward beside it? Free and constrained rounds in one process (issue #58).

    python -m scripts.bench.probes.grammar_forward --num-requests 64 --rounds 6 --json results/grammar_forward.json

scripts/bench/structured_runs.py measures the grammar's cost as a served user sees it, with the
frontend and the `openai` client on the same two cores. This probe takes them away: the default
model in the offline engine (`LLM`, no governor, no sockets), issue #58's workload as chat prompts
("Invent person number i as JSON.", greedy, 60 tokens), rounds of all requests at once alternating
free and constrained (one json_schema for all; order F G, G F, ... so drift hits both). Per round
it gives the forward's median time over the steps where every request decodes, and per pair the
constrained forward over the free one. The fill runs on its thread beside each constrained forward
(engine/structured_output/bitmask.py), so a ratio near 1.0 says that thread costs the forward
nothing, and a served round whose forward is slower has met something else. --with-serial adds a
third arm whose fill is waited for before the forward starts (each arm leads in turn): if it varies
as much, the variation is not the fill's thread beside the forward.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from scripts.lib.bench_report import machine_info, run_and_report

logger = logging.getLogger(__name__)

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
    "required": ["name", "age", "email"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="pairs of one free and one constrained round")
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--with-serial", action="store_true",
                        help="a third arm: constrained, the fill waited for before the forward (nothing beside it)")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


class ForwardTimes:
    """Wraps the runner's `execute`: (number of scheduled requests, forward seconds, fill seconds) per step."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[int, float, float]] = []
        self._runner, self._execute = runner, runner.execute
        runner.execute = self._timed

    def _timed(self, scheduler_output):
        out = self._execute(scheduler_output)
        start, end = self._runner.forward_times
        if end is not None:
            fill = self._runner.logits_state.grammar_bitmask.times
            self.steps.append((len(scheduler_output.scheduled), end - start, fill.end - fill.start))
        return out


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams
    from engine.loader.model_files import DEFAULT_MODEL, resolve_model
    from ipc.structured_outputs import StructuredOutputsParams

    llm = LLM(args.model or resolve_model(DEFAULT_MODEL))
    times = ForwardTimes(llm.engine.model_runner)
    conversations = [[{"role": "user", "content": f"Invent person number {i} as JSON."}]
                     for i in range(args.num_requests)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    grammar = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA))
    llm.chat(conversations[:2], grammar, use_tqdm=False)  # the schema's compile, outside the rounds
    bitmask = llm.engine.model_runner.logits_state.grammar_bitmask
    arms = [("free", free), ("grammar", grammar)] + ([("grammar_serial", grammar)] if args.with_serial else [])
    rounds, pairs = [], []
    for pair in range(args.rounds):
        medians = {}
        for arm, params in arms[pair % len(arms):] + arms[:pair % len(arms)]:  # each arm first in turn
            bitmask.is_overlapping = arm != "grammar_serial"
            times.steps.clear()
            start = time.perf_counter()
            llm.chat(conversations, params, use_tqdm=False)
            full = [(forward, fill) for rows, forward, fill in times.steps if rows == args.num_requests]
            medians[arm] = statistics.median(f for f, _ in full) * 1e3
            rounds.append({"pair": pair, "arm": arm, "num_full_steps": len(full), "forward_ms": round(medians[arm], 2),
                           "fill_ms": round(statistics.median(f for _, f in full) * 1e3, 3) if arm != "free" else None,
                           "seconds": round(time.perf_counter() - start, 2)})
            logger.info("pair %d %s: %s", pair, arm, rounds[-1])
        pairs.append({arm: round(medians[arm] / medians["free"], 4) for arm in medians if arm != "free"})
    return {"num_requests": args.num_requests, "max_tokens": args.max_tokens, "rounds": rounds,
            "forward_ratio_by_pair": pairs,
            "forward_ratio_median": {arm: statistics.median(p[arm] for p in pairs) for arm in pairs[0]},
            "machine": machine_info()}


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
