"""What the bench scripts' JSON reports share: the machine they ran on, their size flags' checks, the --json file.

    def parse_args(argv):  # ... require_at_least_one(p, args, ("num_requests", ...))
    LLM(model=args.model, **engine_flags(args, "block_size", "dtype", ...))  # flags named as LLM's arguments
    def run(args): return {..., "machine": machine_info()}
    args, report = run_and_report(parse_args, run, argv, logger)  # the JSON on stdout, and in --json if given
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path


def machine_info() -> dict:
    """The machine a report came from, so that figures from two machines are not compared unawares."""
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "load_average_1m": os.getloadavg()[0],  # at the end of the run: high means a shared, noisy machine
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton

            info["triton_version"] = triton.__version__
        except ImportError:
            pass
    return info


def host_cpu_ticks() -> list[int]:
    """All cores' clock ticks since boot by state, the first line of /proc/stat (user, nice,
    system, idle, iowait, irq, softirq, steal, ...); [] if that line is not the cores' sum.
    Raises OSError where there is no /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return [int(v) for v in fields[1:]] if fields and fields[0] == "cpu" else []


def cpu_steal_s() -> float | None:
    """CPU time the hypervisor gave to other guests so far, all cores summed (/proc/stat's
    "steal"), or None where the kernel does not report it. Read before and after a measured
    run: on a shared VM a run can lose a core for seconds, and its figures then say less."""
    try:
        ticks = host_cpu_ticks()
    except OSError:
        return None
    if len(ticks) < 8:
        return None
    return ticks[7] / os.sysconf("SC_CLK_TCK")


def steal_share(steal_before: float | None, steal_after: float | None, elapsed_s: float) -> float | None:
    """Stolen CPU time over the run's wall time x cores (0: the run had the machine's cores)."""
    if steal_before is None or steal_after is None or elapsed_s <= 0:
        return None
    return (steal_after - steal_before) / (elapsed_s * (os.cpu_count() or 1))


_READ_PROBE: list = []  # the probe's buffer, made once: a fresh one would time its page faults


def read_rate_gb_s(num_bytes: int = 256 << 20, trials: int = 3) -> float:
    """One core's rate of reading memory now, in GB/s (best of `trials` sums of a buffer far
    larger than the caches). Taken between a benchmark's rounds: the memory is the part of a
    shared VM that other guests load most, and a server that streams its weights follows it."""
    import numpy as np

    if not _READ_PROBE or _READ_PROBE[0].nbytes != num_bytes:
        _READ_PROBE[:] = [np.ones(num_bytes // 4, dtype=np.float32)]
    buffer = _READ_PROBE[0]
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def require_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Exits through parser.error when one of the named counts is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def engine_flags(args: argparse.Namespace, *names: str) -> dict:
    """The parsed flags `names` as LLM keyword arguments: --num-kv-blocks is LLM(num_kv_blocks=...)."""
    return {name: getattr(args, name) for name in names}


def write_report(path: str | Path | None, report: dict, indent: int = 1,
                 logger: logging.Logger | None = None) -> None:
    """Writes the report as JSON to `path` (no path: nothing), its folder made if missing; logs it there."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=indent) + "\n")
    if logger is not None:
        logger.info("wrote %s", path)


def run_and_report(parse_args: Callable[[list[str] | None], argparse.Namespace],
                   run: Callable[[argparse.Namespace], dict], argv: list[str] | None,
                   logger: logging.Logger) -> tuple[argparse.Namespace, dict]:
    """A bench's main: INFO logs on stderr, the flags parsed, the run, its report's JSON on stdout and in --json."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=1))
    write_report(args.json, report, logger=logger)
    return args, report
