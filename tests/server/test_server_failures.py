"""A live frontend when engine cores die, and with two cores behind it.

Cores run as `tokenloom engine`-style tcp processes that the test owns (so it can kill
them), or as the frontend's own children (killed through /proc).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from scripts.lib.fake_engine import (
    FrontendServer, free_port, read_event_log, start_fake_engine,
)
from tests.helpers.server import fake_core

pytestmark = pytest.mark.timeout(120)


def stream_in_background(url: str, results: list) -> threading.Thread:
    """A streaming completion that records its SSE lines (or the exception) when it ends."""

    def read() -> None:
        try:
            response = requests.post(f"{url}/v1/completions", stream=True, timeout=30,
                                     json={"prompt": "Hi", "max_tokens": 1000, "stream": True})
            results.append([line for line in response.iter_lines() if line])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def non_streamed_in_background(url: str, results: list, max_tokens: int = 1000) -> threading.Thread:
    def read() -> None:
        response = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens}, timeout=30)
        results.append(response)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def assert_dead_server_answers_503(url: str) -> None:
    health = requests.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
    refused = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=5)
    assert refused.status_code == 503 and "not available" in refused.json()["error"]["message"]
    assert "tokenloom_engine_healthy" in requests.get(f"{url}/metrics", timeout=5).text


def test_killed_remote_engine_fails_requests_and_health(model_folder):
    port = free_port()
    engine = start_fake_engine(model_folder, f"tcp://127.0.0.1:{port}", "--step-delay", "0.01")
    try:
        with FrontendServer(model_folder, "--engine", f"tcp://127.0.0.1:{port}") as server:
            streamed, non_streamed = [], []
            threads = [stream_in_background(server.url, streamed), non_streamed_in_background(server.url, non_streamed)]
            time.sleep(0.5)
            engine.kill()
            for thread in threads:
                thread.join(10)
            assert not any(thread.is_alive() for thread in threads), "a request hung on a dead engine"
            lines = streamed[0]
            assert b"disconnected" in lines[-2] and b'"service_unavailable"' in lines[-2] and lines[-1] == b"data: [DONE]"
            assert non_streamed[0].status_code == 503
            assert_dead_server_answers_503(server.url)
    finally:
        engine.kill()
        engine.wait()


def test_killed_local_engine_fails_requests_and_health(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01")) as server:
        streamed = []
        thread = stream_in_background(server.url, streamed)
        time.sleep(0.5)
        (child_pid,) = server.child_pids()
        os.kill(child_pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive() and b"exited with code -9" in streamed[0][-2]
        assert_dead_server_answers_503(server.url)
        assert server.stop() == 0  # a dead core does not stop a clean shutdown


def test_two_engines_behind_one_frontend_both_take_requests(model_folder, tmp_path):
    ports = [free_port(), free_port()]
    logs = [tmp_path / "engine0.log", tmp_path / "engine1.log"]
    engines = [start_fake_engine(model_folder, f"tcp://127.0.0.1:{port}", "--step-delay", "0.005",
                                 "--event-log", str(log)) for port, log in zip(ports, logs)]
    try:
        addresses = [f"tcp://127.0.0.1:{port}" for port in ports]
        with FrontendServer(model_folder, "--engine", *addresses) as server:
            results = []
            threads = [non_streamed_in_background(server.url, results, 300) for _ in range(6)]
            for thread in threads:
                thread.join(30)
            assert [r.status_code for r in results] == [200] * 6
            assert all(r.json()["usage"]["completion_tokens"] == 300 for r in results)
            assert [len(read_event_log(log, "add")) for log in logs] == [3, 3]
        # Remote cores outlive their frontend.
        assert all(engine.poll() is None for engine in engines)
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()


def test_data_parallel_starts_local_engines(model_folder):
    with FrontendServer(model_folder, "--data-parallel", "2") as server:
        assert len(server.child_pids()) == 2
        response = requests.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert response.json()["usage"]["completion_tokens"] == 5
        children = server.child_pids()
        server.stop()
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children), "local cores outlived the frontend"


def test_server_exits_when_the_engine_cannot_start(model_folder, tmp_path):
    server = FrontendServer(model_folder, "--engine-command", f"{sys.executable} -c 'raise SystemExit(7)'",
                            log_path=tmp_path / "frontend.log")
    with pytest.raises(RuntimeError, match="exited with code 7 before it was ready"):
        server.start()
