"""Admission control: the checks an API request passes before any handler sees it.

A pure ASGI middleware, in this order, on the API routes (/v1/*, /generate):

    API key        401  `Authorization: Bearer KEY`, compared in constant time
    draining       503  the server got SIGTERM and takes no new requests
    concurrency    429  --max-concurrent-requests are already being served (Retry-After: 1)
    body size      413  --max-request-bytes: Content-Length is checked before reading, and a
                        streamed (chunked) body is read only up to the limit

A request counts against the concurrency limit from admission until its response is
sent in full, streaming included. The body is buffered here (the handlers read it
whole anyway) and replayed to the app; later `receive` calls pass through, so
disconnect detection still works. /health, /metrics and /openapi.json skip the
key and the limits, but not the Content-Length check.
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass

from frontend.errors import (
    AuthenticationError, FrontendError, RequestTooLargeError, ServerBusyError, ShuttingDownError,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, far beyond any context length here
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024


@dataclass
class AdmissionConfig:
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS


class Admission:
    """The limits plus the live counts the middleware keeps; the server flips `is_draining`."""

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.num_active = 0  # API requests admitted and not yet answered in full
        self.is_draining = False
        self._expected_key = f"Bearer {config.api_key}".encode() if config.api_key else None

    def check_key(self, headers: dict[bytes, bytes]) -> None:
        if self._expected_key is None:
            return
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected_key):
            raise AuthenticationError("invalid or missing API key: send 'Authorization: Bearer <key>'")

    def check_capacity(self) -> None:
        if self.is_draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
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
    return path.startswith("/v1/") or path == "/generate"


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
                admission.check_capacity()
            admission.check_content_length(headers)
        except FrontendError as e:
            return await send_error(send, e)
        if not is_api:
            return await self.app(scope, receive, send)
        admission.num_active += 1
        try:
            try:
                body = await self._read_body(receive)
            except RequestTooLargeError as e:
                return await send_error(send, e)
            if body is None:
                return  # the client went away while sending
            await self.app(scope, _replay(body, receive), send)
        finally:
            admission.num_active -= 1

    async def _read_body(self, receive) -> bytes | None:
        limit = self.admission.config.max_request_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self.admission._too_large(f"over {size} bytes so far, streamed")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    is_replayed = False

    async def replay_receive():
        nonlocal is_replayed
        if not is_replayed:
            is_replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def send_error(send, error: FrontendError) -> None:
    body = json.dumps(error.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
