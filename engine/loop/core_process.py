"""The engine-core process: a busy loop over `EngineCore`, speaking ipc messages on one ROUTER socket.

    loop:  drain every pending message without blocking
           if there is work: step, send one EngineOutputs
           else:             wait on the socket (with a timeout, to notice a dead parent)

ZeroMQ sends are queued to its own I/O thread, so the loop never blocks on
Python-side I/O while it has work. A bad request fails alone (EngineError with
its id). A step whose model call raises fails the requests it ran (each gets an
EngineError) and the core goes on; only MAX_CONSECUTIVE_STEP_FAILURES failed steps
in a row, or an exception outside a model call, are fatal: reported, then exit.
An idle core sends an empty EngineOutputs every HEARTBEAT_S, so the frontend can
tell a hung core (no message for --engine-timeout) from an idle one.

Run: python -m engine.loop.core_process --model smollm2 --address ipc:///tmp/x --engine-id 0
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time

import zmq

from engine.config import DEFAULT_MODEL
from engine.executor.executor import WorkerDeadError
from engine.executor.process_checks import check_master_addr, die_with_parent
from engine.loop.engine_core import StepError
from engine.loop.step_trace import StepTrace
from engine.cpu.thread_governor import ThreadGovernor
from ipc.codec import DecodeError
from ipc.engine_config import add_engine_args, engine_config_from_args
from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    Hello,
    ResetPrefixCache,
    Shutdown,
    StepCounts,
    WatchSteps,
)
from ipc.sockets import bind_router, drain_messages, parse_address, send_message

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive
GRAMMAR_WAIT_POLL_MS = 2  # a core with only compiling grammars waits this long for messages between looks
HEARTBEAT_S = 1.0  # an idle core's sign of life; a busy one sends a message every step
# A model that fails this many steps in a row is broken, not unlucky: the core gives up.
MAX_CONSECUTIVE_STEP_FAILURES = 3
STEP_FAILED_MESSAGE = "the engine failed while running this request"
FINAL_MESSAGE_LINGER_MS = 2000  # time given to a fatal report to leave before the socket closes


class ModelBrokenError(RuntimeError):
    """Steps keep failing: the model itself is broken, and the core gives up."""


def make_thread_governor(engine) -> ThreadGovernor | None:
    """One for a single-process CPU core stepping with several threads (--adaptive-threads)."""
    import torch

    config = engine.config
    if (not config.adaptive_threads or engine.executor is not None or engine.model_runner.device.type != "cpu"
            or torch.get_num_threads() < 2):
        return None
    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


class EngineCoreProcess:
    def __init__(self, engine, sock: zmq.Socket, engine_id: int, model_name: str, parent_pid: int = 0) -> None:
        self.engine = engine
        self.sock = sock
        self.engine_id = engine_id
        self.model_name = model_name
        self.parent_pid = parent_pid
        self.frontend_identity: bytes | None = None
        self.should_exit = False
        self.num_steps = 0
        self.num_consecutive_step_failures = 0
        self.last_send_time = time.monotonic()
        self.thread_governor = make_thread_governor(engine)
        self.step_trace = StepTrace.from_env()  # TOKENLOOM_STEP_TRACE: a line per step, for diagnosis
        self.handlers = {
            Hello: self._on_hello,
            AddRequest: self._on_add_request,
            AbortRequests: self._on_abort_requests,
            Shutdown: self._on_shutdown,
            ResetPrefixCache: self._on_reset_prefix_cache,
            WatchSteps: self._on_watch_steps,
        }

    # ---- the loop ----

    def run(self) -> None:
        while not self.should_exit:
            has_work = self.engine.has_unfinished_requests()
            if not has_work and self.thread_governor is not None:
                self.thread_governor.idle()  # the first step after starts a new window
            if not has_work and not self.sock.poll(IDLE_POLL_MS, zmq.POLLIN):
                self._check_parent()
                self._send_heartbeat()
                continue
            self._drain_inbox()
            if self.engine.has_unfinished_requests():
                self._step()
                if not self.engine.has_schedulable_requests():  # only grammars compiling: let them have the CPU
                    self._send_heartbeat()
                    self.sock.poll(GRAMMAR_WAIT_POLL_MS, zmq.POLLIN)
            elif self.num_steps % 64 == 0:
                self._check_parent()

    def _drain_inbox(self) -> None:
        drain_messages(self.sock, self.handlers, self._on_malformed)

    def _on_malformed(self, identity: bytes | None, payload: bytes | None, error: DecodeError) -> None:
        logger.error("dropped a malformed message: %s", error)
        if identity is not None:
            # An AddRequest whose id reads fails that request (a 400 for its client), not just the message.
            self._send(EngineError(f"malformed message: {error}", request_id=error.request_id, engine_id=self.engine_id,
                                   is_request_error=error.request_id is not None), identity)

    def _step(self) -> None:
        self.num_steps += 1
        if self.thread_governor is not None:
            if self.engine.has_schedulable_requests():
                self.thread_governor.update()
            else:  # only grammars compiling: our threads idle, not stalled
                self.thread_governor.restart()
        try:
            start = time.perf_counter()
            results = self.engine.step()
            end = time.perf_counter()
        except StepError as e:
            self._on_step_failed(e)
            return
        self.num_consecutive_step_failures = 0
        for request_id, message in results.errors:  # before the outputs, which end those requests
            self._send(EngineError(message, request_id=request_id, engine_id=self.engine_id, is_request_error=True))
        if results.outputs or self.engine.has_schedulable_requests():  # not while only grammars compile
            self._send_outputs(results.outputs, results.step_counts)
        if self.step_trace is not None:  # after the send, so the trace holds its time too
            self.step_trace.record(self.engine, start, self.thread_governor, end=end)

    def _on_step_failed(self, error: StepError) -> None:
        # The detail is in this process's log; the clients get a plain message.
        self.num_consecutive_step_failures += 1
        for request_id in error.request_ids:
            self._send(EngineError(STEP_FAILED_MESSAGE, request_id=request_id, engine_id=self.engine_id))
        self._send_outputs([])  # stats: the failed requests' blocks are free again
        if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise ModelBrokenError(f"the model failed {self.num_consecutive_step_failures} steps in a row "
                                   f"(the last with {type(error.cause).__name__})") from error.cause

    # ---- handlers ----

    def _on_hello(self, identity: bytes, message: Hello) -> None:
        logger.info("frontend %r connected", message.frontend_id)
        self.frontend_identity = identity
        engine = self.engine
        self._send(
            EngineReady(
                engine_id=self.engine_id,
                model_name=self.model_name,
                max_model_len=engine.max_model_len,
                vocab_size=engine.vocab_size,
                num_kv_blocks=engine.num_kv_blocks,
                block_size=engine.config.block_size,
                eos_token_ids=list(engine.model_config.eos_token_ids),
                dtype=str(engine.model_runner.dtype).removeprefix("torch."),
                quantization=engine.config.quantization or "",
                hidden_size=engine.model_config.hidden_size,
                runner=engine.config.runner,
            )
        )

    def _on_add_request(self, identity: bytes, message: AddRequest) -> None:
        try:
            self.engine.add_request(
                message.request_id, message.prompt_token_ids, message.sampling_params, message.arrival_time or None,
                message.pooling_params, message.images, message.lora_request,
            )
        except ValueError as e:
            self._send(EngineError(str(e), request_id=message.request_id, engine_id=self.engine_id,
                                   is_request_error=True), identity)

    def _on_abort_requests(self, identity: bytes, message: AbortRequests) -> None:
        outputs = self.engine.abort_requests(message.request_ids)
        if outputs:
            self._send_outputs(outputs)

    def _on_reset_prefix_cache(self, identity: bytes, message: ResetPrefixCache) -> None:
        logger.info("prefix cache reset: %d cached blocks dropped", self.engine.reset_prefix_cache())

    def _on_watch_steps(self, identity: bytes, message: WatchSteps) -> None:
        self.engine.count_steps = message.is_on

    def _on_shutdown(self, identity: bytes, message: Shutdown) -> None:
        logger.info("shutdown requested: %s", message.reason or "no reason given")
        self.should_exit = True

    # ---- sending ----

    def _send_outputs(self, outputs, step_counts: StepCounts | None = None) -> None:
        self._send(EngineOutputs(self.engine_id, outputs, self.engine.stats(), step_counts))

    def _send_heartbeat(self) -> None:
        if time.monotonic() - self.last_send_time >= HEARTBEAT_S:
            self._send_outputs([])

    def _send(self, message, identity: bytes | None = None) -> None:
        identity = identity or self.frontend_identity
        if identity is None:
            return  # nobody has said Hello yet
        send_message(self.sock, message, identity)
        self.last_send_time = time.monotonic()

    def report_fatal(self, error: BaseException) -> None:
        # Clients may see this text: the detail (traceback, exception text) stays in our log.
        if isinstance(error, (ModelBrokenError, WorkerDeadError)):
            message = f"engine core failed: {error}"
        else:
            message = f"engine core failed: unexpected {type(error).__name__} (see the engine core's log)"
        self.sock.setsockopt(zmq.LINGER, FINAL_MESSAGE_LINGER_MS)
        self._send(EngineError(message, is_fatal=True, engine_id=self.engine_id))

    def inject_fault(self, at_step: int, is_persistent: bool = False) -> None:
        """Test hook: the model raises on its `at_step`-th step (and on every later one if
        `is_persistent`), as a real model bug would. The hook sits on the embedding, which every
        step runs from Python, the decode stack's (engine/cpu/decode_stack.py) too."""
        num_calls = 0

        def raise_at_step(module, args):
            nonlocal num_calls
            num_calls += 1
            if num_calls == at_step or (is_persistent and num_calls > at_step):
                raise RuntimeError(f"injected fault in model forward call {num_calls}")

        self.engine.model_runner.model.embed_tokens.register_forward_pre_hook(raise_at_step)

    def _check_parent(self) -> None:
        self.engine.check_health()  # raises WorkerDeadError when a tensor-parallel worker is gone
        if self.parent_pid and os.getppid() != self.parent_pid:
            logger.warning("parent process %d is gone; exiting", self.parent_pid)
            self.should_exit = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tokenloom engine core")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"known model name or local folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--address", required=True, help="ipc://PATH or tcp://HOST:PORT to bind")
    parser.add_argument("--engine-id", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (0: never)")
    parser.add_argument("--allow-remote", action="store_true", help="allow binding a non-loopback tcp address")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--log-level", default=os.environ.get("TOKENLOOM_LOG_LEVEL", "info"),
                        type=str.lower, choices=["debug", "info", "warning", "error"])
    add_engine_args(parser.add_argument_group("engine"))
    parser.add_argument("--inject-fault-at-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--inject-fault-persistent", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _remove_ipc_socket(address: str, parent_pid: int) -> None:
    """Remove our ipc:// socket file; when the frontend that made its private directory
    is dead (it cannot clean up after a SIGKILL), the directory too, once empty. A live
    frontend keeps the directory: it binds restarted cores there."""
    scheme, path, _ = parse_address(address)
    if scheme != "ipc":
        return
    try:
        os.unlink(path)
        if parent_pid and os.getppid() != parent_pid:
            os.rmdir(os.path.dirname(path))
    except OSError:
        pass


def run_engine_core(args: argparse.Namespace) -> int:
    from engine.loop.engine_core import EngineCore

    die_with_parent()
    process: EngineCoreProcess | None = None

    def request_exit(signum, frame):
        # SIGTERM and SIGINT end the loop at the next iteration, not mid-step.
        if process is None:
            raise SystemExit(0)
        process.should_exit = True

    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    sock = bind_router(zmq.Context(), args.address, allow_remote=args.allow_remote)
    try:
        try:
            engine = EngineCore(check_master_addr(engine_config_from_args(args), args.allow_remote))
        except Exception as e:
            logger.exception("engine core failed to start")
            sock.setsockopt(zmq.LINGER, FINAL_MESSAGE_LINGER_MS)
            # Nobody may have said Hello yet: wait briefly for one so the failure is reported.
            if sock.poll(5000, zmq.POLLIN):
                identity = sock.recv_multipart()[0]
                error = EngineError(f"engine core failed to start: {e!r}", is_fatal=True, engine_id=args.engine_id)
                send_message(sock, error, identity)
            return 1
        # Everything alive now (torch, transformers, the model) lives as long as this process:
        # out of the collector's sight, a full collection no longer walks it each time the
        # steps' short-lived objects set one off (4-8% of a step here; vLLM does the same).
        gc.collect()
        gc.freeze()
        process = EngineCoreProcess(engine, sock, args.engine_id, args.served_model_name or args.model, args.parent_pid)
        if args.inject_fault_at_step is not None:
            process.inject_fault(args.inject_fault_at_step, args.inject_fault_persistent)
        logger.info("engine core %d ready at %s", args.engine_id, args.address)
        try:
            process.run()
        except Exception as e:
            logger.exception("engine core failed")
            process.report_fatal(e)
            return 1
        finally:
            engine.shutdown()
        return 0
    finally:
        sock.close()
        _remove_ipc_socket(args.address, args.parent_pid)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s",
    )
    sys.exit(run_engine_core(args))


if __name__ == "__main__":
    main()
