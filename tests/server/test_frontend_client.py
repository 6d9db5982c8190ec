"""TokenloomClient over HTTP and over the local ZeroMQ socket, plus the raw protocol of docs/protocol.md."""

from __future__ import annotations

import asyncio
import sys
import time

import msgpack
import pytest
import zmq

from frontend.client import TokenloomClient, TokenloomError
from scripts.lib.fake_engine import FAKE_ENGINE, FrontendServer, expected_text, read_event_log
from tests.helpers.server import fake_core

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(model_folder, event_log, tmp_path_factory):
    socket_path = tmp_path_factory.mktemp("sock") / "client.sock"
    core = fake_core("--step-delay", "0.002", "--event-log", str(event_log))
    with FrontendServer(model_folder, *core, "--client-socket", f"ipc://{socket_path}") as server:
        server.client_socket = f"ipc://{socket_path}"
        yield server


def clients(server) -> list[TokenloomClient]:
    return [TokenloomClient(server.url), TokenloomClient.local(server.client_socket)]


@pytest.mark.parametrize("transport", [0, 1], ids=["http", "local"])
def test_generate_and_complete(server, model_folder, transport):
    async def main():
        async with clients(server)[transport] as client:
            chunks = [chunk async for chunk in client.generate("Hi", max_tokens=20, seed=4)]
            completion = await client.complete("Hi", max_tokens=20, seed=4, stop=["lazy"])
            from_ids = await client.complete([5, 6, 7], max_tokens=3)
        return chunks, completion, from_ids

    chunks, completion, from_ids = asyncio.run(main())
    assert "".join(c.text for c in chunks) == expected_text(model_folder, 20, 4)
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 20
    assert completion.text == expected_text(model_folder, 20, 4).split("lazy")[0] and completion.finish_reason == "stop"
    assert from_ids.text == expected_text(model_folder, 3) and from_ids.num_output_tokens == 3


@pytest.mark.parametrize("transport", [0, 1], ids=["http", "local"])
def test_errors_raise(server, transport):
    async def main():
        async with clients(server)[transport] as client:
            with pytest.raises(TokenloomError, match="temperature"):
                await client.complete("Hi", temperature=-1.0)
            with pytest.raises(TokenloomError, match="maximum context length"):
                await client.complete("Hi", max_tokens=5000)

    asyncio.run(main())


@pytest.mark.parametrize("transport", [0, 1], ids=["http", "local"])
def test_leaving_the_loop_aborts(server, event_log, transport):
    num_aborted = len(read_event_log(event_log, "abort"))

    async def main():
        async with clients(server)[transport] as client:
            stream = client.generate("Hi", max_tokens=1000)
            async for _ in stream:
                break
            await stream.aclose()
            await asyncio.sleep(0.5)

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while len(read_event_log(event_log, "abort")) != num_aborted + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)


def test_raw_protocol_example(server, model_folder):
    """The example in docs/protocol.md, with plain pyzmq and msgpack."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.client_socket)
    try:
        params = [0.0, 1.0, -1, 0.0, None, 8, 0, False, [], [], None, True, False]
        sock.send(msgpack.packb([20, "req-1", "Once upon a time", None, params]))
        text, records = "", []
        while True:
            assert sock.poll(5000), "no GenerateOutput"
            record = msgpack.unpackb(sock.recv())
            records.append(record)
            msg_type, request_id, delta, token_ids, finish_reason, error = record
            assert (msg_type, request_id, error) == (21, "req-1", None)
            text += delta
            if finish_reason is not None:
                break
        assert text == expected_text(model_folder, 8) and finish_reason == 2
        assert sum(len(r[3]) for r in records) == 8
        # Abort: the last output says 3 (abort).
        sock.send(msgpack.packb([20, "req-2", "Hi", None, params[:5] + [1000] + params[6:]]))
        assert sock.poll(5000)
        sock.send(msgpack.packb([2, ["req-2"]]))
        while True:
            assert sock.poll(5000)
            record = msgpack.unpackb(sock.recv())
            if record[4] is not None:
                break
        assert record[1] == "req-2" and record[4] == 3
        # A request that does not decode still gets an answer: finish_reason 4 (error).
        sock.send(msgpack.packb([20, "req-3", "Hi", None, [-1.0] + params[1:]]))
        assert sock.poll(5000)
        record = msgpack.unpackb(sock.recv())
        assert record[1] == "req-3" and record[4] == 4 and "temperature" in record[5]
    finally:
        sock.close(linger=0)
        ctx.term()


def collect_finals(sock, num_expected: int, timeout_s: float = 10.0) -> dict[str, list]:
    """Read GenerateOutputs until `num_expected` finals arrived (then 0.5 s more for any extra ones)."""
    finals: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        wait_ms = 500 if sum(map(len, finals.values())) >= num_expected else 100
        if not sock.poll(wait_ms):
            if sum(map(len, finals.values())) >= num_expected:
                break
            continue
        record = msgpack.unpackb(sock.recv())
        if record[4] is not None:
            finals.setdefault(record[1], []).append(record[4])
    return finals


PARAMS_LONG = [0.0, 1.0, -1, 0.0, None, 1000, 0, False, [], [], None, True, False]


@pytest.mark.parametrize("gap_s", [0.0, 0.001, 0.01])
def test_request_aborted_right_after_it_is_sent_still_gets_one_final(server, gap_s):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.client_socket)
    try:
        request_ids = [f"race-{gap_s}-{i}" for i in range(20)]
        for request_id in request_ids:
            sock.send(msgpack.packb([20, request_id, "Hi", None, PARAMS_LONG]))
            if gap_s:
                time.sleep(gap_s)
            sock.send(msgpack.packb([2, [request_id]]))
        finals = collect_finals(sock, len(request_ids))
        assert finals == {request_id: [3] for request_id in request_ids}  # exactly one ABORT each
        # The ids are free again: reusing one runs normally.
        sock.send(msgpack.packb([20, request_ids[0], "Hi", None, PARAMS_LONG[:5] + [4] + PARAMS_LONG[6:]]))
        assert collect_finals(sock, 1) == {request_ids[0]: [2]}
    finally:
        sock.close(linger=0)
        ctx.term()


def test_duplicate_running_id_is_ignored_and_ends_once(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.client_socket)
    try:
        params = PARAMS_LONG[:5] + [40] + PARAMS_LONG[6:]
        sock.send(msgpack.packb([20, "dup", "Hi", None, params]))
        sock.send(msgpack.packb([20, "dup", "Hi", None, params]))
        assert collect_finals(sock, 1) == {"dup": [2]}  # one LENGTH final, no ERROR beside it
    finally:
        sock.close(linger=0)
        ctx.term()


def test_oversized_local_frame_is_refused_and_the_server_serves_on(server):
    ctx = zmq.Context()
    big, sock = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    big.connect(server.client_socket)
    sock.connect(server.client_socket)
    try:
        # Far past what any request for a 1024-token context can need: zmq drops it unread.
        big.send(msgpack.packb([20, "big", "x" * (8 << 20), None, PARAMS_LONG]))
        time.sleep(0.5)
        sock.send(msgpack.packb([20, "small", "Hi", None, PARAMS_LONG[:5] + [3] + PARAMS_LONG[6:]]))
        assert collect_finals(sock, 1) == {"small": [2]}
        assert not big.poll(200)  # nothing was answered to the oversized frame
    finally:
        big.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def test_second_server_refuses_a_live_client_socket(server, model_folder):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "frontend.api_server", "--model", str(model_folder), "--port", "1",
         "--engine-command", FAKE_ENGINE, "--client-socket", server.client_socket],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "in use by a running process" in result.stderr, result.stderr[-2000:]

    async def still_served():
        async with TokenloomClient.local(server.client_socket) as client:
            return await client.complete("Hi", max_tokens=3)

    assert asyncio.run(still_served()).num_output_tokens == 3


def test_local_client_drops_malformed_and_multi_frame_messages(tmp_path):
    """The client's receiver checks the frame count and survives garbage: only the one
    well-formed output of its request reaches the caller."""
    import zmq.asyncio

    from ipc.codec import encode
    from ipc.messages import FinishReason, GenerateOutput
    from ipc.sockets import bind_router, unpack_frames

    address = f"ipc://{tmp_path}/fake-frontend.sock"

    async def run():
        ctx = zmq.asyncio.Context()
        router = bind_router(ctx, address)
        client = TokenloomClient.local(address)
        try:
            completion = asyncio.ensure_future(client.complete([1, 2], max_tokens=2))
            identity, request = unpack_frames(await asyncio.wait_for(router.recv_multipart(), 10), is_routed=True)
            wrong = encode(GenerateOutput(request.request_id, "wrong", [9], FinishReason.STOP))
            await router.send_multipart([identity, b"\xc1garbage"])
            await router.send_multipart([identity, b"extra frame", wrong])
            await router.send_multipart([identity, encode(GenerateOutput(request.request_id, "hi", [1, 2],
                                                                         FinishReason.LENGTH))])
            return await asyncio.wait_for(completion, 10)
        finally:
            await client.close()
            router.close()
            ctx.term()

    completion = asyncio.run(run())
    assert (completion.text, completion.finish_reason) == ("hi", "length")
