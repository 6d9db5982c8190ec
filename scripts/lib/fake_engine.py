"""A fake engine core for frontend tests and the IPC benchmark: the real protocol, no model.

It speaks what `engine.loop.core_process` speaks (a ROUTER; Hello -> EngineReady; AddRequest,
AbortRequests, Shutdown in; one EngineOutputs per step out) but "generates" by reading
a fixed script: the choice with seed s emits the script's token ids from offset s, so
output text is readable and deterministic. Every running request gets one token per
step; steps run back to back, or `--step-delay` seconds apart. Like the real core, it
sends an empty EngineOutputs as a heartbeat every HEARTBEAT_S while idle. A request with
a prediction has each step's token checked against the prediction's token at that
position: counted accepted when they match, rejected when not (and in the core's
`spec_decode` stats as the `prediction` method's one-token drafts).

    python -m scripts.lib.fake_engine --address tcp://127.0.0.1:PORT --model FOLDER

The model folder is scripts/lib/fake_model.py's `write_fake_model(folder)`. Below the core,
what tests and benchmarks launch it with: `start_fake_engine` (a standalone core) and
`FrontendServer` (a frontend that starts its own fake cores).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import zmq

from ipc.messages import (
    AbortRequests, AddRequest, EngineError, EngineOutputs, EngineReady, FinishReason, Hello, RequestOutput,
    ResetPrefixCache, SchedulerStats, Shutdown, SpecDecodeStats, SpecMethod, StepCounts, TokenLogprobs, WatchSteps,
)
from ipc.sockets import bind_router, recv_routed_message, send_message
# write_fake_model is not used here: tests and the IPC probe import it from this module, the fake core's.
from scripts.lib.fake_model import MAX_MODEL_LEN, SCRIPT, write_fake_model  # noqa: F401
from scripts.lib.local_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
# The fake core's command line: run from the repository root (or with it on PYTHONPATH).
FAKE_ENGINE_ARGV = (sys.executable, "-m", "scripts.lib.fake_engine")
FAKE_ENGINE = " ".join(FAKE_ENGINE_ARGV)
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 4096
HEARTBEAT_S = 1.0


class FakeRequest:
    def __init__(self, identity: bytes, msg: AddRequest, num_script_tokens: int):
        self.identity = identity
        self.request_id = msg.request_id
        self.params = msg.sampling_params
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        self.offset = (msg.sampling_params.seed or 0) % num_script_tokens
        self.num_output_tokens = 0
        self.prediction_token_ids = msg.sampling_params.prediction_token_ids or []


class FakeEngineCore:
    """The busy loop: drain the inbox, then step every running request by one token."""

    def __init__(self, args: argparse.Namespace):
        from tokenizers import Tokenizer

        self.args = args
        tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
        self.script_ids = tokenizer.encode(SCRIPT).ids
        self.vocab_size = tokenizer.get_vocab_size()
        self.max_model_len = args.max_model_len or MAX_MODEL_LEN
        self.ctx = zmq.Context()
        self.socket = bind_router(self.ctx, args.address, allow_remote=args.allow_remote)
        self.running: dict[str, FakeRequest] = {}
        self.prediction_stats = SpecDecodeStats(SpecMethod.PREDICTION)
        self.frontend_identities: set[bytes] = set()  # every frontend that said Hello: heartbeats go to each
        self.is_shutdown = False
        self.event_log = open(args.event_log, "a", buffering=1) if args.event_log else None  # line-buffered
        self.handlers = {Hello: self.on_hello, AddRequest: self.on_add, AbortRequests: self.on_abort,
                         Shutdown: self.on_shutdown, ResetPrefixCache: self.on_reset_prefix_cache,
                         WatchSteps: self.on_watch_steps}
        self.count_steps = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        next_parent_check = 0.0
        next_heartbeat = 0.0
        while not self.is_shutdown:
            if poller.poll(0 if self.running else 100):
                self.drain()
            if self.args.parent_pid and time.monotonic() > next_parent_check:
                next_parent_check = time.monotonic() + 0.5
                if not _is_alive(self.args.parent_pid):
                    break
            if self.running:
                self.step()
                if self.args.step_delay:
                    time.sleep(self.args.step_delay)
            elif time.monotonic() > next_heartbeat:
                next_heartbeat = time.monotonic() + HEARTBEAT_S
                for identity in self.frontend_identities:
                    send_message(self.socket, EngineOutputs(self.args.engine_id, [], self.stats()),
                                 identity)
        self.socket.close(linger=0)

    def drain(self) -> None:
        while True:
            try:
                identity, msg = recv_routed_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handlers[type(msg)](identity, msg)

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        self.frontend_identities.add(identity)
        ready = EngineReady(self.args.engine_id, self.args.model, self.max_model_len, self.vocab_size,
                            NUM_KV_BLOCKS, BLOCK_SIZE, [2])
        send_message(self.socket, ready, identity)

    def on_add(self, identity: bytes, msg: AddRequest) -> None:
        max_tokens = msg.sampling_params.max_tokens
        if max_tokens is not None and max_tokens == self.args.crash_max_tokens:
            send_message(self.socket, EngineError("fake crash", None, True, self.args.engine_id), identity)
            sys.exit(1)
        if max_tokens is not None and max_tokens == self.args.fail_max_tokens:
            send_message(self.socket, EngineError("fake failure", msg.request_id, False, self.args.engine_id), identity)
            return
        self.running[msg.request_id] = FakeRequest(identity, msg, len(self.script_ids))
        self.log_event("add", msg.request_id)

    def log_event(self, event: str, request_id: str) -> None:
        if self.event_log is not None:
            self.event_log.write(f"{event} {request_id}\n")

    def on_abort(self, identity: bytes, msg: AbortRequests) -> None:
        aborted = [self.running.pop(rid) for rid in msg.request_ids if rid in self.running]
        for req in aborted:
            self.log_event("abort", req.request_id)
        outputs = [RequestOutput(req.request_id, [], FinishReason.ABORT) for req in aborted]
        send_message(self.socket, EngineOutputs(self.args.engine_id, outputs, self.stats()), identity)

    def on_reset_prefix_cache(self, identity: bytes, msg: ResetPrefixCache) -> None:
        self.log_event("reset_prefix_cache", str(self.args.engine_id))

    def on_watch_steps(self, identity: bytes, msg: WatchSteps) -> None:
        self.count_steps = msg.is_on

    def on_shutdown(self, identity: bytes, msg: Shutdown) -> None:
        self.is_shutdown = True

    def step(self) -> None:
        counts = self.step_counts() if self.count_steps else None
        outputs_by_frontend: dict[bytes, list[RequestOutput]] = {}
        for req in list(self.running.values()):
            outputs_by_frontend.setdefault(req.identity, []).append(self.next_output(req))
        stats = self.stats()
        for identity, outputs in outputs_by_frontend.items():
            send_message(self.socket, EngineOutputs(self.args.engine_id, outputs, stats, counts), identity)

    def step_counts(self) -> StepCounts:
        """A request's first step prefills its whole prompt; every later one decodes a token."""
        counts = StepCounts()
        for req in self.running.values():
            if req.num_output_tokens == 0:
                counts.num_prefill_requests += 1
                counts.num_prefill_tokens += req.num_prompt_tokens
            else:
                counts.num_decode_requests += 1
                counts.num_decode_tokens += 1
        return counts

    def next_output(self, req: FakeRequest) -> RequestOutput:
        position = req.num_output_tokens
        token_id = self.script_ids[(req.offset + position) % len(self.script_ids)]
        req.num_output_tokens += 1
        num_accepted = num_rejected = 0
        if position < len(req.prediction_token_ids):
            is_accepted = req.prediction_token_ids[position] == token_id
            num_accepted, num_rejected = int(is_accepted), int(not is_accepted)
            stats = self.prediction_stats
            stats.num_drafts += 1
            stats.num_proposed_tokens += 1
            stats.num_accepted_tokens += num_accepted
            stats.num_emitted_tokens += 1
        params = req.params
        finish_reason, stop_token_id = None, None
        if token_id in params.stop_token_ids:
            finish_reason, stop_token_id = FinishReason.STOP, token_id
        elif req.num_output_tokens == params.max_tokens or req.num_prompt_tokens + req.num_output_tokens >= self.max_model_len:
            finish_reason = FinishReason.LENGTH
        logprobs = None
        if params.logprobs is not None:
            top_ids = [token_id, *(t for t in self.script_ids[:params.logprobs + 1] if t != token_id)][:params.logprobs]
            logprobs = [TokenLogprobs(token_id, -0.25, top_ids, [-0.25 - i for i in range(len(top_ids))])]
        if finish_reason is not None:
            del self.running[req.request_id]
        return RequestOutput(req.request_id, [token_id], finish_reason, logprobs, stop_token_id,
                             num_accepted_prediction_tokens=num_accepted,
                             num_rejected_prediction_tokens=num_rejected)

    def stats(self) -> SchedulerStats:
        used = sum(math.ceil((r.num_prompt_tokens + r.num_output_tokens) / BLOCK_SIZE) for r in self.running.values())
        spec_decode = [self.prediction_stats] if self.prediction_stats.num_drafts else []
        return SchedulerStats(len(self.running), 0, used, NUM_KV_BLOCKS - used, 0, spec_decode=spec_decode)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- launching, for tests and benchmarks


def read_event_log(path: Path, event: str) -> list[str]:
    """Request ids with `event` ("add" or "abort") in a core's --event-log, in order."""
    if not path.exists():
        return []
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines() if line.startswith(event + " ")]


def expected_text(model_folder: Path, num_tokens: int, seed: int = 0) -> str:
    """What the fake core generates for `num_tokens` tokens at this seed, decoded in one go."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    script_ids = tokenizer.encode(SCRIPT).ids
    ids = [script_ids[(seed + i) % len(script_ids)] for i in range(num_tokens)]
    return tokenizer.decode(ids)


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_fake_engine(model_folder: Path, address: str, *extra_args: str):
    """A standalone fake core bound at `address`, as `tokenloom engine --listen` would run a real one."""
    import subprocess

    command = [*FAKE_ENGINE_ARGV, "--model", str(model_folder), "--address", address, *extra_args]
    return subprocess.Popen(command, env=subprocess_env(), cwd=REPO_ROOT)


class FrontendServer:
    """`python -m frontend.api_server` in a subprocess on a free loopback port, waited on until /health is 200."""

    def __init__(self, model_folder: Path, *args: str, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", str(model_folder), "--port", str(self.port), "--log-level", "warning", *args]
        if "--engine" not in args and "--engine-command" not in args:
            self.args += ["--engine-command", FAKE_ENGINE]
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"tokenloom-frontend-{self.port}.log"
        self.process = None

    def start(self, timeout_s: float = 300.0) -> "FrontendServer":
        """Starts the frontend and waits until it answers /health. The wait is long because a real
        engine's start (a GGUF's config and tokenizer read, the kernels loaded, the model built)
        took 50 s of a 60 s limit on a host busy with other builds; a frontend that exits ends the
        wait at once, so only a hung start waits it out."""
        import subprocess

        from scripts.lib.local_server import wait_healthy

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "frontend.api_server", *self.args],
                                            stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), cwd=REPO_ROOT)
        if wait_healthy(self.process, self.url, timeout_s, poll_s=0.1):
            return self
        if self.process.poll() is not None:
            raise RuntimeError(f"frontend exited with {self.process.returncode}:\n{self.log()}")
        self.stop()
        raise RuntimeError(f"frontend not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def child_pids(self) -> list[int]:
        """The fake cores this frontend started (Linux /proc)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children")
        return [int(p) for p in children.read_text().split()] if children.exists() else []

    def stop(self, timeout_s: float = 20.0) -> int | None:
        import subprocess

        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> "FrontendServer":
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.stop()
        if exc_type is None:  # keep the log of a failed test for a look
            self.log_path.unlink(missing_ok=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--model", required=True, help="folder made by write_fake_model")
    parser.add_argument("--engine-id", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--allow-remote", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--event-log", help="append 'add ID' and 'abort ID' lines to this file")
    parser.add_argument("--fail-max-tokens", type=int, default=-1, help="reject requests with this max_tokens")
    parser.add_argument("--crash-max-tokens", type=int, default=-1, help="die on a request with this max_tokens")
    args, unknown = parser.parse_known_args(argv)  # the real core's engine args are accepted and ignored
    return args


if __name__ == "__main__":
    FakeEngineCore(parse_args()).run()
