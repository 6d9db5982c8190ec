"""Where a served one-user decode token's time goes outside the runner's forward (issue #59, serve-path).

    python -m scripts.bench.probes.serve_path --model /work/gs-files/llama1b-q4_k_m.gguf --json OUT

Starts a server with TOKENLOOM_STEP_TRACE (engine/loop/step_trace.py), sends --repeats streamed
completions of --output-len tokens (greedy, EOS ignored), one at a time, and per request splits
each decode step of the core into: schedule (step start -> execute), prepare (-> forward), forward,
sample (-> execute's end), update (-> step's end), send (-> outputs sent) and the loop's gap to the
next step (drain the inbox, the thread governor); beside that the client's interval between text
chunks, the CPU time each process (frontend, engine core, this client) spent per token, and how
long its threads waited for a core per token (schedstat's run delay: a compute thread that waited
lost its core to another thread, the frontend's or a neighbour's).
The medians, in ms, show what the server adds to the forward; `--server-args` passes flags on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from scripts.bench.probes.grammar_timeline import read_process, process_tree
from scripts.lib.bench_report import machine_info, write_report
from scripts.lib.local_server import start_server, stop_server
from scripts.lib.sse_client import served_model, stream_chunks

PARTS = ("schedule", "prepare", "forward", "sample", "update", "send", "gap")


def step_parts(step: dict, next_t0: float | None) -> dict[str, float] | None:
    """A decode step's parts in ms, or None for a step without the execute's times."""
    if step.get("prep0") is None or step["fwd0"] is None:
        return None
    marks = [step["t0"], step["prep0"], step["fwd0"], step["fwd1"], step["sampled"], step["t1"], step["sent"]]
    parts = {name: (b - a) * 1e3 for name, a, b in zip(PARTS, marks, marks[1:])}
    parts["gap"] = (next_t0 - step["sent"]) * 1e3 if next_t0 is not None else None
    parts["total"] = (next_t0 - step["t0"]) * 1e3 if next_t0 is not None else None
    return parts


def median_parts(steps: list[dict]) -> dict[str, float]:
    rows = [p for s, n in zip(steps, [*[s["t0"] for s in steps[1:]], None]) if (p := step_parts(s, n))]
    rows = [r for r in rows if r["gap"] is not None and r["gap"] < 50]  # not the gap after the request's end
    keys = [*PARTS, "total"]
    result = {k: round(statistics.median(r[k] for r in rows), 4) for k in keys} if rows else {}
    if rows:
        result["outside_forward"] = round(result["total"] - result["forward"], 4)
        result["num_steps"] = len(rows)
    return result


def run_delay_by_thread(tree: dict[int, str]) -> dict[str, float]:
    """Seconds each group of the server's threads waited on a run queue so far (schedstat's second
    field): the engine core's first thread, its other threads (the OpenMP helper, ZeroMQ's I/O
    thread) and the frontend's. A compute thread's wait is a core another thread took from it."""
    waits: dict[str, float] = {}
    for pid, role in tree.items():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                delay_ns = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            group = f"{role}-first" if int(task.name) == pid and role == "engine-core" else role
            waits[group] = waits.get(group, 0.0) + delay_ns * 1e-9
    return waits


def cpu_by_role(tree: dict[int, str]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for pid, role in tree.items():
        reading = read_process(pid)
        if reading is not None:
            seconds[role] = seconds.get(role, 0.0) + reading[1]
    own = os.times()
    seconds["client"] = own.user + own.system
    return seconds


async def one_request(session, url: str, model: str, output_len: int, prompt: list[int]) -> tuple[list[float], float, float]:
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True}
    start = time.perf_counter()
    times = [now async for now, chunk in stream_chunks(session, url + "/v1/completions", payload)
             if (chunk.get("choices") or [{}])[0].get("text")]
    return times, start, time.perf_counter()


async def measure(url: str, args, trace: Path, tree_root: int) -> list[dict]:
    runs = []
    async with aiohttp.ClientSession() as session:
        model = await served_model(session, url)
        await one_request(session, url, model, 16, list(range(100, 100 + args.prompt_len)))  # warm-up
        for index in range(args.repeats):
            prompt = [1000 + 7 * index + i for i in range(args.prompt_len)]
            tree = process_tree(tree_root)
            cpu_before, waits_before = cpu_by_role(tree), run_delay_by_thread(tree)
            times, start, end = await one_request(session, url, model, args.output_len, prompt)
            cpu_after, waits_after = cpu_by_role(tree), run_delay_by_thread(tree)
            steps = [json.loads(line) for line in trace.read_text().splitlines()]
            steps = [s for s in steps if times[0] <= s["t0"] <= times[-1]]  # the decode steps: one clock
            intervals = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
            num_tokens = len(times)
            runs.append({
                "decode_tok_s": (num_tokens - 1) / (times[-1] - times[0]),
                "interval_ms": round(statistics.median(intervals), 4),
                "steps_ms": median_parts(steps),
                "cpu_ms_per_token": {role: round((cpu_after[role] - cpu_before.get(role, 0.0)) * 1e3 / num_tokens, 3)
                                     for role in cpu_after},
                "wall_ms_per_token": round((end - start) * 1e3 / num_tokens, 3),
                # engine-core-first: the core's first thread; engine-core: its other threads, summed
                "run_delay_ms_per_token": {group: round((waits_after[group] - waits_before.get(group, 0.0)) * 1e3
                                                        / num_tokens, 3) for group in waits_after},
            })
            print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--server-args", default="", help="more flags for the server")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trace = Path(tempfile.mkdtemp()) / "steps.jsonl"
    os.environ["TOKENLOOM_STEP_TRACE"] = str(trace)
    process, url, log_path = start_server(args.model, shlex.split(args.server_args))
    try:
        runs = asyncio.run(measure(url, args, trace, process.pid))
    finally:
        stop_server(process)
    load = os.getloadavg()
    report = {"config": vars(args), "runs": runs, "load_average_1m_after": load[0], "log": str(log_path),
              "machine": machine_info()}
    write_report(args.json, report)


if __name__ == "__main__":
    main()
