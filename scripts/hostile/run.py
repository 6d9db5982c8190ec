"""Hostile client: fuzzed fields, protocol races, slow and oversized connections and a frozen core, against a live server.

    python -m scripts.hostile.run --quick                         # starts its own server on the default model
    python -m scripts.hostile.run --base-url http://127.0.0.1:8000 --client-socket ipc:///tmp/tokenloom.sock

Phases, in this order: a greedy baseline (text, and token ids over the local socket) and the
core's pid; the field fuzzer (scripts/hostile/fuzz.py), after which the core must still be the same
process; one case per known defect (scripts/hostile/cases.py, scripts/hostile/conn.py); the SIGSTOP case last,
since it replaces the core on purpose. At the end /health must be 200, no KV block may be used
once idle, and the baseline must come back unchanged. Between cases the script waits for /health,
so one case that kills the core does not fail the rest. It prints one JSON object (and writes it
to --json) and exits 1 when any case or final check fails.

Without --base-url it starts `frontend.api_server` with a --client-socket in a temporary folder,
--engine-timeout 5 and --restart-engine (the first is left out on a server that lacks it; the
sigstop case then fails, showing what happens today). With --base-url, cases that need the core's
pid are skipped, and so are local-socket cases unless --client-socket is given. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import requests

from scripts.hostile.adapters import adapter_bad_input
from scripts.hostile.images import bad_images
from scripts.hostile.cases import (
    bad_predictions, big_prompt_does_not_freeze, duplicate_local_id, local_abort_race, oov_stop_token, sigstop_core,
    slow_grammar_compile, socket_takeover, tiny_temperature, unsatisfiable_grammar,
)
from scripts.hostile.client import Target
from scripts.hostile.conn import big_header, oversized_bodies, slowloris
from scripts.hostile.fuzz import run_fuzz
from scripts.hostile.lora import lora_bad_input
from scripts.hostile.nesting import nested_json
from scripts.hostile.tokenizing import tokenizing_abuse
from scripts.lib.local_server import launch_server, server_env, stop_server

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
BETWEEN_CASES_WAIT_S = 150.0  # a core killed by a case restarts (back-off plus model load) within this


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(args: argparse.Namespace, port: int, has_engine_timeout: bool) -> list[str]:
    command = [sys.executable, "-m", "frontend.api_server", "--model", args.model, "--port", str(port),
               "--client-socket", args.client_socket, "--restart-engine", "--log-level", "warning",
               "--max-concurrent-requests", str(args.max_concurrent_requests),
               "--enable-lora", "--allow-runtime-lora-updating"]  # the LoRA case's routes
    if has_engine_timeout:
        command += ["--engine-timeout", str(args.engine_timeout)]
    return command + args.server_arg


def supports_engine_timeout() -> bool:
    help_text = subprocess.run([sys.executable, "-m", "frontend.api_server", "--help"], capture_output=True,
                               text=True, cwd=REPO_ROOT, env=server_env(), timeout=120).stdout
    return "--engine-timeout" in help_text


def describe(target: Target) -> None:
    """Fill in the model's bounds: max_model_len from /v1/models, vocab_size from its config.json."""
    card = requests.get(target.url + "/v1/models", timeout=10).json()["data"][0]
    target.model, target.max_model_len, target.model_path = card["id"], card["max_model_len"], card.get("root", "")
    config = Path(card.get("root") or "") / "config.json"
    if config.is_file():
        target.vocab_size = json.loads(config.read_text()).get("vocab_size", target.vocab_size)


def run_case(cases: dict, name: str, target: Target, fn, *fn_args) -> None:
    start = time.monotonic()
    try:
        result = fn(*fn_args)
    except Exception as e:  # a case that crashes is a failed case, not a failed run
        result = {"passed": False, "crashed": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.monotonic() - start, 1)
    if target.wait_healthy(BETWEEN_CASES_WAIT_S) is None:
        result["server_unhealthy_after"] = True
    cases[name] = result
    print(f"hostile: {name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s", file=sys.stderr)


def hostile_run(args: argparse.Namespace, target: Target, engine_timeout: float | None, tmp: Path) -> dict:
    quick = args.quick
    has_pid = target.server_pid is not None
    core_pid_start = (target.core_pids() or [None])[0]
    baseline = target.greedy()
    cases: dict = {}
    skip = {}
    if not target.client_socket:
        skip.update(dict.fromkeys(["local_abort_race", "duplicate_local_id", "socket_takeover"],
                                  "no --client-socket"))
    elif not target.client_socket.startswith("ipc://"):
        skip["socket_takeover"] = "the takeover case starts a second server on an ipc:// socket"
    if not has_pid:
        skip["sigstop_core"] = "needs the core's pid: only when this script starts the server"

    run_case(cases, "fuzz", target, run_fuzz, target, quick, 240.0 if quick else 900.0)
    core_pid_after_fuzz = (target.core_pids() or [None])[0]
    steps = [
        ("oov_stop_token", oov_stop_token, target),
        ("tiny_temperature", tiny_temperature, target, baseline["text"]),
        ("local_abort_race", local_abort_race, target, 20 if quick else 100),
        ("duplicate_local_id", duplicate_local_id, target),
        ("413_delivered", oversized_bodies, target),
        ("big_header", big_header, target),
        ("slowloris", slowloris, target, args.slowloris, args.slowloris),
        ("big_prompt_does_not_freeze", big_prompt_does_not_freeze, target, 2 if quick else 5),
        ("tokenizing_abuse", tokenizing_abuse, target, 6.0 if quick else 20.0),
        ("slow_grammar_compile", slow_grammar_compile, target, 20000 if quick else 30000),
        ("unsatisfiable_grammar", unsatisfiable_grammar, target),
        ("adapter_bad_input", adapter_bad_input, target),
        ("bad_images", bad_images, target),
        ("lora_bad_input", lora_bad_input, target, tmp, target.model_path, 200 if quick else 1000),
        ("nested_json", nested_json, target),
        ("bad_predictions", bad_predictions, target),
        ("socket_takeover", socket_takeover, target,
         server_command(args, free_port(), engine_timeout is not None), tmp / "second-server.log"),
        ("sigstop_core", sigstop_core, target, engine_timeout or args.engine_timeout),
    ]
    for name, fn, *fn_args in steps:
        if name in skip:
            cases[name] = {"passed": None, "skipped": skip[name]}
        else:
            run_case(cases, name, target, fn, *fn_args)

    idle = target.wait_idle(60)
    baseline_end = target.greedy()
    final = {
        "health_200": target.health()[0] == 200,
        "kv_blocks_used_when_idle": idle["kv_blocks_used"],
        "baseline_text_same": baseline_end["text"] == baseline["text"],
        "baseline_token_ids_same": baseline_end.get("token_ids") == baseline.get("token_ids")
        if "token_ids" in baseline else None,
        "core_pid_same_after_fuzz": core_pid_after_fuzz == core_pid_start if has_pid else None,
    }
    failed = [name for name, c in cases.items() if c.get("passed") is False]
    failed_checks = [name for name, ok in final.items() if ok is False or (name.startswith("kv") and ok != 0)]
    return {
        "passed": not failed and not failed_checks,
        "failed_cases": failed,
        "failed_final_checks": failed_checks,
        "skipped_cases": sorted(skip),
        "model": target.model, "vocab_size": target.vocab_size, "max_model_len": target.max_model_len,
        "engine_timeout_s": engine_timeout,  # None: the server has no --engine-timeout flag
        "core_pid": {"start": core_pid_start, "after_fuzz": core_pid_after_fuzz,
                     "end": (target.core_pids() or [None])[0]},
        "baseline": baseline, "baseline_end": baseline_end,
        "final_checks": final,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a test's timeout) unwinds through the finally below, so the started server is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = Path(tempfile.mkdtemp(prefix="tokenloom-hostile-"))
    process, engine_timeout = None, None
    start = time.monotonic()
    if args.base_url:
        target = Target(args.base_url.rstrip("/"), client_socket=args.client_socket)
    else:
        args.client_socket = f"ipc://{tmp}/client.sock"
        engine_timeout = args.engine_timeout if supports_engine_timeout() else None
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = launch_server(server_command(args, port, engine_timeout is not None), url, tmp / "server.log")
        target = Target(url, client_socket=args.client_socket, server_pid=process.pid)
    try:
        describe(target)
        report = hostile_run(args, target, engine_timeout, tmp)
    finally:
        if process is not None:
            exit_code = stop_server(process, 90)
    if process is not None:
        report.update(server_exit_code=exit_code, server_log=str(tmp / "server.log"))
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    text = json.dumps(report, indent=2, default=repr)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["passed"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="attack a running server (loopback only) instead of starting one")
    p.add_argument("--client-socket", metavar="ADDR", help="with --base-url: that server's --client-socket")
    p.add_argument("--model", default="smollm2", help="model for the server this script starts")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the started server (repeat: --server-arg=--max-num-seqs --server-arg=32)")
    p.add_argument("--engine-timeout", type=float, default=5.0, metavar="S", help="the started server's flag")
    p.add_argument("--max-concurrent-requests", type=int, default=64, metavar="N",
                   help="the started server's limit; the slowloris case holds more connections than this")
    p.add_argument("--slowloris", type=int, metavar="N",
                   help="partial-header connections, and as many half-sent bodies (default 200; at most 1000)")
    p.add_argument("--quick", action="store_true", help="fewer fuzz values and repeats (for the test)")
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    args = p.parse_args(argv)
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        p.error("--base-url must be on loopback (127.0.0.1, localhost or ::1)")
    if args.client_socket and not args.base_url:
        p.error("--client-socket names a running server's socket: use it with --base-url")
    if args.client_socket and args.client_socket.startswith("tcp://") \
            and urlparse(args.client_socket).hostname not in LOOPBACK_HOSTS:
        p.error("--client-socket must be ipc:// or a loopback tcp:// address")
    if args.slowloris is None:
        args.slowloris = 100 if args.quick else 200
    if not 0 <= args.slowloris <= 1000:
        p.error("--slowloris must be between 0 and 1000")
    return args


if __name__ == "__main__":
    sys.exit(main())
