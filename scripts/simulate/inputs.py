"""What the simulator's command line reads: a model's shape, the dtype to price, and the
workload (a JSONL file, or bench_offline's prompts at bench_serving's send times). Shared by
run.py and calibration.py."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from engine.simulator.capacity import poisson_arrivals
from engine.simulator.hardware_profile import HardwareProfile
from engine.simulator.model_shape import ModelShape, load_model_shape
from engine.simulator.simulator import SimulatedRequest
from scripts.lib.workload import length_mix, make_workload


def model_shape_for(model: str, dtype: str) -> ModelShape:
    from scripts.lib.make_model_config import SHAPES, write_model_config

    if model in SHAPES and not Path(model).exists():
        folder = write_model_config(model, Path(tempfile.mkdtemp(prefix="simulate-")) / model)
        return load_model_shape(str(folder), dtype)
    return load_model_shape(model, dtype)


def auto_dtype(profile: HardwareProfile | None) -> str:
    """A calibrated profile's own dtype; the engine's choice here when calibrating; bf16 on GPUs."""
    if profile is not None:
        return profile.dtype or "bfloat16"
    from engine.cpu.host import detect_cpu_features
    from engine.worker.dtype_policy import choose_dtype

    return choose_dtype("auto", "cpu", detect_cpu_features())[0]


def read_workload(path: str) -> list[SimulatedRequest]:
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            try:
                requests.append(SimulatedRequest(int(item["prompt_len"]), int(item["output_len"]),
                                                 float(item.get("arrival_s", 0.0))))
            except (KeyError, ValueError) as e:
                raise SystemExit(f"{path}:{number}: needs prompt_len, output_len (and arrival_s): {e}")
    return requests


def synthetic_workload(args, vocab_size: int) -> list[SimulatedRequest]:
    """bench_offline's prompts (the same token ids), at bench_serving's Poisson send times."""
    arrivals = poisson_arrivals(args.num_requests, args.request_rate, args.seed)
    if args.length_mix:
        pairs = length_mix(args.length_mix, args.num_requests)
        return [SimulatedRequest(p, o, t) for (p, o), t in zip(pairs, arrivals)]
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.distribution,
                             args.seed, vocab_size=vocab_size)
    return [SimulatedRequest(r.num_prompt_tokens, r.max_tokens, t, r.prompt_token_ids)
            for r, t in zip(workload, arrivals)]


def write_workload(path: str, requests: list[SimulatedRequest]) -> None:
    Path(path).write_text("".join(json.dumps({"prompt_len": r.num_prompt_tokens, "output_len": r.max_tokens,
                                              "arrival_s": r.arrival_s}) + "\n" for r in requests))
