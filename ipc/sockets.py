"""ZeroMQ helpers for the frontend <-> engine-core link.

Topology: the engine core binds one ROUTER; each frontend connects a DEALER,
sends `Hello` first, and the core answers to that DEALER's identity.

    frontend DEALER --[payload]--> ROUTER engine core   (core sees [identity, payload])
    frontend DEALER <--[payload]-- ROUTER engine core   (core sends [identity, payload])

Anyone who can reach the socket can drive the engine, so binds default to
private places: ipc:// paths in a 0o700 per-process directory, or tcp:// on
loopback only unless the caller opts in with allow_remote.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from ipc.codec import MAX_MESSAGE_BYTES, DecodeError, decode, encode

logger = logging.getLogger(__name__)

# sun_path is 108 bytes on Linux (104 on macOS); zmq's own error for a long path is cryptic.
MAX_IPC_PATH_LEN = 100

_private_dir: str | None = None
_private_dir_lock = threading.Lock()


def _get_private_dir() -> str:
    global _private_dir
    with _private_dir_lock:
        if _private_dir is None:
            _private_dir = tempfile.mkdtemp(prefix="tokenloom-")  # mkdtemp creates it 0o700
            atexit.register(_remove_private_dir, _private_dir, os.getpid())
        return _private_dir


def _remove_private_dir(path: str, owner_pid: int) -> None:
    # A forked child inherits this atexit hook; only the creator may remove the dir.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def new_ipc_address(name: str) -> str:
    """A fresh `ipc://<private dir>/<name>-<random>` address; the dir is shared by this process."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", name):
        raise ValueError(f"ipc socket name must be 1-32 characters of [A-Za-z0-9_.-], got {name!r}")
    path = os.path.join(_get_private_dir(), f"{name}-{secrets.token_hex(4)}")
    if len(path.encode()) > MAX_IPC_PATH_LEN:
        raise ValueError(f"ipc socket path {path!r} is too long for a unix socket; set TMPDIR to a shorter dir")
    return f"ipc://{path}"


def parse_address(address: str) -> tuple[str, str, int | None]:
    """Split `ipc://path` into ("ipc", path, None) and `tcp://host:port` into ("tcp", host, port).

    A tcp port of `*` (zmq's "any free port") gives None; IPv6 hosts come without brackets.
    """
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        raise ValueError(f"address must look like scheme://..., got {address!r}")
    if scheme == "ipc":
        return scheme, rest, None
    if scheme != "tcp":
        raise ValueError(f"unsupported address scheme {scheme!r} in {address!r}; use ipc:// or tcp://")
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"tcp address needs host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if port_text == "*":
        return scheme, host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad tcp port {port_text!r} in {address!r}")
    return scheme, host, int(port_text)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # `*`, interface names and other host names: not provably loopback
        return False


def check_bind_address(address: str, allow_remote: bool = False) -> None:
    """Raise ValueError unless `address` is ipc:// or loopback tcp:// (any tcp with allow_remote)."""
    scheme, host, _ = parse_address(address)
    if scheme == "tcp" and not allow_remote and not is_loopback_host(host):
        raise ValueError(
            f"refusing to bind {address}: it is reachable from other machines and the engine has no "
            "authentication; bind to 127.0.0.1 or an ipc:// path, or pass allow_remote=True"
        )


def check_bindable(address: str, allow_remote: bool = False) -> None:
    """bind_router's checks, without binding: a remote tcp:// host, or an ipc:// path a live process
    listens on, raises ValueError (a stale socket file is removed). A server runs it before starting
    its cores, so a taken --client-socket fails at once, not after a model load."""
    check_bind_address(address, allow_remote)
    scheme, path, _ = parse_address(address)
    if scheme == "ipc" and "*" not in path:
        _claim_ipc_path(path)


def _configure(sock: zmq.Socket, max_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # never hang at exit on a peer that is gone
    # Unbounded queues: dropping a token delta or an abort would corrupt a request silently.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # zmq drops the connection of a peer that sends an oversized frame, before it is buffered.
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def bind_router(
    ctx: zmq.Context, address: str, allow_remote: bool = False, max_bytes: int = MAX_MESSAGE_BYTES
) -> zmq.Socket:
    """The engine core's socket: a ROUTER bound at `address`."""
    check_bindable(address, allow_remote)
    sock = ctx.socket(zmq.ROUTER)
    try:
        _configure(sock, max_bytes)
        # Off: a reply to a frontend that has vanished is dropped instead of raising in the core loop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(address)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves `*` paths and ports
        scheme, path, _ = parse_address(endpoint)
        if scheme == "ipc":
            # The 0o700 dir is the real guard (there is a moment before this chmod); this covers
            # caller-chosen paths outside it.
            os.chmod(path, 0o600)
    except BaseException:
        sock.close()
        raise
    logger.debug("ROUTER bound at %s", endpoint)
    return sock


def _claim_ipc_path(path: str) -> None:
    """Refuse a unix socket path that a live process listens on; remove a stale one.

    zmq's bind would silently unlink a live server's socket file and take its clients.
    """
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return  # not a socket: zmq's bind decides, as before
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        logger.info("removing the stale socket file %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    except OSError as e:  # not a socket, or not ours to probe: leave it to zmq's bind
        logger.debug("could not probe %s: %s", path, e)
        return
    finally:
        probe.close()
    raise ValueError(f"ipc://{path} is in use by a running process; stop it or choose another path")


def connect_dealer(ctx: zmq.Context, address: str, max_bytes: int = MAX_MESSAGE_BYTES) -> zmq.Socket:
    """A frontend's socket: a DEALER connected to the engine core's ROUTER. Send Hello first."""
    sock = ctx.socket(zmq.DEALER)
    try:
        _configure(sock, max_bytes)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    logger.debug("DEALER connected to %s", address)
    return sock


def send_message(sock: zmq.Socket, msg: Any, identity: bytes | None = None, flags: int = 0) -> None:
    """Encode and send; pass the peer's identity when `sock` is a ROUTER."""
    payload = encode(msg)
    if identity is None:
        sock.send(payload, flags)
    else:
        sock.send_multipart([identity, payload], flags)


def recv_message(sock: zmq.Socket, flags: int = 0, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Receive one record on a DEALER. zmq.NOBLOCK raises zmq.Again when nothing is queued."""
    return unpack_frames(sock.recv_multipart(flags), is_routed=False, max_bytes=max_bytes)[1]


def recv_routed_message(sock: zmq.Socket, flags: int = 0, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[bytes, Any]:
    """Receive one (identity, record) on a ROUTER; answer with send_message(sock, reply, identity)."""
    return unpack_frames(sock.recv_multipart(flags), is_routed=True, max_bytes=max_bytes)


def unpack_frames(frames: list[bytes], is_routed: bool,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[bytes | None, Any]:
    """(identity or None, record) from one multipart message: [payload] on a DEALER,
    [identity, payload] on a ROUTER; anything else is a DecodeError. The whole multipart
    message has been consumed either way, so the next receive starts clean."""
    num_frames = 2 if is_routed else 1
    if len(frames) != num_frames:
        raise DecodeError(f"expected {num_frames} frame{'s' if is_routed else ''}, got {len(frames)}")
    identity = frames[0] if is_routed else None
    return identity, decode(frames[-1], max_bytes)


# ---------------------------------------------------------------- receive, decode, dispatch
# Every loop that reads a socket does the same: check the frame count, decode, pick the
# handler by the record's type (a `{type: handler}` table), and drop what is malformed or
# unexpected with a log line. A ROUTER's handlers get (identity, record), a DEALER's (record).

Handlers = dict[type, Callable[..., None]]
# (identity or None, the raw payload or None, the error): reply to a sender, or just log.
OnMalformed = Callable[[Optional[bytes], Optional[bytes], DecodeError], None]


def drain_messages(sock: zmq.Socket, handlers: Handlers, on_malformed: OnMalformed | None = None,
                   max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Dispatch every message already queued on `sock`, without blocking; return how many.

    For the engine core's busy loop: a handler's exception propagates (outside a model call
    it is a bug, and the core reports it and exits)."""
    is_routed = sock.socket_type == zmq.ROUTER
    num_messages = 0
    while True:
        # Nothing queued, as at almost every step: return without the raised zmq.Again (half the cost).
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return num_messages
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return num_messages
        num_messages += 1
        _dispatch(frames, is_routed, handlers, on_malformed, max_bytes)


async def serve_messages(sock: zmq.asyncio.Socket, handlers: Handlers, on_malformed: OnMalformed | None = None,
                         on_receive: Callable[[], None] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Receive and dispatch messages until cancelled. `on_receive` runs for every message,
    even a malformed one (a sign of life). A handler's exception is logged, never ends the
    loop: every request waiting on this socket would hang."""
    is_routed = sock.socket_type == zmq.ROUTER
    while True:
        frames = await sock.recv_multipart()
        if on_receive is not None:
            on_receive()
        try:
            _dispatch(frames, is_routed, handlers, on_malformed, max_bytes)
        except Exception:
            logger.exception("handling a message failed")


def _dispatch(frames: list[bytes], is_routed: bool, handlers: Handlers, on_malformed: OnMalformed | None,
              max_bytes: int) -> None:
    try:
        identity, message = unpack_frames(frames, is_routed, max_bytes)
    except DecodeError as e:
        identity = frames[0] if is_routed and len(frames) == 2 else None
        payload = frames[-1] if len(frames) == (2 if is_routed else 1) else None
        if on_malformed is None:
            logger.warning("dropped a malformed message: %s", e)
        else:
            on_malformed(identity, payload, e)
        return
    handler = handlers.get(type(message))
    if handler is None:
        logger.warning("dropped an unexpected %s on this socket", type(message).__name__)
    elif is_routed:
        handler(identity, message)
    else:
        handler(message)
