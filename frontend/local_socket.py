"""The local socket: GenerateRequest in, GenerateOutput text deltas out, over ZeroMQ without HTTP.

    client DEALER --[GenerateRequest | AbortRequests]--> ROUTER frontend (--client-socket ADDR)
    client DEALER <--[GenerateOutput ...]--------------- ROUTER frontend

Each GenerateRequest runs as one task reading an `AsyncEngineClient` stream; the
last GenerateOutput of a request has a finish_reason (ABORT after an abort, ERROR
with `error` set when it failed). Request ids belong to the client, so they are
scoped by the client's ZeroMQ identity. Framing and layouts: the README's local-socket protocol section.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import msgpack
import zmq

from frontend.engine_client import AsyncEngineClient
from frontend.errors import FrontendError
from ipc.codec import MAX_REQUEST_ID_LEN, DecodeError, decode
from ipc.messages import AbortRequests, FinishReason, GenerateOutput, GenerateRequest, MessageType
from ipc.sockets import bind_router, send_message

logger = logging.getLogger(__name__)


class LocalSocketServer:
    """Serves GenerateRequests from local clients on a ROUTER socket."""

    def __init__(self, client: AsyncEngineClient, address: str, allow_remote: bool = False):
        self.client = client
        self.socket = bind_router(client.ctx, address, allow_remote=allow_remote)
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}  # (client identity, its request id)
        self._engine_request_ids = (f"local-{i}" for i in itertools.count())  # short: ids on the wire are bounded
        self._handlers = {GenerateRequest: self._on_generate, AbortRequests: self._on_abort}
        self._serve_task = asyncio.create_task(self._serve(), name="local-socket")
        logger.info("serving GenerateRequest on %s", address)

    async def _serve(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropped a local-socket message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = decode(payload)
            except DecodeError as e:
                self._reject(identity, payload, e)
                continue
            handler = self._handlers.get(type(msg))
            if handler is None:
                logger.warning("local socket got an unexpected %s; ignored", type(msg).__name__)
                continue
            handler(identity, msg)

    def _reject(self, identity: bytes, payload: bytes, error: DecodeError) -> None:
        """Answer a GenerateRequest that does not decode (e.g. temperature -1), so its client is not left waiting."""
        logger.warning("rejected a malformed local-socket message: %s", error)
        # Read only the head, [type, request_id, ...]: the rest is what failed to decode.
        unpacker = msgpack.Unpacker(max_str_len=MAX_REQUEST_ID_LEN, max_bin_len=0, max_array_len=0, max_map_len=0)
        unpacker.feed(payload)
        try:
            if unpacker.read_array_header() < 2 or unpacker.unpack() != MessageType.GENERATE_REQUEST:
                return
            request_id = unpacker.unpack()
        except Exception:  # not msgpack, or no sane request id: nothing to answer to
            return
        if isinstance(request_id, str) and request_id:
            self._send(identity, GenerateOutput(request_id, "", [], FinishReason.ERROR, f"bad request: {error}"))

    def _on_generate(self, identity: bytes, msg: GenerateRequest) -> None:
        key = (identity, msg.request_id)
        if key in self._tasks:
            self._send(identity, GenerateOutput(msg.request_id, "", [], FinishReason.ERROR,
                                                f"request id {msg.request_id!r} is already in use"))
            return
        self._tasks[key] = asyncio.create_task(self._run(identity, msg))

    def _on_abort(self, identity: bytes, msg: AbortRequests) -> None:
        for request_id in msg.request_ids:
            task = self._tasks.get((identity, request_id))
            if task is not None:
                task.cancel()  # the stream closes, which aborts in the engine

    async def _run(self, identity: bytes, msg: GenerateRequest) -> None:
        try:
            stream = self.client.generate(msg.prompt, msg.sampling_params, next(self._engine_request_ids),
                                          prompt_token_ids=msg.prompt_token_ids)
            async with stream:
                async for delta in stream:
                    self._send(identity, GenerateOutput(msg.request_id, delta.text, delta.token_ids,
                                                        delta.finish_reason))
        except asyncio.CancelledError:
            self._send(identity, GenerateOutput(msg.request_id, "", [], FinishReason.ABORT))
        except FrontendError as e:
            self._send(identity, GenerateOutput(msg.request_id, "", [], FinishReason.ERROR, str(e)))
        except Exception as e:  # never leave a client waiting for a final output
            logger.exception("local-socket request %s failed", msg.request_id)
            self._send(identity, GenerateOutput(msg.request_id, "", [], FinishReason.ERROR, f"internal error: {e}"))
        finally:
            self._tasks.pop((identity, msg.request_id), None)

    def _send(self, identity: bytes, msg: GenerateOutput) -> None:
        try:
            send_message(self.socket, msg, identity)
        except zmq.ZMQError as e:  # the socket is closing; the client is told nothing more
            logger.debug("could not send to a local client: %s", e)

    async def close(self) -> None:
        tasks = [self._serve_task, *self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.socket.close(linger=100)
