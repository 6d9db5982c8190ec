"""Hostile HTTP clients cannot starve the server (live frontend, fake core, loopback sockets).

Idle connections, heads that never end, bodies that stop half way, heads and bodies far
over their limits: each is cut off in bounded time and memory, never holds a
concurrency slot, and gets a status it can read (408, 413, 431) where it gets one at
all. The server runs with small timeouts and --max-concurrent-requests 4, and is
started under a soft open-file limit of 1024 (a common default) that it must raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import resource
import selectors
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from frontend.server_args import admission_config, make_parser
from scripts.lib.fake_engine import FrontendServer
from scripts.lib.raw_http import connect, read_until_closed
from tests.helpers.server import fake_core, health, rss_mb, run_streams

pytestmark = pytest.mark.timeout(120)
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
BODY_GRACE_S = 1.0  # frontend/http_protocol.py's backstop past the body timeout
MAX_CONCURRENT = 4
MAX_REQUEST_BYTES = 1 << 20  # the default
MAX_HEADER_BYTES = 64 << 10  # the default
STEP_DELAY_S = 0.01  # of the fake core: a long stream outlasts both timeouts
GOOD = {"prompt": "Hi", "max_tokens": 3}
# Headers announce 100 bytes of body; 10 arrive.
HALF_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n" + b'{"prompt":')
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "


@contextlib.contextmanager
def soft_open_file_limit(soft: int):
    """This process's soft limit on open files, for the children started inside."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, old[1]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.fixture(scope="module")
def server(model_folder):
    server = FrontendServer(model_folder, *fake_core("--step-delay", str(STEP_DELAY_S)),
                            "--max-concurrent-requests", str(MAX_CONCURRENT),
                            "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S))
    with soft_open_file_limit(1024):
        server.start()
    yield server
    server.__exit__(None, None, None)


def post_good(server) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", json=GOOD, timeout=10)


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def send_head(server, head: bytes) -> bytes:
    """Send a whole request head (however large), then read the answer."""
    with connect("127.0.0.1", server.port) as conn:
        conn.sendall(head)
        return read_until_closed(conn, 10)[0]


def test_timeout_flags():
    args = make_parser().parse_args([])
    config = admission_config(args)
    assert (config.header_timeout_s, config.body_timeout_s) == (10.0, 30.0)
    config = admission_config(make_parser().parse_args(["--header-timeout", "2.5", "--body-timeout", "7"]))
    assert (config.header_timeout_s, config.body_timeout_s) == (2.5, 7.0)
    for flag in ("--header-timeout", "--body-timeout"):
        with pytest.raises(ValueError, match="must be positive"):
            admission_config(make_parser().parse_args([flag, "0"]))


def test_server_raises_its_open_file_limit(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 1024:
        pytest.skip("the hard limit leaves nothing to raise")
    limits = Path(f"/proc/{server.process.pid}/limits").read_text()
    (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
    assert line.split()[3:5] == [str(hard), str(hard)]  # started with a soft limit of 1024


def test_half_sent_bodies_hold_no_slot_and_get_408(server):
    started = time.monotonic()
    conns = [connect("127.0.0.1", server.port, HALF_BODY) for _ in range(2 * MAX_CONCURRENT)]
    time.sleep(0.2)  # all their heads are in
    response = post_good(server)
    assert response.status_code == 200 and time.monotonic() - started < 2
    assert health(server.url) == 200
    for conn in conns:
        data, is_closed = read_until_closed(conn, BODY_TIMEOUT_S + 3)
        conn.close()
        assert is_closed
        status, error = status_and_error(data)
        assert status == 408 and f"within {BODY_TIMEOUT_S:g} seconds" in error["message"]
    assert BODY_TIMEOUT_S - 0.2 < time.monotonic() - started < BODY_TIMEOUT_S + 3
    assert post_good(server).status_code == 200


def trickle(conn: socket.socket, data: bytes, interval_s: float) -> None:
    """Send one byte per interval, as a slowloris does to dodge idle timers, until the server hangs up."""
    for i in range(len(data)):
        try:
            conn.sendall(data[i:i + 1])
        except OSError:
            return
        time.sleep(interval_s)


def test_idle_and_unfinished_heads_are_closed_after_the_header_timeout(server):
    started = time.monotonic()
    silent = connect("127.0.0.1", server.port)
    partial = connect("127.0.0.1", server.port, PARTIAL_HEAD)
    trickling = connect("127.0.0.1", server.port)
    threading.Thread(target=trickle, args=(trickling, PARTIAL_HEAD + b"a" * 100, 0.2), daemon=True).start()
    # A kept-alive connection: one whole request, then half of the next head.
    kept_alive = connect("127.0.0.1", server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
    kept_alive_started = time.monotonic()
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHo")
    for conn in (silent, partial, trickling):
        data, is_closed = read_until_closed(conn, HEADER_TIMEOUT_S + 2)
        assert is_closed and data == b""
    assert HEADER_TIMEOUT_S - 0.2 < time.monotonic() - started < HEADER_TIMEOUT_S + 2
    # uvicorn's own keep-alive timer is 5 s; the header timer must cut in first.
    assert read_until_closed(kept_alive, HEADER_TIMEOUT_S + 2) == (b"", True)
    assert time.monotonic() - kept_alive_started < HEADER_TIMEOUT_S + 2
    for conn in (silent, partial, trickling, kept_alive):
        conn.close()
    assert health(server.url) == 200


def test_timeouts_cut_neither_long_responses_nor_idle_kept_alive_connections(server):
    # A stream that outlasts the header and body timeouts (and the body backstop) runs to its end.
    num_tokens = int((BODY_TIMEOUT_S + BODY_GRACE_S + 0.5) / STEP_DELAY_S)
    started = time.monotonic()
    (result,) = asyncio.run(run_streams(server.url, [{"max_tokens": num_tokens, "prompt": "long"}]))
    assert result.error is None and result.num_tokens == num_tokens
    assert time.monotonic() - started > BODY_TIMEOUT_S + BODY_GRACE_S
    # Idle between requests longer than the header timeout: the keep-alive timer governs, not it.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for i in range(2):
            time.sleep(i * (HEADER_TIMEOUT_S + 0.5))
            conn.request("POST", "/v1/completions", body=json.dumps(GOOD), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 3
    finally:
        conn.close()


@pytest.mark.parametrize("size", [100 << 10, 1 << 20, 16 << 20])
def test_oversized_heads_get_431(server, size):
    data = send_head(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
    status, error = status_and_error(data)
    assert status == 431 and f"limit of {MAX_HEADER_BYTES} bytes" in error["message"]
    # Just under the limit is served.
    data = send_head(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                     + b"a" * (MAX_HEADER_BYTES - 1024) + b"\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200")


def test_unterminated_heads_do_not_grow_the_server(server):
    def flood() -> None:
        with contextlib.suppress(OSError), connect("127.0.0.1", server.port, b"GET /health HTTP/1.1\r\nX-Big: ") as conn:
            for _ in range(32):  # 32 MiB, never terminated
                conn.sendall(b"a" * (1 << 20))

    before_mb = rss_mb(server.process.pid)
    threads = [threading.Thread(target=flood) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    growth_mb = rss_mb(server.process.pid) - before_mb
    assert growth_mb < 40, f"the server grew by {growth_mb:.0f} MB"
    assert health(server.url) == 200


@pytest.mark.parametrize("size", [4 << 20, 16 << 20])
def test_oversized_bodies_get_a_readable_413(server, size):
    # http.client sends the whole body before it reads: a server that closes on unread
    # bytes makes the kernel reset the connection, and the client gets that, not the 413.
    # (urllib3 2 catches the broken pipe and often reads the 413 anyway; not every client does.)
    body = b"x" * size
    for _ in range(5):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 413 and response.getheader("connection") == "close"
            assert f"limit of {MAX_REQUEST_BYTES} bytes" in json.loads(response.read())["error"]["message"]
        finally:
            conn.close()
    # Streamed with no Content-Length: cut off at the limit, answered all the same.
    chunks = (body[i:i + (1 << 20)] for i in range(0, size, 1 << 20))
    response = requests.post(f"{server.url}/generate", data=chunks, timeout=30)
    assert response.status_code == 413 and "streamed" in response.json()["error"]["message"]
    assert post_good(server).status_code == 200


def wait_all_closed(conns: list[socket.socket], timeout_s: float) -> dict[socket.socket, bytes]:
    """Read every connection until the server closes it; what each got (missing: not closed in time)."""
    received = {conn: b"" for conn in conns}
    closed = {}
    with selectors.DefaultSelector() as selector:
        for conn in conns:
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while len(closed) < len(conns) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                conn = key.fileobj
                try:
                    part = conn.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    part = b""
                except BlockingIOError:
                    continue
                received[conn] += part
                if not part:
                    closed[conn] = received[conn]
                    selector.unregister(conn)
    return closed


def test_slowloris_of_2000_connections_does_not_starve_requests(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2200:
        pytest.skip("this test opens 2,000 sockets")
    with soft_open_file_limit(hard):
        started = time.monotonic()
        partial = [connect("127.0.0.1", server.port, PARTIAL_HEAD) for _ in range(1000)]
        half = [connect("127.0.0.1", server.port, HALF_BODY) for _ in range(1000)]
        opened_s = time.monotonic() - started
        try:
            request_started = time.monotonic()
            assert post_good(server).status_code == 200
            assert time.monotonic() - request_started < 2
            assert health(server.url) == 200
            # Every one is cut off in time: bare heads closed, half bodies answered 408.
            closed = wait_all_closed(partial + half, BODY_TIMEOUT_S + BODY_GRACE_S + 5)
            assert len(closed) == 2000, f"{2000 - len(closed)} still open; opening took {opened_s:.1f} s"
            assert all(closed[conn] == b"" for conn in partial)
            assert all(closed[conn].startswith(b"HTTP/1.1 408") for conn in half)
        finally:
            for conn in partial + half:
                conn.close()
        assert post_good(server).status_code == 200


def test_bad_predictions_are_400s_naming_the_field_and_leave_the_core_alone(server):
    from scripts.hostile.cases import bad_predictions
    from scripts.hostile.client import Target
    from scripts.lib.fake_engine import MAX_MODEL_LEN

    core_pids = server.child_pids()
    result = bad_predictions(Target(server.url, max_model_len=MAX_MODEL_LEN))
    assert result["passed"], json.dumps(result["answers"], indent=1)
    assert len(result["answers"]) == 10 and server.child_pids() == core_pids
