"""Fit this machine's profile: peak rates from micro-benchmarks, efficiencies and
overheads by least squares on measured engine steps.

1. Peaks (`measure_peaks`): the read bandwidth (summing a buffer the size of the
   model's weights) and the matmul rate (an MLP-shaped prepacked matmul of 512 tokens),
   each the best of several timings, as scripts/bench/probes/bound.py measures them.
2. Steps: a `scripts/bench/offline.py` run records each step's start, end, sequences and
   tokens. The simulator replays the same workload with the same settings (offline,
   scheduling does not depend on time, so the steps must come out identical: this is
   checked) and so knows each step's context lengths and chunks.
3. Fit. Each step's period (start to the next step's start: the offline loop's own
   work between steps included), in one of two forms, whichever fits better:

       additive   period = c + s·num_seqs + read + k_mm·matmuls + k_kv·KV + k_attn·attention
       roofline   period = c + s·num_seqs + max(read, k_mm·matmuls) + k_kv·KV + k_attn·attention

   with every term at peak and each k = 1/efficiency. The additive form is linear: non-
   negative least squares (the weight read is the same every step, so it merges with c
   and keeps its measured time). The roofline form is linear once (read, k_mm) is fixed:
   a grid over those, refined around the best. On this Zen 4 the roofline wins: a
   decode step of 1 to 8 sequences costs about one weight read, whatever its size.
   What elapsed time lies outside the steps (adding the requests) is
   `request_overhead_s` per request.
4. Served (`fit_server`): a `scripts/bench/serving.py` run through our HTTP server, replayed,
   gives the factor by which served steps are slower (the frontend and the client share
   the CPU) and the latency of the path between client and core.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from engine.cpu.host import cpu_name
from engine.simulator.hardware_profile import CALIBRATED, HardwareProfile
from engine.simulator.model_shape import ModelShape
from engine.simulator.step_cost import PeakTimes, StepCostModel, StepShape

logger = logging.getLogger(__name__)

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

    from engine.cpu.host import detect_cpu_features
    from engine.cpu.packing import PackedLinear, bound_primitive_caches, can_prepack, plan_slabs

    bound_primitive_caches()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    buffer = torch.ones(weight_bytes // 4, dtype=torch.float32, device=device)
    read_bytes_per_s = best_rate(buffer.numel() * 4, buffer.sum, trials, sync)

    weight = torch.randn(2 * intermediate, hidden, dtype=dtype, device=device)
    if can_prepack(torch.device(device), dtype):
        # As the engine runs it (oneDNN, or bf16 slabs where those are faster).
        slabs = plan_slabs(dtype, weight_bytes, detect_cpu_features()) if device == "cpu" else None
        linear = PackedLinear(weight, None, batch_size_hint=512, slabs=slabs)
    else:
        linear = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
    x = torch.randn(512, hidden, dtype=dtype, device=device)
    with torch.inference_mode():
        matmul_flops_per_s = best_rate(2.0 * x.shape[0] * weight.numel(), lambda: linear(x), trials, sync)
    return MachineBalance(read_bytes_per_s, matmul_flops_per_s)


def nonnegative_least_squares(rows, targets) -> tuple[list[float], float]:
    """Least squares with every coefficient >= 0: solve, drop the most negative, repeat
    (an active set small enough for a handful of features; numpy only). Returns the
    coefficients and the sum of squared residuals."""
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
    residuals = b - a[:, active] @ solution
    return coefficients, float(residuals @ residuals)


@dataclass
class StepFit:
    """period = overhead + seq·num_seqs + combine(read, k_mm·matmuls) + k_kv·KV + k_attn·attention,
    times at peak; `read` is the weight read's seconds per step (the same every step)."""

    overlap: bool
    read_s: float
    step_overhead_s: float
    seq_overhead_s: float
    k_matmul: float
    k_kv: float
    k_attention: float
    sse: float


def fit_steps(times: list[PeakTimes], num_seqs: list[int], periods: list[float]) -> StepFit:
    """The better of the two forms. Additive: all linear, the read merged into the fixed
    overhead. Roofline: for each (read, k_mm) on a grid, refined twice around the best,
    the rest is linear."""
    import numpy as np

    matmuls = np.array([t.matmuls_s for t in times])
    base = np.array([[1.0, n, t.kv_s, t.attention_s] for t, n in zip(times, num_seqs)])
    y = np.asarray(periods)
    (c, s, k_kv, k_attn, k_mm), sse = nonnegative_least_squares(np.column_stack([base, matmuls]), y)
    best = StepFit(False, 0.0, c, s, k_mm, k_kv, k_attn, sse)
    reads = np.linspace(0.0, float(np.min(y)), 41)
    ks = np.geomspace(0.05, 50.0, 41)
    for _ in range(3):
        for read in reads:
            for k in ks:
                (c, s, k_kv, k_attn), sse = nonnegative_least_squares(base, y - np.maximum(read, k * matmuls))
                if sse < best.sse:
                    best = StepFit(True, float(read), c, s, float(k), k_kv, k_attn, sse)
        if not best.overlap:
            break
        read_step, k_ratio = reads[1] - reads[0], ks[1] / ks[0]
        reads = np.linspace(max(0.0, best.read_s - read_step), best.read_s + read_step, 21)
        ks = np.geomspace(best.k_matmul / k_ratio, best.k_matmul * k_ratio, 21)
    return best


def fit_profile(shape: ModelShape, balance: MachineBalance, runs: list[MeasuredRun],
                kv_cache_memory_bytes: int) -> HardwareProfile:
    """This machine's profile from measured runs of `shape`."""
    peak = HardwareProfile(CALIBRATED, "", {shape.dtype: balance.matmul_flops_per_s}, balance.read_bytes_per_s)
    cost_model = StepCostModel(shape, peak)
    times = [cost_model.peak_times(step) for run in runs for step in run.step_shapes]
    fit = fit_steps(times, [step.num_seqs for run in runs for step in run.step_shapes],
                    [period for run in runs for period in run.periods_s])
    weights_s = times[0].weights_s
    if fit.overlap:
        step_overhead, read_s = fit.step_overhead_s, fit.read_s
    else:  # the fit sees only the read's sum with the fixed overhead: the read keeps its measured time
        step_overhead, read_s = max(0.0, fit.step_overhead_s - weights_s), min(weights_s, fit.step_overhead_s)

    def efficiency(seconds_per_peak_second: float) -> float:
        return min(1.0 / seconds_per_peak_second, MAX_EFFICIENCY) if seconds_per_peak_second > 0 else MAX_EFFICIENCY

    num_requests = sum(r.num_requests for r in runs)
    outside_steps_s = sum(max(0.0, r.elapsed_s - r.step_ends_s[-1]) for r in runs)
    profile = HardwareProfile(
        name=CALIBRATED,
        source=(f"fitted on this machine ({cpu_name()}), {shape.dtype}, {time.strftime('%Y-%m-%d %H:%M')}: "
                f"peak read bandwidth and matmul rate from micro-benchmarks (best of 7), efficiencies and "
                f"overheads by least squares on {len(times)} measured steps of {shape.name} "
                f"({', '.join(r.name for r in runs)}); KV pool: the engine's default kv_cache_memory_bytes"),
        matmul_flops_per_s={shape.dtype: balance.matmul_flops_per_s},
        memory_bandwidth_bytes_per_s=balance.read_bytes_per_s,
        matmul_efficiency=efficiency(fit.k_matmul),
        bandwidth_efficiency=efficiency(read_s / weights_s),
        kv_read_efficiency=efficiency(fit.k_kv),
        attention_efficiency=efficiency(fit.k_attention),
        overlap=fit.overlap,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        step_overhead_s=step_overhead,
        seq_overhead_s=fit.seq_overhead_s,
        request_overhead_s=outside_steps_s / num_requests if num_requests else 0.0,
        cpu_model=cpu_name(),
        dtype=shape.dtype,
    )
    fitted = StepCostModel(shape, profile)
    predicted = [fitted.price(s).total_s for r in runs for s in r.step_shapes]
    measured = [p for r in runs for p in r.periods_s]
    profile.fit = {
        "model": shape.name,
        "num_steps": len(times),
        "runs": [r.name for r in runs],
        "form": "roofline (max)" if fit.overlap else "additive",
        "measured_steps_s": sum(measured),
        "predicted_steps_s": sum(predicted),
        "mean_abs_step_error_s": sum(abs(p - m) for p, m in zip(predicted, measured)) / len(measured),
        "weight_read_s": read_s,
    }
    logger.info("calibrated: %s", profile.fit)
    return profile


def fit_server(simulate: Callable[[float], tuple[float, float]], measured_ttft_p50_s: float,
               measured_tpot_p50_s: float) -> tuple[float, float]:
    """(server_step_factor, server_latency_s) from one served run's medians.

    `simulate(factor)` runs the served workload with that step factor and no latency and
    returns its (TTFT p50, TPOT p50). TPOT fixes the factor: slower steps also batch more,
    so the ratio is applied a few times until it settles. What TTFT still lacks is the
    latency of the path between the client and the core."""
    factor = 1.0
    for _ in range(4):
        factor *= measured_tpot_p50_s / simulate(factor)[1]
    return factor, max(0.0, measured_ttft_p50_s - simulate(factor)[0])
