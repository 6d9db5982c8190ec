"""The cost of the logits pipeline (penalties, logit_bias) on a decode step of 48 rows.

    python -m scripts.bench.probes.logits_processing --json results/bench_logits_processing.json
    python -m scripts.bench.probes.logits_processing --num-requests 8 --output-len 8 --rounds 1   # a quick check

The real engine (engine.LLM on the default model, default dtype) runs B requests of L
random token ids each, all arriving at once and decoding in lockstep for T tokens
(temperature 1, EOS ignored), once per variant:

    plain           temperature 1, nothing else: the step builds no LogitsProcessing
    penalised       every row: repetition 1.1, frequency 0.5, presence 0.5
    logit_bias      every row: --num-biases entries (random token ids, biases in [-5, 5])
    half_penalised  the first half of the rows penalised as above, the rest plain

Variants alternate within each round (plain, penalised, logit_bias, half_penalised,
then again), so drift in the load of a shared machine hits all of them alike. Only
steps where every one of the B rows decodes count. Per variant it reports the median
step time, and two narrower times per step taken by thin wrappers around the model
runner: `sampler.sample` (the pipeline applied and the draw: isolates the pipeline
from the model's noise) and `_prepare_sampling` (the per-row Python that builds the
sampling batch, LogitsProcessingState.prepare included). Ratios are to plain, both
over the pooled steps and as the median of each round's ratio (paired within a round).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from scripts.lib.bench_report import machine_info, run_and_report, require_at_least_one
from scripts.lib.lockstep_batch import add_lockstep_args, generate_recorded, lockstep_llm, random_prompts


logger = logging.getLogger("bench_logits_processing")

VARIANTS = ("plain", "penalised", "logit_bias", "half_penalised")
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
MAX_ABS_BIAS = 5.0
TARGET_PENALISED_VS_PLAIN = 1.1  # the target: all-penalised steps within 10% of plain


def variant_params(variant: str, num_requests: int, output_len: int, vocab_size: int, num_biases: int,
                   seed: int) -> list:
    """One SamplingParams per request for the variant."""
    from ipc.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = []
    for i in range(num_requests):
        fields = {}
        if variant == "penalised" or (variant == "half_penalised" and i < num_requests // 2):
            fields.update(PENALTIES)
        if variant == "logit_bias":
            ids = rng.sample(range(vocab_size), num_biases)
            fields["logit_bias"] = {t: rng.uniform(-MAX_ABS_BIAS, MAX_ABS_BIAS) for t in ids}
        params.append(SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, **fields))
    return params


class StepTimer:
    """Wraps the engine's model runner: one [sample_s, prepare_s] entry per execute call.

    EngineCore.step records a StepStats exactly when it calls execute, so while
    record_step_stats is on, entry i belongs to step_stats[i] (as in bench_decode).
    """

    def __init__(self, engine) -> None:
        self.entries: list[list[float]] = []
        runner = engine.model_runner
        execute, sample, prepare = runner.execute, runner.sampler.sample, runner._prepare_sampling

        def timed_execute(scheduler_output):
            self.entries.append([0.0, 0.0])
            return execute(scheduler_output)

        def timed_sample(logits, batch):
            start = time.perf_counter()
            tokens = sample(logits, batch)  # ends in .tolist(): synchronised on a GPU too
            self.entries[-1][0] += time.perf_counter() - start
            return tokens

        def timed_prepare(requests):
            start = time.perf_counter()
            batch = prepare(requests)
            self.entries[-1][1] += time.perf_counter() - start
            return batch

        runner.execute = timed_execute
        runner.sampler.sample = timed_sample
        runner._prepare_sampling = timed_prepare


def run_variant(llm, timer: StepTimer, prompts: list[list[int]], params: list, num_rows: int) -> dict:
    """One generate of the variant; its full-batch decode steps' times in seconds."""
    timer.entries.clear()
    steps, _ = generate_recorded(llm, prompts, params)
    assert len(steps) == len(timer.entries), (len(steps), len(timer.entries))
    decode = [(s.end_time - s.start_time, sample_s, prepare_s)
              for s, (sample_s, prepare_s) in zip(steps, timer.entries)
              if s.num_seqs == num_rows and s.num_decode_tokens == num_rows]
    return {"step_s": [d[0] for d in decode], "sample_s": [d[1] for d in decode], "prepare_s": [d[2] for d in decode]}


def summarize(rounds: list[dict[str, dict]]) -> dict:
    """Per variant: pooled medians (ms), and ratios to plain, pooled and paired per round."""
    def median_ms(values: list[float]) -> float | None:
        return statistics.median(values) * 1e3 if values else None

    variants: dict[str, dict] = {}
    for variant in VARIANTS:
        pooled = {key: [v for r in rounds for v in r[variant][key]] for key in ("step_s", "sample_s", "prepare_s")}
        variants[variant] = {
            "num_decode_steps": len(pooled["step_s"]),
            "step_ms_median": median_ms(pooled["step_s"]),
            "sample_ms_median": median_ms(pooled["sample_s"]),
            "prepare_sampling_ms_median": median_ms(pooled["prepare_s"]),
            "step_ms_median_by_round": [median_ms(r[variant]["step_s"]) for r in rounds],
            "sample_ms_median_by_round": [median_ms(r[variant]["sample_s"]) for r in rounds],
        }
    plain = variants["plain"]
    for variant, v in variants.items():
        for key in ("step", "sample", "prepare_sampling"):
            base = plain[f"{key}_ms_median"]
            v[f"{key}_vs_plain"] = v[f"{key}_ms_median"] / base if base and v[f"{key}_ms_median"] else None
        for key in ("step", "sample"):
            paired = [a / b for a, b in zip(v[f"{key}_ms_median_by_round"], plain[f"{key}_ms_median_by_round"])
                      if a and b]
            v[f"{key}_vs_plain_paired_median"] = statistics.median(paired) if paired else None
        v["sample_ms_extra_over_plain"] = (v["sample_ms_median"] - plain["sample_ms_median"]
                                           if v["sample_ms_median"] is not None else None)
    return variants


def run(args: argparse.Namespace) -> dict:
    num_rows, input_len, output_len = args.num_requests, args.input_len, args.output_len
    llm = lockstep_llm(
        args.model, num_rows, input_len, output_len, args.block_size,
        dtype=args.dtype,
        enable_prefix_caching=False,  # every variant runs the same prompts: each prefills alike
        num_threads=args.num_threads,
    )
    engine = llm.engine
    vocab_size = engine.model_config.vocab_size
    prompts = random_prompts(args.seed, vocab_size, num_rows, input_len)
    params = {v: variant_params(v, num_rows, output_len, vocab_size, args.num_biases, args.seed) for v in VARIANTS}
    warmup = {v: variant_params(v, num_rows, min(output_len, args.warmup_output_len), vocab_size, args.num_biases,
                                args.seed) for v in VARIANTS}
    timer = StepTimer(engine)
    for variant in VARIANTS:  # builds the kernels and warms every variant's code path
        run_variant(llm, timer, prompts, warmup[variant], num_rows)

    rounds: list[dict[str, dict]] = []
    start = time.perf_counter()
    for index in range(args.rounds):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]  # A B C D, D C B A, ...: no variant always first
        result = {}
        for variant in order:
            result[variant] = run_variant(llm, timer, prompts, params[variant], num_rows)
        rounds.append(result)
        logger.info("round %d/%d: %s", index + 1, args.rounds, ", ".join(
            f"{v} {statistics.median(result[v]['step_s']) * 1e3:.1f} ms" for v in VARIANTS if result[v]["step_s"]))
    variants = summarize(rounds)
    penalised = variants["penalised"]["step_vs_plain_paired_median"]
    return {
        "model": args.model,
        "model_path": engine.model_path,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "dtype": str(engine.model_runner.dtype).removeprefix("torch."),
        "device": str(engine.model_runner.device),
        "has_cpu_kernels": engine.model_runner.sampler._kernels is not None,
        "machine": machine_info(),
        "penalties": PENALTIES,
        "elapsed_s": time.perf_counter() - start,
        "variants": variants,
        "target_penalised_step_vs_plain": TARGET_PENALISED_VS_PLAIN,
        "meets_target": penalised is not None and penalised <= TARGET_PENALISED_VS_PLAIN,
    }


def print_table(report: dict) -> None:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("variant", "steps", "step ms", "x plain", "x paired", "sample ms", "x plain", "+ms", "prepare ms")
    rows = [header]
    for name, v in report["variants"].items():
        rows.append((name, str(v["num_decode_steps"]), fmt(v["step_ms_median"], ".2f"), fmt(v["step_vs_plain"], ".3f"),
                     fmt(v["step_vs_plain_paired_median"], ".3f"), fmt(v["sample_ms_median"], ".3f"),
                     fmt(v["sample_vs_plain"], ".2f"), fmt(v["sample_ms_extra_over_plain"], "+.3f"),
                     fmt(v["prepare_sampling_ms_median"], ".3f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    print(f"target: penalised step <= {report['target_penalised_step_vs_plain']}x plain: "
          f"{'met' if report['meets_target'] else 'MISSED'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lockstep_args(p)
    p.add_argument("--num-requests", type=int, default=48, help="rows decoding at once")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request per variant and round")
    p.add_argument("--rounds", type=int, default=10,
                   help="each runs every variant once, alternating: short rounds, so load drift is shared")
    p.add_argument("--num-biases", type=int, default=10, help="logit_bias entries per request")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("num_requests", "input_len", "output_len", "rounds", "num_biases"))
    if args.output_len < 2:
        p.error("--output-len must be at least 2: the first token comes from the prefill step")
    return args


def main(argv: list[str] | None = None) -> dict:
    _, report = run_and_report(parse_args, run, argv, logger)
    print_table(report)
    return report


if __name__ == "__main__":
    main()
