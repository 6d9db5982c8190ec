"""Faults: client disconnects, core deaths and restarts, SIGTERM drain, a killed frontend, bad ZMQ input.

The fast tests run a live frontend over fake cores; the slow ones run the real core on
the default model (fault injection with --inject-fault-at-step, SIGKILL, raw DEALER).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import requests
import zmq

from ipc.codec import MAX_MESSAGE_BYTES, decode, encode
from ipc.messages import AddRequest, EngineError, EngineOutputs, EngineReady, Hello, SchedulerStats, Shutdown
from ipc.sampling_params import SamplingParams
from scripts.lib.fake_engine import (
    REPO_ROOT, FrontendServer, free_port, read_event_log, subprocess_env,
)
from tests.helpers.server import fake_core, health, is_gone, metric, post_completion, real_server, run_streams, wait_for

pytestmark = pytest.mark.timeout(600)


def abort_10_of_100(url: str, num_tokens: int, long_tokens: int, **extra) -> list:
    """100 streams at once; 10 of them (asking for long_tokens) hang up after 3 events."""
    specs = [{"prompt": f"request {i}", "max_tokens": num_tokens, **extra} for i in range(90)]
    specs += [{"prompt": f"leaver {i}", "max_tokens": long_tokens, "disconnect_after": 3, **extra} for i in range(10)]
    return asyncio.run(run_streams(url, specs))


def test_abort_10_of_100_fake(model_folder, tmp_path):
    events = tmp_path / "events.log"
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.005", "--event-log", str(events))) as server:
        results = abort_10_of_100(server.url, 20, 1000)
        outcomes = [(r.status, r.num_tokens, r.finish_reason, r.error) for r in results[:90]]
        assert outcomes == [(200, 20, "length", None)] * 90
        assert wait_for(lambda: len(read_event_log(events, "abort")) == 10, 10)
        assert len(read_event_log(events, "add")) == 100
        assert metric(server.url, "requests_finished_total", 'finish_reason="abort"') == 10
        assert wait_for(lambda: metric(server.url, "num_requests_running") == 0, 10)


def core_argv(server) -> list[str]:
    (pid,) = server.child_pids()
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_restart_engine_after_sigkill_and_fault_flags_only_on_first_start(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01"), "--restart-engine",
                        "--inject-fault-at-step", "1000000") as server:
        assert "--inject-fault-at-step" in core_argv(server)  # passed through to the first start
        (first_pid,) = server.child_pids()
        stream = asyncio.run(_kill_mid_stream(server.url, first_pid))
        assert stream.error and "exited with code -9" in stream.error
        assert wait_for(lambda: health(server.url) == 200, 30)
        assert server.child_pids() != [first_pid] and "--inject-fault-at-step" not in core_argv(server)
        assert post_completion(server.url, 5).json()["usage"]["completion_tokens"] == 5


async def _kill_mid_stream(url: str, pid: int):
    stream = asyncio.ensure_future(run_streams(url, [{"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}]))
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    return (await stream)[0]


def test_restart_engine_after_a_fatal_engine_error(model_folder):
    with FrontendServer(model_folder, *fake_core("--crash-max-tokens", "7"), "--restart-engine") as server:
        crashed = post_completion(server.url, 7)
        assert crashed.status_code == 503 and "fake crash" in crashed.json()["error"]["message"]
        assert wait_for(lambda: health(server.url) == 200, 30)
        assert post_completion(server.url, 5).json()["usage"]["completion_tokens"] == 5


def sigterm_during_streams(server, num_streams: int, max_tokens: int):
    """SIGTERM once the streams run; returns (their results, what a new request got meanwhile)."""
    async def run():
        streams = asyncio.ensure_future(run_streams(server.url, [
            {"prompt": f"r{i}", "max_tokens": max_tokens} for i in range(num_streams)]))
        await asyncio.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:
            late = (await asyncio.to_thread(post_completion, server.url, 3, timeout_s=5)).status_code
        except requests.ConnectionError:
            late = "refused"
        return await streams, late

    return asyncio.run(run())


def test_sigterm_drains_running_requests_then_exits_0(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01")) as server:
        children = server.child_pids()
        # Cores run in their own session: a Ctrl-C to the terminal's group reaches only the frontend.
        assert os.getsid(children[0]) != os.getsid(server.process.pid)
        results, late = sigterm_during_streams(server, 5, 150)  # 150 steps: about 1.5 s, within the grace
        assert late in (503, "refused")
        assert [(r.num_tokens, r.error) for r in results] == [(150, None)] * 5
        assert server.process.wait(30) == 0
        assert wait_for(lambda: all(is_gone(pid) for pid in children), 10)


def test_sigterm_aborts_what_outlives_the_grace(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01"), "--shutdown-timeout", "1") as server:
        children = server.child_pids()
        start = time.monotonic()
        results, late = sigterm_during_streams(server, 3, 1000)  # 10 s each: far past the 1 s grace
        assert late in (503, "refused")
        assert all(r.error and "shut down before this request finished" in r.error for r in results), results
        assert server.process.wait(30) == 0 and time.monotonic() - start < 15
        assert wait_for(lambda: all(is_gone(pid) for pid in children), 10)


# ---------------------------------------------------------------- the real core (slow)


def test_sigstopped_core_is_dead_after_the_engine_timeout_and_restarted(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01"), "--engine-timeout", "2",
                        "--restart-engine") as server:
        time.sleep(3)  # idle past the timeout: heartbeats keep an idle core alive
        assert health(server.url) == 200
        (first_pid,) = server.child_pids()

        async def stop_mid_stream():
            stream = asyncio.ensure_future(run_streams(server.url, [{"prompt": "Hi", "max_tokens": 1000}]))
            await asyncio.sleep(0.5)
            os.kill(first_pid, signal.SIGSTOP)
            started = time.monotonic()
            result = (await stream)[0]
            return result, time.monotonic() - started

        result, waited_s = asyncio.run(stop_mid_stream())
        assert result.error and "hung" in result.error and waited_s < 5, (result, waited_s)
        assert wait_for(lambda: health(server.url) == 200, 30)
        assert server.child_pids() != [first_pid] and is_gone(first_pid)  # killed, not left stopped
        assert post_completion(server.url, 5).json()["usage"]["completion_tokens"] == 5


def test_sigstopped_core_without_restart_leaves_the_server_503(model_folder):
    with FrontendServer(model_folder, *fake_core(), "--engine-timeout", "1") as server:
        (pid,) = server.child_pids()
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: health(server.url) == 503, 5)
            refused = post_completion(server.url, 3)
            assert refused.status_code == 503 and "hung" in refused.json()["error"]["message"]
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_failing_step_fails_its_requests_and_the_core_serves_on(default_model_path):
    with real_server(default_model_path, "--inject-fault-at-step", "12") as server:
        (core_pid,) = server.child_pids()
        results = asyncio.run(run_streams(server.url, [
            {"prompt": f"Count {i}:", "max_tokens": 200, "ignore_eos": True} for i in range(4)]))
        assert all(r.error == "the engine failed while running this request" for r in results), results
        assert health(server.url) == 200 and server.child_pids() == [core_pid]
        reply = post_completion(server.url, 20, ignore_eos=True)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 20
        assert wait_for(lambda: metric(server.url, "kv_blocks_used") == 0)


@pytest.mark.slow
def test_restart_engine_recovers_from_a_broken_model_and_a_sigkill(default_model_path):
    with real_server(default_model_path, "--inject-fault-at-step", "12", "--inject-fault-persistent",
                     "--restart-engine") as server:
        (broken_pid,) = server.child_pids()
        # Every step from the 12th fails: a few requests fail one by one, then the core gives up.
        for _ in range(3):
            failed = post_completion(server.url, 200, ignore_eos=True)
            assert failed.status_code in (500, 503), failed.text
        # A new core, healthy (the old one reports its last request's failure a few ms before
        # its own, so /health alone could still answer for the old core).
        assert wait_for(lambda: server.child_pids() not in ([], [broken_pid]) and health(server.url) == 200, 300)
        message = failed.json()["error"]["message"]
        assert "Traceback" not in message and "RuntimeError(" not in message, message
        for _ in range(2):  # 40 steps each: the fault (step 12) must not come back
            reply = post_completion(server.url, 40, ignore_eos=True)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 40
        (core_pid,) = server.child_pids()
        stream = asyncio.run(_kill_mid_stream(server.url, core_pid))
        assert stream.error and "exited with code -9" in stream.error
        assert wait_for(lambda: health(server.url) == 200, 300)
        assert post_completion(server.url, 5, ignore_eos=True).json()["usage"]["completion_tokens"] == 5
        assert wait_for(lambda: metric(server.url, "kv_blocks_used") == 0)


@pytest.mark.slow
def test_killed_frontend_takes_its_core_with_it(default_model_path):
    with real_server(default_model_path) as server:
        (core_pid,) = server.child_pids()
        socket_dir = Path(core_argv(server)[core_argv(server).index("--address") + 1][len("ipc://"):]).parent
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_for(lambda: is_gone(core_pid), 10), "the core outlived its frontend"
    shutil.rmtree(socket_dir, ignore_errors=True)  # the dead frontend's private dir: nobody else removes it


def recv(sock: zmq.Socket, timeout_s: float):
    assert sock.poll(int(timeout_s * 1000)), "no reply from the core"
    return decode(sock.recv())


@pytest.mark.slow
def test_core_drops_malformed_and_oversized_messages_and_keeps_serving(default_model_path, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "core.log"
    with open(log, "wb") as out:
        core = subprocess.Popen([sys.executable, "-m", "engine.loop.core_process", "--model", default_model_path,
                                 "--address", address, "--max-num-seqs", "4"], stdout=out, stderr=subprocess.STDOUT,
                                env=subprocess_env(), cwd=REPO_ROOT)
    ctx = zmq.Context()
    dealer, big = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        dealer.connect(address)
        dealer.send(b"\xc1 not msgpack")
        reply = recv(dealer, 300)  # the first reply waits for the model to load
        assert isinstance(reply, EngineError) and "malformed" in reply.message and not reply.is_fatal
        dealer.send(msgpack.packb([1, "r", "not a token list"]))
        reply = recv(dealer, 10)  # an AddRequest whose id reads: that request fails, as the client's error
        assert "malformed" in reply.message and reply.request_id == "r" and reply.is_request_error
        dealer.send(msgpack.packb([1, 7, [1, 2]]))
        reply = recv(dealer, 10)
        assert "malformed" in reply.message and reply.request_id is None and not reply.is_request_error
        dealer.send(encode(EngineOutputs(0, [], SchedulerStats())))  # a well-formed record for the other side
        dealer.send_multipart([b"two", b"frames"])
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.connect(address)
        big.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))  # over MAXMSGSIZE: the core's zmq drops big's connection
        assert monitor.poll(10_000), "the oversized frame did not cost its sender the connection"
        big.disable_monitor()
        monitor.close(0)
        dealer.send(encode(Hello("raw-dealer")))
        assert isinstance(recv(dealer, 10), EngineReady)
        dealer.send(encode(AddRequest("ok", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))))
        tokens, is_finished = [], False
        while not is_finished:
            for out in recv(dealer, 60).outputs:
                tokens += out.new_token_ids
                is_finished = out.finish_reason is not None
        assert len(tokens) == 5 and core.poll() is None
        dealer.send(encode(Shutdown("test done")))
        assert core.wait(30) == 0
    finally:
        core.kill()
        dealer.close(0)
        big.close(0)
        ctx.term()
    text = log.read_text()
    assert "dropped a malformed message" in text and "dropped an unexpected EngineOutputs" in text
    assert "expected 2 frames, got 3" in text
