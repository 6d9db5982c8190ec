"""The seed's static batching against ours, in one run: continuous, static (head-of-line
blocking only) and static-padded (padding, preallocated KV, finished rows computing) on
three workloads, then once more on a KV pool too small for static-padded's reservations.

    python -m scripts.bench.static --json results/bench_static.json

Workloads (each bench_offline's, 64 requests by default, batches of --static-batch-size):
  reference   prompts and outputs uniform in 16-256
  long_tail   prompts 16-256; 90% of outputs 16 tokens, 10% 256
  seed        the seed's example: cycling 64/16, 256/128 and 512/512 prompt/output tokens
Memory: the reference workload on a pool of --memory-kv-blocks (default: half of what the
first batch's reservations need), every mode; static-padded runs the batches it can hold.

Prints one table (total tok/s, continuous over each static mode) and the attribution of
static-padded's loss (scripts/bench/static_attribution.py); the JSON holds every run's report.
"""

from __future__ import annotations

import argparse
import logging

from scripts.bench import offline as bench_offline
from scripts.bench.static_attribution import attribute, format_attribution
from scripts.lib.bench_report import write_report

logger = logging.getLogger("bench_static")

MODES = ("continuous", "static", "static-padded")
SEED_MIX = "64:16,256:128,512:512"
WORKLOADS = {
    "reference": [],
    "long_tail": ["--distribution", "long_tail"],
    "seed": ["--length-mix", SEED_MIX],
}
QUICK_SEED = ["--length-mix", "8:4,16:8,32:24"]


def reservation_blocks(report: dict) -> int:
    """Blocks the first batch's prompt + max_tokens reservations need (what static-padded holds)."""
    from scripts.bench.offline import make_workload

    config = report["config"]
    workload = make_workload(config["num_requests"], tuple(config["input_len"]), tuple(config["output_len"]),
                             config["distribution"], config["seed"])
    block_size = config["block_size"]
    return sum(-(-(r.num_prompt_tokens + r.max_tokens) // block_size) for r in workload[: config["static_batch_size"]])


def run(args) -> dict:
    common = ["--modes", ",".join(MODES), "--dtype", args.dtype, "--static-batch-size", str(args.static_batch_size),
              "--num-requests", str(args.num_requests)] + (["--quick"] if args.quick else [])
    reports = {}
    for name, extra in WORKLOADS.items():
        if args.quick and name == "seed":
            extra = QUICK_SEED
        logger.info("workload %s", name)
        reports[name] = bench_offline.main(common + extra)
    num_blocks = args.memory_kv_blocks or reservation_blocks(reports["reference"]) // 2
    logger.info("memory-bounded: the reference workload on %d KV blocks", num_blocks)
    reports["memory"] = bench_offline.main(common + ["--num-kv-blocks", str(num_blocks)])
    reports["memory"]["num_kv_blocks"] = num_blocks
    return reports


def summarize(reports: dict) -> dict:
    summary = {"workloads": {}, "attribution": {}}
    for name in WORKLOADS:
        results = reports[name]["results"]
        cont = results["continuous"]["total_tokens_per_s"]
        summary["workloads"][name] = {
            mode: {"total_tokens_per_s": results[mode]["total_tokens_per_s"],
                   "continuous_over": cont / results[mode]["total_tokens_per_s"],
                   "elapsed_s": results[mode]["elapsed_s"],
                   "num_computed_positions": results[mode]["num_computed_positions"],
                   "useful_share": results[mode]["useful_share"]} for mode in MODES}
        summary["attribution"][name] = attribute(*(results[m] for m in MODES))
    memory = reports["memory"]["results"]
    summary["memory"] = {
        "num_kv_blocks": reports["memory"]["num_kv_blocks"],
        **{mode: {"max_batch_rows": memory[mode]["max_batch_rows"], "mean_batch_rows": memory[mode]["mean_batch_rows"],
                  "num_preemptions": memory[mode]["num_preemptions"],
                  "total_tokens_per_s": memory[mode]["total_tokens_per_s"]} for mode in MODES},
    }
    # The memory term: static-padded on the small pool against the reference run's, on the default pool.
    reference = reports["reference"]["results"]
    summary["memory"]["reservation"] = attribute(*(reference[m] for m in MODES),
                                                 padded_bounded=memory["static-padded"])["memory"]
    return summary


def print_tables(summary: dict) -> None:
    print("\n| workload | continuous tok/s | static tok/s | static-padded tok/s | continuous / static | "
          "continuous / static-padded |")
    print("|---|---|---|---|---|---|")
    for name, w in summary["workloads"].items():
        c, s, p = (w[m] for m in MODES)
        print(f"| {name} | {c['total_tokens_per_s']:,.1f} | {s['total_tokens_per_s']:,.1f} | "
              f"{p['total_tokens_per_s']:,.1f} | {s['continuous_over']:.2f}× | **{p['continuous_over']:.2f}×** |")
    print("\n| workload | term | seconds | tokens computed | note |\n|---|---|---|---|---|")
    for name, a in summary["attribution"].items():
        print("\n".join(format_attribution(name, a)))
    m = summary["memory"]
    print(f"\nmemory-bounded ({m['num_kv_blocks']} KV blocks, reference workload):")
    print("| mode | batch rows max / mean | preemptions | total tok/s | continuous / mode |\n|---|---|---|---|---|")
    for mode in MODES:
        ratio = m["continuous"]["total_tokens_per_s"] / m[mode]["total_tokens_per_s"]
        print(f"| {mode} | {m[mode]['max_batch_rows']} / {m[mode]['mean_batch_rows']:.1f} | "
              f"{m[mode]['num_preemptions']} | {m[mode]['total_tokens_per_s']:,.1f} | {ratio:.2f}× |")
    r = m["reservation"]
    print(f"static-padded on this pool against the default pool: {r['seconds']:+.2f} s, "
          f"{r['tokens_computed']:+,} tokens computed, batches of {r['batch_rows']} instead of "
          f"{r['batch_rows_unbounded']}")


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--memory-kv-blocks", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny workloads, for smoke tests")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    reports = run(args)
    summary = summarize(reports)
    print_tables(summary)
    write_report(args.json, {"summary": summary, "runs": reports}, logger=logger)
    return summary


if __name__ == "__main__":
    main()
