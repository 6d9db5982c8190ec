"""How many of our Python files one streamed chat request passes through, in both of a server's processes.

    .venv/bin/python -m scripts.tools.request_path --json results/request_path.json
    .venv/bin/python -m scripts.tools.request_path --list          # the files, by room, one a line

It starts `frontend.cli serve --model M` on a free loopback port, the frontend and its engine
core each run under scripts/tools/trace_files.py (the core through --engine-command), and:

    1. warm-up: a streamed chat completion (max_tokens --max-tokens), so that what a server does
       once, on its first request, is not counted; then one asking for JSON, which waits for the
       grammar compiler the core builds on a thread at start (engine.structured_output.compiler),
       so that build cannot run into the measured request however long it takes;
    2. SIGUSR1 to both processes: each forgets the files it ran so far (start-up, the warm-up);
    3. the measured request: another streamed chat completion, another question, read to [DONE];
    4. SIGUSR2 to both: each writes the files whose functions ran since step 2.

The result is the union of the two processes' files: a file counts when any of its functions
ran on any thread while the request was served (periodic work that happened to run then,
such as a heartbeat, counts too). Files are relative to the repository root and grouped by
room: the folder under engine/, frontend/ or ipc/ they sit in (engine/core, ipc/text), or the
top folder for a module loose in it.

JSON keys: num_files, files, files_by_room, num_files_by_process, files_by_process, model,
max_tokens, measured_text (the measured answer), command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from scripts.lib.bench_report import write_report
from scripts.lib.local_server import free_port, launch_server, stop_server
from scripts.tools.trace_files import ENV_VAR

logger = logging.getLogger("request_path")

TRACER = (sys.executable, "-m", "scripts.tools.trace_files")
ENGINE_MODULE = "engine.loop.core_process"
WARMUP_QUESTION = "Name three colours."
MEASURED_QUESTION = "What is the capital of France?"  # another prompt than the warm-up's: no whole-prompt cache hit
SIGNAL_TIMEOUT_S = 60.0  # a process answers a signal once its main thread is back in Python
REQUEST_TIMEOUT_S = 300.0


def room_of(path: str) -> str:
    """engine/core/scheduler.py -> engine/core; frontend/api_server.py -> frontend."""
    parts = Path(path).parts
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def by_room(files: list[str]) -> dict[str, list[str]]:
    rooms: dict[str, list[str]] = {}
    for path in sorted(files):
        rooms.setdefault(room_of(path), []).append(path)
    return dict(sorted(rooms.items()))


def server_command(model: str, port: int, extra: list[str]) -> list[str]:
    engine_command = shlex.join([*TRACER, "-m", ENGINE_MODULE])
    return [*TRACER, "-m", "frontend.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning",
            "--engine-command", engine_command, *extra]


def traced_children(pid: int) -> list[int]:
    """The processes `pid` started that run under the tracer (its engine cores), from /proc."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    traced = []
    for child in sorted(set(children)):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if "scripts.tools.trace_files" in argv and ENGINE_MODULE in argv:
            traced.append(child)
    return traced


def signal_and_wait(pids: list[int], signum: int, event: str, trace_path: str) -> dict[int, dict]:
    """Send `signum` to every pid and wait for each one's trace file with `event` in it."""
    paths = {pid: Path(trace_path.replace("{pid}", str(pid))) for pid in pids}
    for pid, path in paths.items():
        path.unlink(missing_ok=True)
        os.kill(pid, signum)
    answers, deadline = {}, time.monotonic() + SIGNAL_TIMEOUT_S
    while len(answers) < len(paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {event} trace from {sorted(set(paths) - set(answers))} in {SIGNAL_TIMEOUT_S:.0f} s")
        for pid, path in paths.items():
            if pid not in answers and path.exists():
                answer = json.loads(path.read_text())
                if answer["event"] == event:
                    answers[pid] = answer
        time.sleep(0.05)
    return answers


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def streamed_chat(url: str, model: str, question: str, max_tokens: int, extra: dict | None = None) -> str:
    """One streamed chat completion (with `extra` fields), read to [DONE]; returns its text."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **(extra or {})}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    parts, is_done = [], False
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for line in response:
            line = line.decode().strip()
            if line == "data: [DONE]":
                is_done = True
            elif line.startswith("data: "):
                choices = json.loads(line[len("data: "):]).get("choices") or []
                parts.append((choices[0].get("delta") or {}).get("content") or "" if choices else "")
    if not is_done:
        raise SystemExit("the stream ended without [DONE]")
    return "".join(parts)


def measure(args: argparse.Namespace) -> dict:
    trace_dir = tempfile.mkdtemp(prefix="request-path-")
    trace_path = os.path.join(trace_dir, "trace-{pid}.json")
    os.environ[ENV_VAR] = trace_path  # the frontend's environment, and so its core's
    port = free_port()
    command = server_command(args.model, port, shlex.split(args.server_args))
    url = f"http://127.0.0.1:{port}"
    log_path = Path(trace_dir) / "server.log"
    logger.info("starting %s (log %s)", shlex.join(command), log_path)
    process = launch_server(command, url, log_path)
    try:
        pids = {"frontend": process.pid}
        cores = traced_children(process.pid)
        if len(cores) != 1:
            raise SystemExit(f"expected one traced engine core under the frontend, found {cores}")
        pids["engine_core"] = cores[0]
        model = served_model(url)
        streamed_chat(url, model, WARMUP_QUESTION, args.max_tokens)
        streamed_chat(url, model, WARMUP_QUESTION, args.max_tokens, {"response_format": {"type": "json_object"}})
        signal_and_wait(list(pids.values()), signal.SIGUSR1, "cleared", trace_path)
        text = streamed_chat(url, model, MEASURED_QUESTION, args.max_tokens)
        time.sleep(args.settle_s)  # the core's last step may still be finishing after the frontend's [DONE]
        answers = signal_and_wait(list(pids.values()), signal.SIGUSR2, "dumped", trace_path)
    finally:
        stop_server(process, timeout_s=60)
    files_by_process = {name: answers[pid]["files"] for name, pid in pids.items()}
    files = sorted(set().union(*files_by_process.values()))
    return {"num_files": len(files), "files": files, "files_by_room": by_room(files),
            "num_files_by_process": {name: len(f) for name, f in files_by_process.items()},
            "files_by_process": files_by_process, "model": args.model, "max_tokens": args.max_tokens,
            "measured_text": text, "command": shlex.join(command)}


def plain_list(report: dict) -> str:
    lines = []
    for room, files in report["files_by_room"].items():
        lines.append(f"{room} ({len(files)})")
        lines += [f"    {path}" for path in files]
    per_process = ", ".join(f"{n} in the {name}" for name, n in report["num_files_by_process"].items())
    lines.append(f"{report['num_files']} files ({per_process})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of both requests")
    p.add_argument("--server-args", default="", metavar="ARGS", help="more flags for `frontend.cli serve`")
    p.add_argument("--settle-s", type=float, default=0.2, help="wait after the measured stream ends, before the dump")
    p.add_argument("--json", metavar="PATH", help="write the report here too")
    p.add_argument("--list", action="store_true", help="print the files by room, not the JSON")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = measure(args)
    write_report(args.json, report, indent=2)
    print(plain_list(report) if args.list else json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
