"""Fit this machine's profile: peak rates from micro-benchmarks, efficiencies and
overheads by least squares on measured engine steps.

1. Peaks (`measure_peaks`): the read bandwidth (summing a buffer the size of the
   model's weights) and the matmul rate (an MLP-shaped prepacked matmul of 512 tokens),
   each the best of several timings, as scripts/bench_bound.py measures them.
2. Steps: a `bench_offline.py` run records each step's start, end, sequences and
   tokens. The simulator replays the same workload with the same settings (offline,
   scheduling does not depend on time, so the steps must come out identical: this is
   checked) and so knows each step's context lengths and chunks.
3. Fit. With the CPU's additive step cost (no overlap), each step's period (start to
   the next step's start: the offline loop's own work between steps included) is

       period - weights/bandwidth = step_overhead + seq_overhead·num_seqs
                                    + matmuls/(peak·e_mm) + KV/(bandwidth·e_kv) + attention/(peak·e_attn)

   linear in (step_overhead, seq_overhead, 1/e_mm, 1/e_kv, 1/e_attn): non-negative
   least squares. What elapsed time lies outside the steps (adding the requests) is
   `request_overhead_s` per request.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass

from engine.simulator.hardware_profile import CALIBRATED, HardwareProfile
from engine.simulator.model_shape import ModelShape
from engine.simulator.step_cost import StepCostModel, StepShape

logger = logging.getLogger(__name__)

FEATURES = ("step_overhead_s", "seq_overhead_s", "1/matmul_efficiency", "1/kv_read_efficiency",
            "1/attention_efficiency")
MAX_EFFICIENCY = 1e6  # a term the fit finds free; JSON has no infinity


@dataclass(frozen=True)
class MachineBalance:
    read_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass
class MeasuredRun:
    """One measured mode of a bench_offline run, beside the simulator's replay of it."""

    name: str
    step_shapes: list[StepShape]
    step_starts_s: list[float]
    step_ends_s: list[float]
    elapsed_s: float
    num_requests: int

    @property
    def periods_s(self) -> list[float]:
        starts = self.step_starts_s
        return [b - a for a, b in zip(starts, starts[1:])] + [self.step_ends_s[-1] - starts[-1]]


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_rate(work: float, run, trials: int, sync=lambda: None) -> float:
    """Work per second of the fastest of `trials` timed runs: the machine's capability,
    which an ideal engine would reach (this host is shared, and single timings vary)."""
    run()  # warm up: page faults, primitive creation
    sync()
    best_s = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        run()
        sync()
        best_s = min(best_s, time.perf_counter() - start)
    return work / best_s


def measure_machine(weight_bytes: int, hidden: int, intermediate: int, dtype, device: str = "cpu",
                    trials: int = 7) -> MachineBalance:
    """Read bandwidth (summing a buffer the size of the model's weights) and the matmul rate
    at an MLP-shaped matmul of 512 tokens, as the engine runs it: prepacked on the CPU."""
    import torch

    from engine.models.cpu_packing import PackedLinear, bound_primitive_caches, can_prepack

    bound_primitive_caches()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    buffer = torch.ones(weight_bytes // 4, dtype=torch.float32, device=device)
    read_bytes_per_s = best_rate(buffer.numel() * 4, buffer.sum, trials, sync)

    weight = torch.randn(2 * intermediate, hidden, dtype=dtype, device=device)
    if can_prepack(torch.device(device), dtype):
        linear = PackedLinear(weight, None, batch_size_hint=512)
    else:
        linear = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
    x = torch.randn(512, hidden, dtype=dtype, device=device)
    with torch.inference_mode():
        matmul_flops_per_s = best_rate(2.0 * x.shape[0] * weight.numel(), lambda: linear(x), trials, sync)
    return MachineBalance(read_bytes_per_s, matmul_flops_per_s)


def nonnegative_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: solve, drop the most negative, repeat
    (an active set small enough for five features; numpy only)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    active = list(range(a.shape[1]))
    while True:
        solution = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (solution >= 0).all():
            break
        active.pop(int(np.argmin(solution)))
    coefficients = [0.0] * a.shape[1]
    for index, value in zip(active, solution):
        coefficients[index] = float(value)
    return coefficients


def fit_profile(shape: ModelShape, balance: MachineBalance, runs: list[MeasuredRun],
                kv_cache_memory_bytes: int) -> HardwareProfile:
    """This machine's profile (additive step cost) from measured runs of `shape`."""
    peak = HardwareProfile(CALIBRATED, "", {shape.dtype: balance.matmul_flops_per_s}, balance.read_bytes_per_s,
                           overlap=False)
    cost_model = StepCostModel(shape, peak)
    rows, targets = [], []
    for run in runs:
        for step, period in zip(run.step_shapes, run.periods_s):
            t = cost_model.peak_times(step)
            rows.append([1.0, step.num_seqs, t.matmuls_s, t.kv_s, t.attention_s])
            targets.append(period - t.weights_s)
    step_overhead, seq_overhead, inv_mm, inv_kv, inv_attn = nonnegative_least_squares(rows, targets)

    def efficiency(inverse: float) -> float:
        return 1.0 / inverse if inverse > 1.0 / MAX_EFFICIENCY else MAX_EFFICIENCY

    num_requests = sum(r.num_requests for r in runs)
    outside_steps_s = sum(max(0.0, r.elapsed_s - r.step_ends_s[-1]) for r in runs)
    profile = HardwareProfile(
        name=CALIBRATED,
        source=(f"fitted on this machine ({cpu_model_name()}), {shape.dtype}, {time.strftime('%Y-%m-%d %H:%M')}: "
                f"peak read bandwidth and matmul rate from micro-benchmarks (best of 7), efficiencies and "
                f"overheads by least squares on {len(rows)} measured steps of {shape.name} "
                f"({', '.join(r.name for r in runs)}); KV pool: the engine's default kv_cache_memory_bytes"),
        matmul_flops_per_s={shape.dtype: balance.matmul_flops_per_s},
        memory_bandwidth_bytes_per_s=balance.read_bytes_per_s,
        matmul_efficiency=efficiency(inv_mm),
        bandwidth_efficiency=1.0,  # the measured read rate is what a weight read gets; the rest is in the overhead
        kv_read_efficiency=efficiency(inv_kv),
        attention_efficiency=efficiency(inv_attn),
        overlap=False,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        step_overhead_s=step_overhead,
        seq_overhead_s=seq_overhead,
        request_overhead_s=outside_steps_s / num_requests if num_requests else 0.0,
        cpu_model=cpu_model_name(),
        dtype=shape.dtype,
    )
    fitted = StepCostModel(shape, profile)
    predicted = [fitted.price(s).total_s for r in runs for s in r.step_shapes]
    measured = [p for r in runs for p in r.periods_s]
    profile.fit = {
        "model": shape.name,
        "num_steps": len(rows),
        "runs": [r.name for r in runs],
        "measured_steps_s": sum(measured),
        "predicted_steps_s": sum(predicted),
        "mean_abs_step_error": sum(abs(p - m) for p, m in zip(predicted, measured)) / len(measured),
        "coefficients": dict(zip(FEATURES, (step_overhead, seq_overhead, inv_mm, inv_kv, inv_attn))),
    }
    logger.info("calibrated: %s", profile.fit)
    return profile
