"""Cases that misbehave below HTTP: slowloris connections, oversized headers, oversized bodies.

They talk raw TCP, because an HTTP library would finish (or refuse to send) exactly what
these cases leave half done. Every socket has a timeout and is closed before the case returns.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import requests

from scripts.hostile.client import Target
from scripts.lib.raw_http import connect, is_answered, read_status_line, request_head, status_code

CHUNK = 64 * 1024
BODY = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()


def _connect(target: Target, timeout_s: float = 10.0) -> socket.socket:
    parsed = urlparse(target.url)
    return connect(parsed.hostname, parsed.port or 80, timeout_s=timeout_s)


def oversized_bodies(target: Target, sizes_mib: tuple[int, ...] = (4, 16)) -> dict:
    """A client that sends its whole too-large body, then reads, must still see the 413 (not a reset)."""
    seen = {}
    for size_mib in sizes_mib:
        for framing in ("content-length", "chunked"):
            size = size_mib << 20
            with _connect(target) as sock:
                framing_header = f"Content-Length: {size}\r\n" if framing == "content-length" \
                    else "Transfer-Encoding: chunked\r\n"
                send_error = None
                try:
                    sock.sendall(request_head("/v1/completions", framing_header))
                    for offset in range(0, size, CHUNK):
                        piece = b"x" * min(CHUNK, size - offset)
                        sock.sendall(piece if framing == "content-length" else b"%x\r\n%s\r\n" % (len(piece), piece))
                    if framing == "chunked":
                        sock.sendall(b"0\r\n\r\n")
                except OSError as e:
                    send_error = type(e).__name__
                status_line = read_status_line(sock)
            seen[f"{size_mib}MiB_{framing}"] = {"status": status_code(status_line), "read": status_line,
                                                "send_error": send_error}
        seen[f"{size_mib}MiB_requests_library"] = _post_with_requests(target, size)
    return {"passed": all(v["status"] == 413 for v in seen.values()), "answers": seen}


def _post_with_requests(target: Target, size: int) -> dict:
    """What an everyday client sees: requests sends the whole body before it reads the answer."""
    try:
        response = requests.post(target.url + "/v1/completions", data=b"x" * size, timeout=30,
                                 headers={"Content-Type": "application/json"})
        return {"status": response.status_code, "read": response.text[:120], "send_error": None}
    except requests.RequestException as e:
        return {"status": None, "read": None, "send_error": f"{type(e).__name__}: {str(e)[:160]}"}


def big_header(target: Target) -> dict:
    """A 1 MiB header line, and 4,000 headers, must be refused (4xx or a closed connection), not served."""
    seen = {}
    for name, extra in (("one_1MiB_header", f"X-Junk: {'a' * (1 << 20)}\r\n"),
                        ("4000_headers", "".join(f"X-Junk-{i}: {'b' * 64}\r\n" for i in range(4000)))):
        with _connect(target) as sock:
            try:
                sock.sendall(request_head("/v1/models", extra, method="GET"))
                status_line = read_status_line(sock)
            except OSError as e:
                status_line = type(e).__name__
        status = status_code(status_line)
        seen[name] = {"status": status, "read": status_line, "refused": status is None or 400 <= status < 500}
    return {"passed": all(v["refused"] for v in seen.values()), "answers": seen}


def slowloris(target: Target, num_partial_headers: int, num_half_bodies: int, budget_s: float = 2.0) -> dict:
    """Hold connections with unfinished headers and unfinished bodies; a normal request must still be served."""
    socks: list[socket.socket] = []
    num_refused = 0
    try:
        for i in range(num_partial_headers + num_half_bodies):
            try:
                sock = _connect(target, timeout_s=5)
                if i < num_partial_headers:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                else:  # full headers, 10 of 1,000 promised body bytes
                    sock.sendall(request_head("/v1/completions", "Content-Length: 1000\r\n") + b'{"prompt":')
                socks.append(sock)
            except OSError:
                num_refused += 1
        time.sleep(0.5)  # let the server admit the half bodies
        start = time.monotonic()
        status, text, _ = target.post("/v1/completions", BODY, timeout=max(budget_s, 10.0))
        elapsed_s = time.monotonic() - start
        num_answered = sum(1 for s in socks if is_answered(s))
    finally:
        for sock in socks:
            sock.close()
    return {
        "passed": status == 200 and elapsed_s < budget_s,
        "num_partial_headers": num_partial_headers,
        "num_half_bodies": num_half_bodies,
        "num_connections_refused": num_refused,
        "num_answered_or_closed_by_server": num_answered,  # by the time the normal request was answered
        "normal_request": {"status": status, "seconds": round(elapsed_s, 2), "body": text[:200]},
    }
