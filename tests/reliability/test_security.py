"""Security defaults: loopback binds, the API key, private engine sockets, no pickle, bounded load (fake core)."""

from __future__ import annotations

import ast
import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import zmq

from frontend.admission import Admission, AdmissionConfig
from frontend.errors import AuthenticationError
from frontend.server_args import make_parser
from ipc.sockets import bind_router
from scripts.lib.fake_engine import REPO_ROOT, FrontendServer, free_port, subprocess_env
from tests.helpers.server import fake_core, run_streams, wait_for

pytestmark = pytest.mark.timeout(120)
KEY = "s3cret-key"
API_CALLS = [  # every API route, each with a body it would accept
    ("get", "/v1/models", None),
    ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("post", "/generate", {"prompt": "Hi", "max_tokens": 2}),
]


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_listens_on_loopback_by_default(model_folder):
    assert make_parser().parse_args([]).host == "127.0.0.1"
    with FrontendServer(model_folder) as server:
        assert listening_addresses(server.port) == ["0100007F"]  # 127.0.0.1, and nothing on :: or 0.0.0.0


def call(server, method: str, path: str, body, headers=None) -> requests.Response:
    return requests.request(method, f"{server.url}{path}", json=body, headers=headers or {}, timeout=10)


def test_api_key_guards_every_api_route(model_folder):
    with FrontendServer(model_folder, "--api-key", KEY) as server:
        for method, path, body in API_CALLS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer  {KEY}"}):
                response = call(server, method, path, body, headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
            assert call(server, method, path, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        # Probes and the schema stay open (see docs/reliability.md).
        for path in ("/health", "/metrics", "/openapi.json"):
            assert requests.get(f"{server.url}{path}").status_code == 200


def test_api_key_from_the_environment(model_folder, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_API_KEY", KEY)
    with FrontendServer(model_folder) as server:
        assert call(server, *API_CALLS[1]).status_code == 401
        assert call(server, *API_CALLS[1], {"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_api_key_is_compared_in_constant_time(monkeypatch):
    import frontend.admission

    compared = []
    real = frontend.admission.hmac.compare_digest
    monkeypatch.setattr(frontend.admission.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    admission = Admission(AdmissionConfig(api_key=KEY))
    admission.check_key({b"authorization": f"Bearer {KEY}".encode()})
    with pytest.raises(AuthenticationError):
        admission.check_key({b"authorization": b"Bearer nope"})
    # Both headers (Authorization and Anthropic's x-api-key) are compared every time: no early exit.
    bearer, key = f"Bearer {KEY}".encode(), KEY.encode()
    assert compared == [(bearer, bearer), (b"", key), (b"Bearer nope", bearer), (b"", key)]


def test_engine_socket_is_private(model_folder):
    with FrontendServer(model_folder) as server:
        (core_pid,) = server.child_pids()
        argv = Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")
        address = argv[argv.index(b"--address") + 1].decode()
        assert address.startswith("ipc://")
        path = Path(address[len("ipc://"):])
        folder = path.parent.stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_engine_refuses_a_public_tcp_bind_without_allow_remote():
    start = time.monotonic()
    command = [sys.executable, "-m", "frontend.cli", "engine", "--listen", f"tcp://0.0.0.0:{free_port()}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=subprocess_env())
    assert result.returncode == 2 and time.monotonic() - start < 20
    assert "refusing to bind tcp://0.0.0.0" in result.stderr and "--allow-remote" in result.stderr
    # The core binds through bind_router, which refuses it too, for whoever starts a core directly.
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="refusing to bind"):
            bind_router(ctx, f"tcp://0.0.0.0:{free_port()}")
        bind_router(ctx, f"tcp://0.0.0.0:{free_port()}", allow_remote=True).close()
    finally:
        ctx.term()


PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}
PICKLING_SOCKET_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def pickling_uses(source: str) -> list[int]:
    """Lines that import a pickling module or call pyzmq's pickling socket methods (strings and comments aside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules = {(node.module or "").split(".")[0]}
        else:
            modules = set()
        if modules & PICKLING_MODULES or (isinstance(node, ast.Attribute) and node.attr in PICKLING_SOCKET_CALLS):
            found.append(node.lineno)
    return found


def test_nothing_is_pickled_on_a_socket():
    assert pickling_uses("import pickle\nfrom dill import x\nsock.recv_pyobj()\n'pickle.loads'") == [1, 2, 3]
    offenders = [f"{path.relative_to(REPO_ROOT)}:{line}"
                 for package in ("frontend", "engine", "ipc") for path in sorted((REPO_ROOT / package).rglob("*.py"))
                 for line in pickling_uses(path.read_text())]
    assert not offenders, offenders


def test_concurrent_request_limit_gets_429(model_folder):
    with FrontendServer(model_folder, *fake_core("--step-delay", "0.01"), "--max-concurrent-requests", "3") as server:
        async def run():
            long_ones = asyncio.ensure_future(run_streams(server.url, [
                {"max_tokens": 150, "prompt": f"long {i}"} for i in range(3)]))
            await asyncio.sleep(0.5)  # the 3 are admitted and streaming
            over = await asyncio.to_thread(call, server, *API_CALLS[1])
            health = await asyncio.to_thread(requests.get, f"{server.url}/health")
            return over, health, await long_ones

        over, health, results = asyncio.run(run())
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert "limit of 3 concurrent requests" in over.json()["error"]["message"]
        assert health.status_code == 200  # probes do not count against the limit
        assert [r.num_tokens for r in results] == [150] * 3
        assert wait_for(lambda: call(server, *API_CALLS[1]).status_code == 200, 5)
