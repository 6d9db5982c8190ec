"""The capacity simulator's command line: the engine's real scheduler on a step-cost
model (engine/simulator/), for this machine (calibrated) or a GPU's spec sheet.

    python -m scripts.simulate.run --calibrate            # fit this machine's profile (about 2 minutes)
    python -m scripts.simulate.run --model smollm2 --hardware calibrated --workload W.jsonl \
        --batching continuous --max-num-seqs 64 --json out.json
    python -m scripts.simulate.run --model mistral-7b --hardware h100-sxm --num-requests 256 \
        --input-len 1024 1024 --output-len 256 256 --slo ttft_p99=1000,tpot_p50=50 --target-rate 20

--model: smollm2, a shape of scripts/lib/make_model_config.py (mistral-7b), a folder or a
config.json. --hardware: calibrated, a profile in engine/simulator/profiles, or a
profile JSON. The workload: --workload FILE.jsonl (one {"prompt_len", "output_len",
"arrival_s"} per line), or bench_offline's synthetic options (--num-requests,
--input-len, --output-len, --distribution, --seed) with bench_serving's --request-rate
(Poisson arrivals; inf, the default, sends all at 0 as bench_offline), or --length-mix.
The JSON holds bench_offline's and bench_serving's summary fields at the top level.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path

from engine.simulator.capacity import CapacitySearch, parse_slo, poisson_arrivals
from engine.simulator.hardware_profile import (
    CALIBRATED, HardwareProfile, calibrated_profile_path, load_profile, profile_names)
from engine.simulator.model_shape import ModelShape, load_model_shape
from engine.simulator.simulator import SimulatedRequest, Simulator, SimulatorConfig
from scripts.lib.bench_report import write_report
from scripts.simulate.inputs import auto_dtype, model_shape_for, read_workload, synthetic_workload, write_workload
from scripts.lib.workload import add_random_workload_args, length_mix, make_workload


logger = logging.getLogger("simulate")


# ---- simulate, search ----

def simulate(args, shape: ModelShape, profile: HardwareProfile, requests: list[SimulatedRequest]) -> dict:
    from scripts.simulate.report import build_report, plot_kv_blocks, steps_from_columns

    simulator = Simulator(shape, profile, simulator_config(args))
    start = time.perf_counter()
    result = simulator.run(requests)
    wall_s = time.perf_counter() - start
    extra = {"config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
             "model": shape.name, "hardware": profile.name, "hardware_source": profile.source,
             "simulation_wall_s": wall_s}
    report = build_report(result, args.batching, shape.dtype, simulator.config.enable_prefix_caching, extra)
    print(f"{len(requests)} requests, {len(result.step_stats)} steps simulated in {wall_s:.2f} s: "
          f"{report['total_tokens_per_s']:.1f} total tok/s, elapsed {report['elapsed_s']:.2f} s, TTFT p50 "
          f"{report['ttft_s']['median'] * 1000:.1f} ms, TPOT p50 {(report['tpot_s']['median'] or 0) * 1000:.2f} ms")
    if args.plot:
        from scripts.lib.plots import plot_occupancy

        prefix = args.plot.removesuffix(".png")
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        steps = {f"{args.batching} (simulated)": result.step_stats}
        if args.compare:
            other = json.loads(Path(args.compare).read_text())
            if "results" in other:  # bench_offline's: the same mode, measured
                label, columns = f"{args.batching} (measured)", other["results"][args.batching]["step_stats"]
            else:  # another simulation's (the other batching mode, say)
                label, columns = f"{other['config']['batching']} (simulated)", other["step_stats"]
            steps = {label: steps_from_columns(columns), **steps}
        plot_occupancy(steps, f"{prefix}_occupancy.png")
        with_blocks = {label: s for label, s in steps.items() if s[0].num_kv_blocks_used is not None}
        plot_kv_blocks(with_blocks, result.num_kv_blocks, f"{prefix}_kv_blocks.png")
    return report


def simulator_config(args) -> SimulatorConfig:
    return SimulatorConfig(batching=args.batching, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                           tensor_parallel_size=args.tensor_parallel_size, num_kv_blocks=args.num_kv_blocks,
                           pipeline_parallel_size=args.pipeline_parallel_size,
                           enable_prefix_caching=args.enable_prefix_caching, is_served=args.server)


def search_capacity(args, shape: ModelShape, profile: HardwareProfile, requests: list[SimulatedRequest]) -> dict:
    slo = parse_slo(args.slo)
    search = CapacitySearch(Simulator(shape, profile, simulator_config(args)),
                            [(r.num_prompt_tokens, r.max_tokens) for r in requests], slo, seed=args.seed)
    result = search.run(start_rate=args.start_rate)
    report = {"slo_ms": {k: v * 1000 for k, v in slo.items()}, "max_request_rate": result.max_rate,
              "metrics_at_max_rate_ms": {k: v * 1000 for k, v in result.metrics.items()},
              "num_requests_per_evaluation": len(requests), "num_evaluations": result.num_evaluations,
              "model": shape.name, "hardware": profile.name, "batching": args.batching,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.target_rate:
        report["target_rate"] = args.target_rate
        report["num_replicas"] = result.num_replicas(args.target_rate)
    print(json.dumps(report, indent=1))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", action="store_true", help="fit this machine's profile and save it")
    p.add_argument("--calibrate-from", nargs="*", default=[], metavar="BENCH_JSON",
                   help="--calibrate from these scripts/bench/offline.py (and scripts/bench/serving.py) --json runs instead of "
                        "running them")
    p.add_argument("--profile-out", default=None, help=f"--calibrate: where (default {calibrated_profile_path()})")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: a calibrated profile's own dtype, else bfloat16")
    p.add_argument("--hardware", default=CALIBRATED, help=f"one of {profile_names()}, or a profile JSON")
    p.add_argument("--workload", default=None, metavar="FILE.jsonl")
    p.add_argument("--write-workload", default=None, metavar="FILE.jsonl", help="also write the requests simulated")
    add_random_workload_args(p)
    p.add_argument("--length-mix", default=None, metavar="P:O,P:O,...",
                   help="instead of the ranges: requests cycle through these (prompt, output) lengths")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second; inf: all at 0")
    p.add_argument("--batching", choices=["continuous", "static", "static-padded"], default="continuous")
    p.add_argument("--max-num-seqs", type=int, default=64, help="static: the batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: from the profile's KV memory")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--server", action=argparse.BooleanOptionalAction, default=None,
                   help="served through the HTTP server (the profile's server step factor and latency apply); "
                        "default: with --slo, or when requests arrive over time, not all at 0")
    p.add_argument("--slo", default=None, help="search the highest rate within it, e.g. ttft_p99=1000,tpot_p50=50 (ms)")
    p.add_argument("--target-rate", type=float, default=None, help="--slo: replicas needed for this many req/s")
    p.add_argument("--start-rate", type=float, default=1.0, help="--slo: the search's first rate")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PREFIX", help="PREFIX_occupancy.png and PREFIX_kv_blocks.png")
    p.add_argument("--compare", default=None, metavar="BENCH_JSON",
                   help="--plot: draw these steps above the simulated ones: a bench_offline run's (the same mode, "
                        "measured) or another scripts/simulate/run.py --json's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.calibrate or args.calibrate_from:
        from scripts.simulate.calibration import calibrate

        return json.loads(calibrate(args).to_json())
    profile = load_profile(args.hardware)
    shape = model_shape_for(args.model, args.dtype if args.dtype != "auto" else auto_dtype(profile))
    requests = read_workload(args.workload) if args.workload else synthetic_workload(args, shape.vocab_size)
    if args.server is None:  # a capacity search is for a server
        args.server = bool(args.slo) or any(r.arrival_s > 0 for r in requests)
    if args.write_workload:
        write_workload(args.write_workload, requests)
    report = search_capacity(args, shape, profile, requests) if args.slo else simulate(args, shape, profile, requests)
    write_report(args.json, report, logger=logger)
    return report


if __name__ == "__main__":
    main()
