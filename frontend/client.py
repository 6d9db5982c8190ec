"""TokenloomClient: stream text from a tokenloom server, over HTTP or its local ZeroMQ socket.

    client = TokenloomClient("http://127.0.0.1:8000")
    async for chunk in client.generate("Once upon a time", max_tokens=32):
        print(chunk.text, end="", flush=True)
    completion = await client.complete("Once upon a time", max_tokens=32, temperature=0)

    # Same calls, no HTTP: msgpack over ZeroMQ to a server started with --client-socket ADDR.
    client = TokenloomClient.local("ipc:///tmp/tokenloom.sock")

Keyword arguments are SamplingParams fields (max_tokens, temperature, top_p, top_k,
seed, stop, ...). Leaving a `generate` loop early closes the stream, which aborts
the request on the server. Only aiohttp, pyzmq and `ipc` are needed (no torch).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import zmq
import zmq.asyncio

from ipc.messages import AbortRequests, GenerateOutput, GenerateRequest
from ipc.sampling_params import SamplingParams
from ipc.sockets import connect_dealer, send_message, serve_messages


class TokenloomError(RuntimeError):
    """The server rejected or failed the request (`status` is the HTTP status, when there is one)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    token_ids: list[int] = field(default_factory=list)  # the local socket sends them; HTTP does not
    num_output_tokens: int | None = None  # cumulative; set on the last chunk at least


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    num_output_tokens: int | None


class TokenloomClient:
    """One client, two transports: HTTP (`/v1/completions`, streamed) or the local socket."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout_s: float = 600.0):
        self._transport: HttpTransport | LocalTransport = HttpTransport(base_url, api_key, model, timeout_s)

    @classmethod
    def local(cls, address: str) -> TokenloomClient:
        client = cls.__new__(cls)
        client._transport = LocalTransport(address)
        return client

    def generate(self, prompt: str | list[int], **sampling) -> AsyncIterator[Chunk]:
        """Stream text chunks; a prompt may be text or token ids."""
        return self._transport.generate(prompt, sampling)

    async def complete(self, prompt: str | list[int], **sampling) -> Completion:
        parts, last = [], Chunk("")
        async for chunk in self.generate(prompt, **sampling):
            parts.append(chunk.text)
            last = chunk
        return Completion("".join(parts), last.finish_reason, last.num_output_tokens)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> TokenloomClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class HttpTransport:
    def __init__(self, base_url: str, api_key: str | None, model: str | None, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def generate(self, prompt: str | list[int], sampling: dict) -> AsyncIterator[Chunk]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **sampling}
        if self.model:
            body["model"] = self.model
        async with self._session.post(f"{self.base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise TokenloomError(_error_message(await response.text()), response.status)
            final = None  # the finishing chunk waits for the usage chunk that follows it
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise TokenloomError(event["error"].get("message", "unknown error"))
                for choice in event.get("choices", ()):
                    chunk = Chunk(choice["text"], choice.get("finish_reason"))
                    if chunk.finish_reason is None:
                        yield chunk
                    else:
                        final = chunk
                if event.get("usage") and final is not None:
                    final.num_output_tokens = event["usage"]["completion_tokens"]
            if final is not None:
                yield final

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class LocalTransport:
    """A DEALER to the frontend's --client-socket ROUTER; one receiver task routes outputs by request id."""

    def __init__(self, address: str):
        self.ctx = zmq.asyncio.Context()
        self.socket = connect_dealer(self.ctx, address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._request_ids = (f"{os.getpid()}-{i}" for i in itertools.count())
        self._receiver: asyncio.Task | None = None

    async def generate(self, prompt: str | list[int], sampling: dict) -> AsyncIterator[Chunk]:
        try:
            params = SamplingParams(**sampling)
            params.validate()  # the server would answer the same, one round trip later
        except (TypeError, ValueError) as e:
            raise TokenloomError(f"bad sampling argument: {e}") from None
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive())
        request_id = next(self._request_ids)
        queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        is_text = isinstance(prompt, str)
        send_message(self.socket, GenerateRequest(request_id, prompt if is_text else None,
                                                  None if is_text else list(prompt), params))
        is_finished, num_output_tokens = False, 0
        try:
            while not is_finished:
                output = await queue.get()
                is_finished = output.finish_reason is not None
                if output.error is not None:
                    raise TokenloomError(output.error)
                num_output_tokens += len(output.token_ids)
                finish_reason = output.finish_reason.openai_name if is_finished else None
                yield Chunk(output.text, finish_reason, output.token_ids, num_output_tokens)
        finally:
            self._queues.pop(request_id, None)
            if not is_finished:  # the caller stopped reading: free the server's slot
                send_message(self.socket, AbortRequests([request_id]))

    async def _receive(self) -> None:
        await serve_messages(self.socket, {GenerateOutput: self._on_output})

    def _on_output(self, output: GenerateOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self.socket.close(linger=100)
        self.ctx.term()


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
