"""The local socket: GenerateRequest in, GenerateOutput text deltas out, over ZeroMQ without HTTP.

    client DEALER --[GenerateRequest | AbortRequests]--> ROUTER frontend (--client-socket ADDR)
    client DEALER <--[GenerateOutput ...]--------------- ROUTER frontend

Each GenerateRequest runs as one task reading an `AsyncEngineClient` stream; the
last GenerateOutput of a request has a finish_reason (ABORT after an abort, ERROR
with `error` set when it failed). Every request gets exactly one final output,
whatever the timing: an abort that cancels the task before it ever ran is answered
by the task's done callback. Request ids belong to the client, so they are scoped by
the client's ZeroMQ identity; a GenerateRequest whose id is still running there is
ignored (answering it would give that id a second final). Frames larger than a
request can need are refused by ZeroMQ before they are buffered. Framing and
layouts: docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import msgpack
import zmq

from frontend.background_tasks import cancel_and_wait
from frontend.engine_client import AsyncEngineClient
from frontend.errors import FrontendError
from frontend.request_state import relay
from ipc.codec import MAX_REQUEST_ID_LEN, DecodeError
from ipc.sampling_params import MAX_STOP_SEQUENCES, MAX_STOP_STRING_LEN
from ipc.messages import AbortRequests, FinishReason, GenerateOutput, GenerateRequest, MessageType
from ipc.sockets import bind_router, send_message, serve_messages

logger = logging.getLogger(__name__)

# Beyond the prompt text and its token ids: request id, stop strings, the other fields.
FRAME_OVERHEAD_BYTES = MAX_REQUEST_ID_LEN + MAX_STOP_SEQUENCES * MAX_STOP_STRING_LEN * 4 + 64 * 1024
MSGPACK_INT_BYTES = 9  # the most one token id can take


def max_frame_bytes(max_prompt_bytes: int, max_model_len: int) -> int:
    """The largest GenerateRequest that could be valid: a prompt at the size cap, or its ids."""
    return max(max_prompt_bytes, max_model_len * MSGPACK_INT_BYTES) + FRAME_OVERHEAD_BYTES


class _LocalRequest:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.task: asyncio.Task | None = None
        self.is_final_sent = False


class LocalSocketServer:
    """Serves GenerateRequests from local clients on a ROUTER socket."""

    def __init__(self, client: AsyncEngineClient, address: str, allow_remote: bool = False):
        self.client = client
        max_bytes = max_frame_bytes(client.prompt_tokenizer.max_prompt_bytes, client.max_model_len)
        self.socket = bind_router(client.ctx, address, allow_remote=allow_remote, max_bytes=max_bytes)
        self._requests: dict[tuple[bytes, str], _LocalRequest] = {}  # (client identity, its request id)
        self._engine_request_ids = (f"local-{i}" for i in itertools.count())  # short: ids on the wire are bounded
        self._handlers = {GenerateRequest: self._on_generate, AbortRequests: self._on_abort}
        self._serve_task = asyncio.create_task(self._serve(), name="local-socket")
        logger.info("serving GenerateRequest on %s", address)

    async def _serve(self) -> None:
        await serve_messages(self.socket, self._handlers, self._reject)

    def _reject(self, identity: bytes | None, payload: bytes | None, error: DecodeError) -> None:
        """Answer a GenerateRequest that does not decode (e.g. a string temperature), so its client is not left waiting."""
        logger.warning("rejected a malformed local-socket message: %s", error)
        if identity is None or payload is None:
            return  # the wrong number of frames: nobody to answer
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
        if key in self._requests:
            logger.warning("ignored a local-socket request: its id %r is still running", msg.request_id)
            return
        request = self._requests[key] = _LocalRequest(msg.request_id)
        request.task = asyncio.create_task(self._run(identity, msg, request))
        request.task.add_done_callback(lambda task: self._on_done(identity, request))

    def _on_abort(self, identity: bytes, msg: AbortRequests) -> None:
        for request_id in msg.request_ids:
            request = self._requests.get((identity, request_id))
            if request is not None:
                request.task.cancel()  # the stream closes, which aborts in the engine

    async def _run(self, identity: bytes, msg: GenerateRequest, request: _LocalRequest) -> None:
        try:
            stream = await self.client.generate(msg.prompt, msg.sampling_params, next(self._engine_request_ids),
                                                prompt_token_ids=msg.prompt_token_ids)

            def on_delta(delta, finish_reason: str | None) -> tuple:
                self._send_output(identity, request, delta.text, delta.token_ids, delta.finish_reason)
                return ()

            async for _ in relay(stream, on_delta):
                pass
        except FrontendError as e:
            self._send_output(identity, request, "", [], FinishReason.ERROR, str(e))
        except Exception:  # never leave a client waiting for a final output
            logger.exception("local-socket request %s failed", msg.request_id)
            self._send_output(identity, request, "", [], FinishReason.ERROR, "internal error; see the server log")

    def _on_done(self, identity: bytes, request: _LocalRequest) -> None:
        # Runs however the task ended, even when an abort cancelled it before it started.
        self._requests.pop((identity, request.request_id), None)
        if not request.is_final_sent:
            self._send_output(identity, request, "", [], FinishReason.ABORT)

    def _send_output(self, identity: bytes, request: _LocalRequest, text: str, token_ids: list[int],
                     finish_reason: FinishReason | None, error: str | None = None) -> None:
        if request.is_final_sent:
            return
        request.is_final_sent = finish_reason is not None
        self._send(identity, GenerateOutput(request.request_id, text, token_ids, finish_reason, error))

    def _send(self, identity: bytes, msg: GenerateOutput) -> None:
        try:
            send_message(self.socket, msg, identity)
        except zmq.ZMQError as e:  # the socket is closing; the client is told nothing more
            logger.debug("could not send to a local client: %s", e)

    async def close(self) -> None:
        await cancel_and_wait([self._serve_task, *(request.task for request in self._requests.values())])
        self.socket.close(linger=100)
