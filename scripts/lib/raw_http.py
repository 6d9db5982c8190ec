"""HTTP/1.1 by hand over TCP, for clients that misbehave on purpose (scripts/hostile/ and the
reliability tests): an HTTP library would finish, or refuse to send, what these leave half done.
Every socket has a timeout."""

from __future__ import annotations

import socket
import time


def request_head(path: str, extra: str = "", method: str = "POST", host: str = "127.0.0.1") -> bytes:
    """A request head for a JSON body; `extra` holds more header lines, each ending in CRLF."""
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


def connect(host: str, port: int, data: bytes = b"", timeout_s: float = 10.0) -> socket.socket:
    """A connection with a timeout on every call, after sending `data` (if any)."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    if data:
        conn.sendall(data)
    return conn


def read_until_closed(conn: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection (EOF or reset) within timeout_s."""
    conn.settimeout(timeout_s)
    data = b""
    try:
        while part := conn.recv(65536):
            data += part
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return data, False
    return data, True


def read_status_line(conn: socket.socket) -> str:
    """The status line the server sent, or what happened instead ('closed', 'ConnectionResetError', ...)."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return "closed" if not data else data.decode("latin-1")[:80]
            data += chunk
    except OSError as e:
        return type(e).__name__
    return data.split(b"\r\n", 1)[0].decode("latin-1")


def status_code(status_line: str) -> int | None:
    parts = status_line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].isdigit() else None


def is_answered(conn: socket.socket) -> bool:
    """Whether the server has sent something (an early 429, 408...) or closed, without waiting."""
    try:
        conn.setblocking(False)
        conn.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.setblocking(True)


def exchange(port: int, request: bytes, chunks: list[bytes] = (), timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send a hand-written request (then each chunk, 50 ms apart), read until the server closes
    or the response is complete; (status, body). Stops sending once the server has answered, as
    a client should on 413."""
    with connect("127.0.0.1", port, request, timeout_s) as conn:
        for chunk in chunks:
            try:
                conn.sendall(chunk)
            except OSError:
                break
            time.sleep(0.05)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < _response_length(data):
                part = conn.recv(65536)
                if not part:
                    break
                data += part
        except OSError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return 1 << 62  # no length: read until close
