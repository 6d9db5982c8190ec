"""Offline throughput: one workload through continuous batching, static batching and
transformers' own padded static batching, on the same model and machine.

    python -m scripts.bench.offline --modes continuous,static,hf --json results/bench_offline.json \
        --plot results/bench_offline

Modes:
  continuous  our engine, batching="continuous": a finished sequence's slot is refilled next step
  static      our engine, batching="static" (max_num_seqs = --static-batch-size): a batch is
              formed only when the previous one has fully finished; finished sequences leave
              the step (flat batches, no padding) but nobody takes their place
  static-padded  our engine, batching="static-padded" (the same batch size): also the padding
              of pre-vLLM static batching, computed: prompts padded to the batch's longest,
              KV reserved for prompt + max_tokens (the pool bounds the batch), finished rows
              decoding pad tokens until the batch's last row ends
  hf          AutoModelForCausalLM.generate on left-padded batches of --hf-batch-size, greedy,
              every row generating the batch's longest requested output

Every request is greedy with ignore_eos and gets exactly its requested output length.
All requests arrive at time 0, so TTFT includes queueing; a request's latency ends when
its own last token is out (a streaming client's view; for hf, before its batch returns). Throughputs count each
request's own tokens only; "useful share" is useful token positions over positions run
through the model (padding and recomputation included): 1.0 for our flat batches unless
preemption recomputes. A position is useful if it is a prompt token or an output token
that feeds the next one, so a request contributes prompt + output - 1. In the occupancy
picture, hf's "running sequences" are the rows that still need their own tokens; the
finished rows it keeps computing show up only in the useful share.

Prefix caching (our engine's modes): `--prefix-caching on,off` runs each mode both ways
("continuous" is on, "continuous_no_prefix_caching" off); the warm-up's cached blocks are
dropped before the measured run, so it starts cold. Two workloads share prefixes:

    python -m scripts.bench.offline --workload shared_prefix --modes continuous --prefix-caching on,off
        64 requests in 4 groups, each a 1,024-token system prompt + its own 32-token question, 32 out
    python -m scripts.bench.offline --workload multi_turn --modes continuous --prefix-caching on,off
        16 conversations x 6 turns; turn t resends the whole history (earlier turns and the
        model's own replies) plus a new 64-token turn; the 16 turn-t requests go in together
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import threading
import time
from pathlib import Path

from frontend.spec_decode_metrics import format_spec_decode, spec_decode_summary, subtract_spec_decode
from ipc.engine_config import QUANTIZATIONS
from scripts.bench.offline_hf import run_hf
from scripts.lib.bench_report import cpu_steal_s, engine_flags, machine_info, steal_share, write_report
from scripts.lib.offline_result import ModeResult, print_table, step_columns, step_counts, useful_positions
from scripts.lib.workload import (
    add_prefix_workload_args,
    add_random_workload_args,
    WorkloadRequest,
    make_length_mix_workload,
    make_multi_turn_workload,
    make_shared_prefix_workload,
    make_workload,
)


logger = logging.getLogger("bench_offline")

MODES = ("continuous", "static", "static-padded", "hf")
PREFIX_CACHING = {"on": True, "off": False}
QUICK = dict(num_requests=8, input_len=(8, 32), output_len=(4, 24), static_batch_size=4, hf_batch_size=4)


def warmup_requests(workload: list[WorkloadRequest], max_num_tokens: int, max_num_seqs: int) -> list[WorkloadRequest]:
    """The leading requests whose prompts fill about one step's token budget, so the
    warm-up runs a full-size prefill step and a few decode steps."""
    chosen, num_tokens = [], 0
    for r in workload[:max_num_seqs]:
        if chosen and num_tokens + r.num_prompt_tokens > max_num_tokens:
            break
        chosen.append(r)
        num_tokens += r.num_prompt_tokens
    return chosen


def check_lengths(workload: list[WorkloadRequest], output_lens: list[int], mode: str) -> None:
    bad = [(i, r.max_tokens, n) for i, (r, n) in enumerate(zip(workload, output_lens)) if n != r.max_tokens]
    if bad:
        raise RuntimeError(f"{mode}: {len(bad)} requests got the wrong output length (index, wanted, got): {bad[:5]}")


def result_name(mode: str, prefix_caching: bool) -> str:
    return mode if prefix_caching else f"{mode}_no_prefix_caching"


def generate_conversations(llm, conversations) -> tuple[list, list[WorkloadRequest]]:
    """Each round sends every conversation's next turn: its history so far plus the new user turn."""
    from ipc.sampling_params import SamplingParams

    histories = [[] for _ in conversations]
    outputs, sent = [], []
    for turn in range(len(conversations[0].user_turns)):
        requests = [WorkloadRequest(h + c.user_turns[turn], c.max_tokens) for h, c in zip(histories, conversations)]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        round_outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        histories = [r.prompt_token_ids + o.token_ids for r, o in zip(requests, round_outputs)]
        outputs += round_outputs
        sent += requests
    return outputs, sent


def run_engine(mode: str, workload: list[WorkloadRequest], args, prefix_caching: bool = True,
               conversations: list | None = None, live=None, name: str | None = None) -> ModeResult:
    """`conversations` (multi_turn): run those turn by turn; `workload` is then only the warm-up's source.
    `live` (a live_view.LiveView) shows the measured run's steps as run `name`."""
    from engine.llm import LLM
    from ipc.sampling_params import SamplingParams

    startup = time.perf_counter()
    llm = LLM(
        model=args.model,
        batching=mode,
        max_num_seqs=args.max_num_seqs if mode == "continuous" else args.static_batch_size,
        **engine_flags(args, "max_num_batched_tokens", "block_size", "num_kv_blocks", "dtype", "quantization",
                       "kv_cache_dtype", "compile", "load_format", "speculative_config"),
        cpu_prepack=not args.no_cpu_prepack,
        enable_prefix_caching=prefix_caching,
        skip_tokenizer_init=args.load_format == "dummy",  # a config-only folder: token ids in and out
    )
    startup_s = time.perf_counter() - startup
    runner = llm.engine.model_runner
    dtype, compile_mode = str(runner.dtype).removeprefix("torch."), "inductor" if runner.is_compiled else "eager"
    kv_cache_dtype = str(runner.kv_dtype).removeprefix("torch.")
    prompts = [r.prompt_token_ids for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    warmup = warmup_requests(workload, args.max_num_batched_tokens, llm.engine.config.max_num_seqs)
    llm.generate([r.prompt_token_ids for r in warmup], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts are the workload's own: start the measured run cold
    stats_before = llm.engine.stats()
    llm.engine.step_stats.clear()
    llm.engine.record_step_stats = True
    if live is not None:
        live.start_run(name or mode, llm.engine.step_stats)
    steal_before = cpu_steal_s()
    start = time.perf_counter()
    if conversations:
        outputs, workload = generate_conversations(llm, conversations)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stolen = steal_share(steal_before, cpu_steal_s(), elapsed)
    stats = llm.engine.stats()
    check_lengths(workload, [len(o.token_ids) for o in outputs], mode)
    step_stats = list(llm.engine.step_stats)
    del llm
    return ModeResult(
        mode=mode,
        elapsed_s=elapsed,
        num_requests=len(workload),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in workload),
        num_output_tokens=sum(len(o.token_ids) for o in outputs),
        num_useful_positions=useful_positions(workload),
        ttfts=[o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
        latencies=[o.metrics.finish_time - o.metrics.arrival_time for o in outputs],
        step_stats=step_stats,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=args.quantization,
        compile_mode=compile_mode,
        startup_s=startup_s,
        prefix_caching=prefix_caching,
        num_prefix_cache_queries=stats.num_prefix_cache_queries - stats_before.num_prefix_cache_queries,
        num_prefix_cache_hits=stats.num_prefix_cache_hits - stats_before.num_prefix_cache_hits,
        num_preemptions=stats.num_preemptions - stats_before.num_preemptions,
        spec_decode=spec_decode_summary(subtract_spec_decode(stats.spec_decode, stats_before.spec_decode)),
        steal_share=stolen,
        **step_counts(step_stats),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--modes", default="continuous,static,hf", help=f"comma-separated subset of {','.join(MODES)}")
    add_random_workload_args(p)
    p.add_argument("--length-mix", default=None, metavar="P:O,P:O,...",
                   help="instead of the ranges: requests cycle through these (prompt, output) lengths; "
                        "64:16,256:128,512:512 is the seed's example")
    p.add_argument("--real-prompts", action="store_true", help="English text prompts instead of random token ids")
    p.add_argument("--max-num-seqs", type=int, default=64, help="continuous mode's running-sequence cap")
    p.add_argument("--static-batch-size", type=int, default=16, help="both static modes' batch size (their max_num_seqs)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from the engine's memory budget")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="CPU: int8 W8A8 or int4 W4A8 weights (default: none)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="our engine's KV cache (auto: the activations' dtype, bf16 beside --quantization's fp32)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="every mode's weights and activations (auto: the engine's choice, bf16 on CPUs with "
                        "native bf16 matmul, else fp32)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of the folder's config.json (a published shape without its checkpoint)")
    p.add_argument("--compile", action="store_true", help="our engine: torch.compile the forward (CPU)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='our engine: speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--no-cpu-prepack", action="store_true", help="our engine: plain F.linear, not oneDNN-prepacked weights")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads for every mode")
    add_prefix_workload_args(p)
    p.add_argument("--prefix-caching", default="on", help="our engine: on, off or on,off (each mode both ways)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PREFIX", help="writes PREFIX_occupancy.png and PREFIX_latency.png")
    p.add_argument("--quick", action="store_true", help="a tiny workload for smoke tests (overrides sizes)")
    p.add_argument("--live", action="store_true",
                   help="serve the occupancy strips of the run as it happens at http://127.0.0.1:PORT/live")
    p.add_argument("--live-port", type=int, default=8001)
    p.add_argument("--live-linger", type=float, default=None, metavar="S",
                   help="keep the live page up S seconds after the run (default: until Ctrl-C on a terminal, else 0)")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.input_len, args.output_len = tuple(args.input_len), tuple(args.output_len)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown or not args.modes:
        p.error(f"--modes takes a subset of {MODES}, got {args.modes}")
    args.prefix_caching = [s.strip() for s in args.prefix_caching.split(",") if s.strip()]
    if not args.prefix_caching or set(args.prefix_caching) - set(PREFIX_CACHING):
        p.error(f"--prefix-caching takes on, off or on,off, got {args.prefix_caching}")
    if args.workload == "multi_turn" and "hf" in args.modes:
        p.error("--workload multi_turn runs our engine only: drop hf from --modes")
    return args


def linger_live_view(live, linger_s: float | None) -> None:
    """Keep the finished run's page up: `linger_s` seconds, or until Ctrl-C on a terminal."""
    if linger_s is None:
        linger_s = float("inf") if sys.stdin.isatty() else 0.0
    if linger_s > 0:
        print(f"live view stays at {live.url}" + (" until Ctrl-C" if linger_s == float("inf") else f" for {linger_s:g} s"),
              flush=True)
        try:
            if linger_s == float("inf"):
                threading.Event().wait()
            else:
                time.sleep(linger_s)
        except KeyboardInterrupt:
            pass
    live.close()


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from engine.loader.model_files import resolve_model

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_path = resolve_model(args.model)
    # Only real prompts need text; a config-only folder (--load-format dummy) has no tokenizer.
    tokenizer = AutoTokenizer.from_pretrained(model_path) if args.real_prompts else None
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    conversations = None
    if args.workload == "shared_prefix":
        workload = make_shared_prefix_workload(args.num_requests, args.num_groups, args.prefix_len, args.question_len,
                                               args.shared_output_len, args.seed, vocab_size)
    elif args.workload == "multi_turn":
        conversations = make_multi_turn_workload(args.num_conversations, args.num_turns, args.turn_len,
                                                 args.shared_output_len, args.seed, vocab_size)
        workload = [WorkloadRequest(c.user_turns[0], c.max_tokens) for c in conversations]  # the warm-up's source
    elif args.length_mix:
        workload = make_length_mix_workload(args.length_mix, args.num_requests, args.seed, vocab_size)
    else:
        workload = make_workload(
            args.num_requests, args.input_len, args.output_len, args.distribution, args.seed,
            vocab_size=vocab_size, real_prompts=args.real_prompts, tokenizer=tokenizer,
        )
    logger.info("%d requests, %d prompt + %d output tokens", len(workload),
                sum(r.num_prompt_tokens for r in workload), sum(r.max_tokens for r in workload))

    results: dict[str, ModeResult] = {}
    runs = [(mode, None) for mode in args.modes if mode == "hf"]
    runs = [(mode, PREFIX_CACHING[s]) for mode in args.modes if mode != "hf" for s in args.prefix_caching] + runs
    runs.sort(key=lambda run: args.modes.index(run[0]))
    names = [mode if prefix_caching is None else result_name(mode, prefix_caching) for mode, prefix_caching in runs]
    live = None
    if args.live:
        from scripts.lib.live_view import LiveView

        live = LiveView([n for n, (mode, _) in zip(names, runs) if mode != "hf"], args.live_port).start()
        print(f"live view: {live.url}", flush=True)
    for name, (mode, prefix_caching) in zip(names, runs):
        logger.info("running %s", name)
        if mode == "hf":
            results[name] = run_hf(workload, args, model_path)
        else:
            results[name] = run_engine(mode, workload, args, prefix_caching, conversations, live, name)
            if live is not None:
                live.finish_run(name, results[name].summary())
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    summaries = {mode: r.summary() for mode, r in results.items()}
    baseline = summaries.get("continuous", {}).get("total_tokens_per_s")
    for s in summaries.values():
        s["total_tokens_per_s_vs_continuous"] = s["total_tokens_per_s"] / baseline if baseline else None
    print_table(summaries)
    for mode, s in summaries.items():
        if s.get("spec_decode"):
            print(f"{mode}:\n{format_spec_decode(s['spec_decode'])}")
    if live is not None:
        linger_live_view(live, args.live_linger)

    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "machine": machine_info(),
        "results": {mode: {**summaries[mode], "ttfts_s": r.ttfts, "latencies_s": r.latencies,
                           "step_stats": step_columns(r.step_stats)} for mode, r in results.items()},
    }
    write_report(args.json, report, logger=logger)
    if args.plot:
        from scripts.lib.plots import plot_latency_distributions, plot_occupancy

        prefix = args.plot.removesuffix(".png")
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        plot_occupancy({mode: r.step_stats for mode, r in results.items()}, f"{prefix}_occupancy.png")
        plot_latency_distributions(
            {mode: {"ttft": r.ttfts, "latency": r.latencies} for mode, r in results.items()}, f"{prefix}_latency.png"
        )
        logger.info("wrote %s_occupancy.png and %s_latency.png", prefix, prefix)
    return report


if __name__ == "__main__":
    main()
