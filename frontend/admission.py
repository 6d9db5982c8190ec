"""Admission control: the checks an API request passes before any handler sees it.

A pure ASGI middleware, in this order, on the API routes (/v1/*, /generate, /tokenize, /detokenize):

    API key        401  `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header),
                        compared in constant time
    draining       503  the server got SIGTERM and takes no new requests
    body size      413  --max-request-bytes: Content-Length is checked before reading, and a
                        streamed (chunked) body is read only up to the limit
    body time      408  the whole body must arrive within --body-timeout seconds of the
                        headers; then the connection is closed
    concurrency    429  --max-concurrent-requests are already being served (Retry-After: 1)

A request takes a concurrency slot only once it has arrived whole (headers and body),
and holds it until its response is sent in full, streaming included: a client that
sends half a body and goes idle holds a connection and a task until --body-timeout,
never a slot. The body is buffered here (the handlers read it whole anyway) and
replayed to the app; later `receive` calls pass through, so disconnect detection
still works. A 413 is sent first, then up to DRAIN_MAX_BYTES / DRAIN_MAX_S of the body
is read and dropped before the connection closes: closing on unread bytes makes the
kernel send a reset, and most clients (still sending) then never see the 413.
/health, /metrics and /openapi.json skip the key and the limits, but not the
Content-Length check. Headers (size and time) are bounded earlier, in
frontend/http_protocol.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass

from frontend.errors import (
    AuthenticationError, FrontendError, RequestTimeoutError, RequestTooLargeError, ServerBusyError,
    ShuttingDownError, error_body,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, far beyond any context length here
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0  # request line + headers; a real client sends them in one packet
DEFAULT_BODY_TIMEOUT_S = 30.0  # 1 MiB in 30 s is ~35 KB/s, below any link a client should use
DEFAULT_MAX_HEADER_BYTES = 64 << 10  # nginx allows 32 KiB by default; bearer tokens and cookies fit
# After a 413, how much of the body is read and dropped before closing (whichever ends first).
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_S = 3.0


@dataclass
class AdmissionConfig:
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # enforced by frontend/http_protocol.py
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # enforced by frontend/http_protocol.py


class Admission:
    """The limits plus the live counts the middleware keeps; the server flips `is_draining`."""

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.num_active = 0  # API requests admitted and not yet answered in full
        self.is_draining = False
        self._expected_key = config.api_key.encode() if config.api_key else None

    def check_key(self, headers: dict[bytes, bytes]) -> None:
        if self._expected_key is None:
            return
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + self._expected_key)
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), self._expected_key)
        if not (bearer or x_api_key):
            raise AuthenticationError("invalid or missing API key: send 'Authorization: Bearer <key>' "
                                      "or 'x-api-key: <key>'")

    def check_open(self) -> None:
        if self.is_draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")

    def check_capacity(self) -> None:
        self.check_open()  # again: the drain may have started while the body was read
        if self.num_active >= self.config.max_concurrent_requests:
            raise ServerBusyError(f"the server is already serving its limit of {self.config.max_concurrent_requests} "
                                  "concurrent requests; retry later")

    def check_content_length(self, headers: dict[bytes, bytes]) -> None:
        value = headers.get(b"content-length")
        if value is not None and value.isdigit() and int(value) > self.config.max_request_bytes:
            raise self._too_large(f"{int(value)} bytes")

    def _too_large(self, size: str) -> RequestTooLargeError:
        return RequestTooLargeError(f"the request body ({size}) is over the limit of "
                                    f"{self.config.max_request_bytes} bytes")


def is_api_path(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/generate", "/tokenize", "/detokenize")


class AdmissionMiddleware:
    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        admission = self.admission
        headers = dict(scope["headers"])
        is_api = is_api_path(scope["path"])
        try:
            if is_api:
                admission.check_key(headers)
                admission.check_open()
            admission.check_content_length(headers)
        except RequestTooLargeError as e:
            return await send_error_and_drain(send, receive, e, scope["path"])
        except FrontendError as e:
            return await send_error(send, e, path=scope["path"])
        if not is_api:
            return await self.app(scope, receive, send)
        try:
            body = await self._read_body(receive)
            if body is None:
                return  # the client went away while sending
            admission.check_capacity()
        except RequestTooLargeError as e:
            return await send_error_and_drain(send, receive, e, scope["path"])
        except FrontendError as e:
            return await send_error(send, e, path=scope["path"])
        admission.num_active += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            admission.num_active -= 1

    async def _read_body(self, receive) -> bytes | None:
        config = self.admission.config
        chunks, size = [], 0
        try:
            async with asyncio.timeout(config.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > config.max_request_bytes:
                        raise self.admission._too_large(f"over {size} bytes so far, streamed")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            logger.debug("request body not in after %.1f s (%d bytes so far)", config.body_timeout_s, size)
            raise RequestTimeoutError(f"the request body did not arrive within {config.body_timeout_s:g} seconds "
                                      f"({size} bytes so far)") from None


def _replay(body: bytes, receive):
    is_replayed = False

    async def replay_receive():
        nonlocal is_replayed
        if not is_replayed:
            is_replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def send_error(send, error: FrontendError, is_last: bool = True, path: str = "") -> None:
    body = json.dumps(error_body(error, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": not is_last})


async def send_error_and_drain(send, receive, error: FrontendError, path: str = "") -> None:
    """Send the whole answer, read and drop what the client still sends (bounded), then close.

    The answer's bytes are all out (Content-Length) while uvicorn still counts the
    response as open, so the connection stays up for the drain; the final empty
    chunk completes it, and `connection: close` makes uvicorn close on it.
    """
    await send_error(send, error, is_last=False, path=path)
    num_bytes = 0
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            while num_bytes < DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    break
                num_bytes += len(message.get("body", b""))
    except TimeoutError:
        pass
    logger.debug("drained %d bytes after a %d", num_bytes, error.status_code)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
