"""`scripts/simulate/run.py --calibrate`: measure this machine's peaks, run (or read)
scripts/bench/offline.py and scripts/bench/serving.py, replay their workloads in the simulator and fit the
profile (engine/simulator/calibration.py holds the arithmetic)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from engine.simulator.calibration import MeasuredRun, fit_profile, fit_server, measure_machine
from engine.simulator.capacity import latency_samples, statistic
from engine.simulator.hardware_profile import CALIBRATED, HardwareProfile, calibrated_profile_path
from engine.simulator.model_shape import ModelShape
from engine.simulator.simulator import SimulatedRequest, Simulator, SimulatorConfig
from scripts.lib.workload import make_workload
from scripts.simulate.inputs import auto_dtype, model_shape_for, synthetic_workload

logger = logging.getLogger("simulate")

ENGINE_KV_CACHE_MEMORY_BYTES = 1 << 30  # EngineConfig's default pool, which the measured runs use
# The calibration run: prompts and outputs spread wide, so the fit sees big prefill chunks,
# mixed steps and decode batches of every size, in both modes; not a validation workload.
CALIBRATION_ARGS = ["--num-requests", "48", "--input-len", "8", "512", "--output-len", "8", "160", "--seed", "1",
                    "--modes", "continuous,static", "--static-batch-size", "8"]
# Then served through our HTTP server (its defaults: continuous, 64 sequences), for the
# server's step factor and latency; another seed and rate than the validation's.
CALIBRATION_SERVING_ARGS = ["--num-requests", "32", "--request-rate", "3", "--input-len", "16", "256",
                            "--output-len", "16", "128", "--seed", "1", "--prefix-caching", "on", "--no-progress"]


def replay_bench(bench: dict, shape: ModelShape, profile: HardwareProfile):
    """Each mode of a bench_offline JSON, replayed by the simulator with the run's own settings;
    the steps must match the measured ones one for one."""
    config = bench["config"]
    if config.get("workload", "random") != "random" or config.get("real_prompts"):
        raise SystemExit("calibration replays bench_offline's random workload only")
    workload = make_workload(config["num_requests"], tuple(config["input_len"]), tuple(config["output_len"]),
                             config["distribution"], config["seed"], vocab_size=shape.vocab_size)
    requests = [SimulatedRequest(r.num_prompt_tokens, r.max_tokens, 0.0, r.prompt_token_ids) for r in workload]
    runs = []
    for mode, measured in bench["results"].items():
        batching = mode.removesuffix("_no_prefix_caching")
        if batching not in ("continuous", "static"):
            continue
        sim_config = SimulatorConfig(
            batching=batching, max_num_batched_tokens=config["max_num_batched_tokens"],
            max_num_seqs=config["max_num_seqs"] if batching == "continuous" else config["static_batch_size"],
            block_size=config["block_size"], num_kv_blocks=config.get("num_kv_blocks"),
            enable_prefix_caching=measured.get("prefix_caching", True))
        result = Simulator(shape, profile, sim_config).run(requests)
        steps = measured["step_stats"]
        simulated = [(s.num_tokens, s.num_seqs) for s in result.step_stats]
        if simulated != list(zip(steps["num_tokens"], steps["num_seqs"])):
            raise SystemExit(f"{mode}: the simulator's {len(simulated)} steps differ from the "
                             f"{len(steps['num_tokens'])} measured ones (tokens and sequences per step)")
        runs.append(MeasuredRun(mode, result.step_shapes, steps["start_s"], steps["end_s"], measured["elapsed_s"],
                                len(requests)))
    return runs


def calibrate(args) -> HardwareProfile:
    """Micro-benchmark the peaks, run (or read) bench_offline's steps, fit, save."""
    import torch

    from scripts.bench import offline as bench_offline
    from scripts.bench import serving as bench_serving

    load = os.getloadavg()[0]
    if not args.calibrate_from and load > 0.5 * (os.cpu_count() or 1):
        logger.warning("load average %.1f on %d CPUs: others' work will be fitted as this machine's cost; "
                       "calibrate on a quiet machine", load, os.cpu_count())
    dtype = args.dtype if args.dtype != "auto" else auto_dtype(None)
    shape = model_shape_for(args.model, dtype)
    balance = measure_machine(shape.cost.weight_bytes, shape.hidden_size, shape.intermediate_size,
                              getattr(torch, dtype))
    logger.info("peaks: %.1f GB/s read, %.1f GFLOP/s matmul (%s)", balance.read_bytes_per_s / 1e9,
                balance.matmul_flops_per_s / 1e9, dtype)
    given = [json.loads(Path(path).read_text()) for path in args.calibrate_from]
    benches = [b for b in given if "results" in b]  # bench_offline's
    served = [b for b in given if "summary" in b]  # bench_serving's
    if not given:
        folder = Path(tempfile.mkdtemp(prefix="calibrate-"))
        benches = [bench_offline.main(["--model", args.model, "--dtype", dtype, *CALIBRATION_ARGS,
                                       "--json", str(folder / "bench_offline.json")])]
        served = [bench_serving.main([*CALIBRATION_SERVING_ARGS, "--server-model", args.model,
                                      "--server-arg=--dtype", f"--server-arg={dtype}",
                                      "--json", str(folder / "bench_serving.json")])]
    provisional = HardwareProfile(CALIBRATED, "", {dtype: balance.matmul_flops_per_s}, balance.read_bytes_per_s,
                                  overlap=False, kv_cache_memory_bytes=ENGINE_KV_CACHE_MEMORY_BYTES)
    if not benches:
        raise SystemExit("--calibrate-from needs at least one scripts/bench/offline.py JSON")
    runs = [run for bench in benches for run in replay_bench(bench, shape, provisional)]
    profile = fit_profile(shape, balance, runs, ENGINE_KV_CACHE_MEMORY_BYTES)
    if served:
        fit_served(profile, shape, served[0])
    profile.fit["load_average_1m"] = [load, os.getloadavg()[0]]  # before and after: a busy machine misleads the fit
    path = profile.save(args.profile_out or calibrated_profile_path())
    print(profile.to_json())
    logger.info("wrote %s", path)
    return profile


def fit_served(profile: HardwareProfile, shape: ModelShape, bench: dict) -> None:
    """Set the profile's server terms from a bench_serving run of our server at its defaults."""
    config = {**bench["config"], "length_mix": None, "request_rate": float(bench["config"]["request_rate"])}
    requests = synthetic_workload(argparse.Namespace(**config), shape.vocab_size)

    def medians(factor: float) -> tuple[float, float]:
        trial = HardwareProfile.from_dict({**asdict(profile), "server_step_factor": factor, "server_latency_s": 0.0})
        samples = latency_samples(Simulator(shape, trial, SimulatorConfig(is_served=True)).run(requests))
        return statistic(samples["ttft"], "p50"), statistic(samples["tpot"], "p50")

    summary = bench["summary"]
    profile.server_step_factor, profile.server_latency_s = fit_server(
        medians, summary["ttft_s"]["median"], summary["tpot_s"]["median"])
    profile.fit["server"] = {"num_requests": len(requests), "request_rate": config["request_rate"],
                             "measured_ttft_p50_s": summary["ttft_s"]["median"],
                             "measured_tpot_p50_s": summary["tpot_s"]["median"]}
    logger.info("served: steps x%.3f, %.1f ms latency", profile.server_step_factor, profile.server_latency_s * 1000)
