"""Length-prefixed msgpack frames over a byte pipe: the frontend's grammar checker and its child.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack value. The
frontend (asyncio) and the child (`engine.structured_output.checker`, blocking stdin and
stdout) both read and write them through this file, so the two ends cannot drift.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, BinaryIO

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20  # above any grammar the frontend sends (ipc.structured_outputs.MAX_GRAMMAR_BYTES)


def pack_frame(obj: Any) -> bytes:
    data = msgpack.packb(obj)
    return HEADER.pack(len(data)) + data


def frame_size(header: bytes) -> int:
    """The length a header announces; ValueError past MAX_FRAME_BYTES, before anything is read."""
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is over the limit")
    return size


def read_frame(stream: BinaryIO) -> Any:
    """The next frame's value from a blocking stream; None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return msgpack.unpackb(stream.read(frame_size(header)))


async def read_frame_async(reader: asyncio.StreamReader) -> Any:
    """The next frame's value; asyncio.IncompleteReadError when the pipe closes first."""
    size = frame_size(await reader.readexactly(HEADER.size))
    return msgpack.unpackb(await reader.readexactly(size))
