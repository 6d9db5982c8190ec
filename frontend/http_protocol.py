"""uvicorn's httptools protocol, plus the bounds it lacks on reading a request's head.

uvicorn waits forever for a request line and headers, and httptools buffers a header of
any size, so idle or endless heads cost a connection each and memory without limit.
This subclass adds, per connection:

    header size    431  more than `max_header_bytes` arrive before the headers end: a
                        JSON error, then the connection is drained briefly and closed
    header time    --   the headers are not complete `header_timeout_s` after the
                        connection opened (or, on a kept-alive connection, after the
                        first byte of the next request): the connection is closed
    body backstop  --   the body is not complete `body_timeout_s` + BODY_GRACE_S after
                        the headers: closed. Admission answers API requests with a 408
                        first; this catches the routes that never read their body.

Bytes are counted as they arrive, so a connection costs at most the limit plus one
socket read. uvicorn's keep-alive timer still covers idle kept-alive connections.
`raise_open_file_limit` lets the process hold thousands of sockets. Wired in
frontend/api_server.py as `uvicorn.Config(http=guarded_protocol(admission_config))`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from frontend.admission import DRAIN_MAX_BYTES, DRAIN_MAX_S, AdmissionConfig
from frontend.errors import FrontendError, HeadersTooLargeError

logger = logging.getLogger(__name__)

BODY_GRACE_S = 1.0  # lets admission's 408 go out before the backstop closes the connection
OPEN_FILE_LIMIT_CAP = 1 << 20  # when the hard limit is unlimited


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = AdmissionConfig()  # set per server by guarded_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._is_reading_head = True  # from here, and after each request's body, until its headers end
        self._num_head_bytes = 0  # raw bytes of a head not yet ended, counted per read
        self._num_parsed_head_bytes = 0
        self._num_heads_done = 0
        self._is_discarding = False  # after our own error: read and drop until the client leaves
        self._num_discarded_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.limits.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_discarding:
            self._num_discarded_bytes += len(data)
            if self._num_discarded_bytes > DRAIN_MAX_BYTES:
                self.transport.close()
            return
        was_reading_head, num_heads_done = self._is_reading_head, self._num_heads_done
        super().data_received(data)
        if self._is_discarding or self.transport.is_closing() or not self._is_reading_head:
            return
        # Count the read only if it held nothing but head bytes; a read that also ended
        # a body or a head is not counted, so a count is short by at most one read.
        if was_reading_head and num_heads_done == self._num_heads_done:
            self._num_head_bytes += len(data)
            if self._num_head_bytes > self.limits.max_header_bytes:
                return self._reject(self._head_too_large())
        # The next request on a kept-alive connection has begun (uvicorn's keep-alive timer
        # stopped at its first byte). While a response is still going out, a pipelined
        # head waits: the response is not cut for it.
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm(self.limits.header_timeout_s, "headers")

    # Parser callbacks. A head that ended within one read is measured from what the parser
    # hands over (the request line and each header); once rejected, the rest is ignored.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._num_parsed_head_bytes = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._num_parsed_head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._is_discarding:
            return
        super().on_header(name, value)
        self._num_parsed_head_bytes += len(name) + len(value) + 4  # ": " and CRLF

    def on_headers_complete(self) -> None:
        if self._is_discarding:
            return
        if self._num_parsed_head_bytes > self.limits.max_header_bytes:
            return self._reject(self._head_too_large())
        super().on_headers_complete()
        self._is_reading_head = False
        self._num_head_bytes = 0
        self._num_heads_done += 1
        self._disarm()
        is_upgrade = self.parser.should_upgrade() and self._should_upgrade()
        if not is_upgrade and not self.pipeline:  # a queued pipelined request cannot read its body yet
            self._arm(self.limits.body_timeout_s + BODY_GRACE_S, "body")

    def on_body(self, body: bytes) -> None:
        if not self._is_discarding:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._is_discarding:
            return
        super().on_message_complete()
        self._is_reading_head = True
        self._disarm()

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._on_deadline, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self, what: str, seconds: float) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("%s not complete after %.1f s: closing the connection from %s", what, seconds, self.client)
            self.transport.close()

    def _head_too_large(self) -> HeadersTooLargeError:
        return HeadersTooLargeError(
            f"the request line and headers are over the limit of {self.limits.max_header_bytes} bytes")

    def _reject(self, error: FrontendError) -> None:
        """Answer with `error`, then drop what the client still sends, so it reads the answer, not a reset."""
        logger.debug("%s: %s", self.client, error)
        self._is_discarding = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is going out: an answer now would corrupt it
            return
        body = json.dumps(error.to_dict()).encode()
        head = [STATUS_LINE[error.status_code], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n", b"\r\n"]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # a client reading to the end sees it now, not after the drain
        self.flow.resume_reading()
        self._arm(DRAIN_MAX_S, "drain")  # a client that keeps sending is cut off then


def guarded_protocol(limits: AdmissionConfig) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`; uvicorn makes one per connection."""
    return type(GuardedHttpToolsProtocol.__name__, (GuardedHttpToolsProtocol,), {"limits": limits})


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one: each connection is a file, and 1024 is a common default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILE_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft
