"""Where a constrained step's time goes: the core's step trace beside every thread's CPU time (issue #58).

    python -m scripts.bench.probes.grammar_timeline --concurrency 32 --json results/grammar_timeline.json

Starts a server with TOKENLOOM_STEP_TRACE (engine/loop/step_trace.py), runs one free round and
one grammar round (the schema's first compile inside it, as on a fresh server) of
scripts/bench/structured_runs.py's workload, and meanwhile reads every thread of the server's
processes (frontend, engine core, grammar checker child) and of this client from /proc every
--interval-ms: CPU seconds and the CPU it last ran on. Per round it reports the steps (step,
forward, fill and its share inside the forward, the wait for it, the mask, whether our C++
kernel masked, the torch threads the governor chose and the readings that chose them) and the
CPU each process's threads used in cores (1.0 = a whole core for the round), so oversubscription
of the 2 cores shows as more than 2.0 in all; and every change of the governor's threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from scripts.bench.structured_runs import run_round
from scripts.lib.step_summary import summarize_steps
from scripts.lib.bench_report import write_report
from scripts.lib.local_server import start_server, stop_server

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def read_threads(pid: int) -> dict[int, tuple[str, float, int]]:
    """{tid: (comm, CPU seconds, the CPU it last ran on)} for one process."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        threads[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[36]))
    return threads


def read_process(pid: int) -> tuple[str, float, int] | None:
    """("all", CPU seconds of all its threads, exited ones included, the CPU it last ran on)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return "all", (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[36])


def process_tree(root: int) -> dict[int, str]:
    """{pid: role} for the server and its descendants."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        parents[int(stat.parent.name)] = (int(text[text.rindex(")") + 2:].split()[1]), cmdline)
    tree, frontier = {root: "frontend"}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in parents.items():
            if ppid == parent and pid not in tree:
                tree[pid] = ("engine-core" if "core_process" in cmdline else
                             "grammar-checker" if "structured_output.checker" in cmdline else cmdline[:40])
                frontier.append(pid)
    return tree


class ThreadSampler:
    """Reads the threads of the server tree and of this process every `interval_s` on a thread of its own."""

    def __init__(self, server_pid: int, interval_s: float) -> None:
        self.server_pid, self.interval_s = server_pid, interval_s
        self.samples: list[tuple[float, dict]] = []  # (perf_counter, {(role, pid, tid): (comm, cpu_s, cpu)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            roles = {**process_tree(self.server_pid), os.getpid(): "bench-client"}
            sample = {}
            for pid, role in roles.items():
                for tid, values in read_threads(pid).items():
                    sample[(role, pid, tid)] = values
                total = read_process(pid)  # with the threads that came and went between samples
                if total is not None:
                    sample[(role, pid, 0)] = total
            self.samples.append((time.perf_counter(), sample))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def cores_used(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """{role: {thread label: cores used over [start, end]}}; a thread label is its name (tid)."""
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        used: dict[str, dict[str, float]] = defaultdict(dict)
        for key, (comm, cpu_s, cpu) in last.items():
            role, pid, tid = key
            share = (cpu_s - first.get(key, (comm, 0.0, cpu))[1]) / (t1 - t0)
            if share >= 0.01:
                label = "all threads" if tid == 0 else "main" if tid == pid else f"{comm} ({tid})"
                used[role][label] = round(share, 3)
        return dict(used)

    def series(self, start: float, end: float, bucket_s: float) -> list[dict]:
        """Each process's cores used (all its threads) per `bucket_s` over [start, end]: the round's timeline."""
        points = []
        edge = start
        while edge < end:
            used = self.cores_used(edge, min(edge + bucket_s, end))
            points.append({"t_s": round(edge - start, 2), **{role: values.get("all threads", 0.0)
                                                               for role, values in used.items()}})
            edge += bucket_s
        return points


def with_steps(series: list[dict], trace_path: Path, start: float, bucket_s: float) -> list[dict]:
    """Each bucket of `series` with its decode steps: how many, their median time, the torch threads."""
    steps = [s for s in map(json.loads, trace_path.read_text().splitlines()) if s["fwd0"] is not None]
    for point in series:
        lo = start + point["t_s"]
        inside = [s for s in steps if lo <= s["t0"] < lo + bucket_s]
        point["steps"] = len(inside)
        if inside:
            point["step_ms"] = round(statistics.median((s["t1"] - s["t0"]) * 1e3 for s in inside), 1)
            point["threads"] = max(s.get("threads", 0) for s in inside)
    return series


def thread_changes(trace_path: Path) -> list[dict]:
    """The steps where the governor's thread count changed, with the readings that changed it."""
    steps = [json.loads(line) for line in trace_path.read_text().splitlines()]
    changes, last = [], None
    for step in steps:
        if step.get("threads") != last:
            last = step.get("threads")
            changes.append({"t_s": round(step["t0"] - steps[0]["t0"], 2), "threads": last,
                            "others_cores": step.get("others"), "busy_share": step.get("busy")})
    return changes


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--interval-ms", type=float, default=50)
    p.add_argument("--bucket-s", type=float, default=0.5, help="the timeline's step: cores used per process")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    trace_path = Path(tempfile.gettempdir()) / f"grammar-timeline-{os.getpid()}.jsonl"
    os.environ["TOKENLOOM_STEP_TRACE"] = str(trace_path)  # the server's environment is this one
    process, url, log_path = start_server("smollm2", args.server_arg, log_name="grammar-timeline")
    rounds = {}
    try:
        with ThreadSampler(process.pid, args.interval_ms / 1e3) as sampler:
            for arm in ("warm-up", "free", "grammar"):
                is_grammar = arm == "grammar"  # its first compile inside the round, as on a fresh server
                start = time.perf_counter()
                result = asyncio.run(run_round(url, None, args.concurrency if arm != "warm-up" else 4,
                                               args.max_tokens if arm != "warm-up" else 8, is_grammar))
                end = time.perf_counter()
                if arm != "warm-up":
                    rounds[arm] = {"tpot_ms": result["tpot_ms"], "steps": summarize_steps(trace_path, start, end),
                                   "cores_used": sampler.cores_used(start, end),
                                   "series": with_steps(sampler.series(start, end, args.bucket_s), trace_path,
                                                        start, args.bucket_s)}
    finally:
        stop_server(process)
    report = {"config": vars(args), "server_log": str(log_path), "trace": str(trace_path), "rounds": rounds,
              "thread_changes": thread_changes(trace_path)}
    print(json.dumps({k: v for k, v in report.items() if k in ("rounds", "thread_changes")}, indent=1))
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
