"""TokenloomClient over HTTP and over the local ZeroMQ socket, plus the raw protocol of the README's local-socket section."""

from __future__ import annotations

import asyncio
import sys
import time

import msgpack
import pytest
import zmq
from fake_engine import FAKE_ENGINE_PATH, FrontendServer, expected_text, read_event_log

from frontend.client import TokenloomClient, TokenloomError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(model_folder, event_log, tmp_path_factory):
    socket_path = tmp_path_factory.mktemp("sock") / "client.sock"
    command = f"{sys.executable} {FAKE_ENGINE_PATH} --step-delay 0.002 --event-log {event_log}"
    with FrontendServer(model_folder, "--engine-command", command, "--client-socket", f"ipc://{socket_path}") as server:
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
    """The example in the README's local-socket protocol section, with plain pyzmq and msgpack."""
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
