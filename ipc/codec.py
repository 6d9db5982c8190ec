"""The one wire codec: msgpack arrays, positional fields, no pickle.

A message is `[int(MessageType), field1, field2, ...]` in declaration order: the
records in `ipc.messages` are msgspec Structs with `array_like=True` and their
MessageType as an int tag, so they are the schema and msgspec encodes and checks
them in C. Nested records (SamplingParams, TokenLogprobs, RequestOutput,
SchedulerStats) are plain positional arrays without a tag; enums travel as ints;
None is nil. There are no maps anywhere, so field names never cross the wire.

Decoding trusts nothing: the size is bounded before unpacking; every field is
type- and bounds-checked against its annotation (token ids, string and list
lengths); a record with more fields than this side knows is refused; every
problem surfaces as `DecodeError`, naming the field. Fields are append-only: an
older peer may send fewer trailing fields (defaults fill in). Sampling values'
ranges and the model's limits are not the codec's: `ipc.sampling_params.check_request`
runs them where a request is handled, so a bad one fails that request by its id.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Union

import msgspec

from ipc.messages import (
    MAX_ABORT_REQUEST_IDS,
    MAX_DTYPE_NAME_LEN,
    MAX_OUTPUTS_PER_STEP,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID_LEN,
    AbortRequests,
    AddRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    GenerateOutput,
    GenerateRequest,
    Hello,
    MessageType,
    ResetPrefixCache,
    Shutdown,
    WatchSteps,
)

__all__ = ["MAX_MESSAGE_BYTES", "MAX_REQUEST_ID_LEN", "MAX_PROMPT_TOKENS", "MAX_ABORT_REQUEST_IDS",
           "MAX_DTYPE_NAME_LEN", "MAX_OUTPUTS_PER_STEP", "MESSAGE_CLASSES", "DecodeError", "decode", "encode"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

MESSAGE_CLASSES: dict[MessageType, type] = {
    MessageType.ADD_REQUEST: AddRequest,
    MessageType.ABORT_REQUESTS: AbortRequests,
    MessageType.SHUTDOWN: Shutdown,
    MessageType.HELLO: Hello,
    MessageType.RESET_PREFIX_CACHE: ResetPrefixCache,
    MessageType.WATCH_STEPS: WatchSteps,
    MessageType.ENGINE_READY: EngineReady,
    MessageType.ENGINE_OUTPUTS: EngineOutputs,
    MessageType.ENGINE_ERROR: EngineError,
    MessageType.GENERATE_REQUEST: GenerateRequest,
    MessageType.GENERATE_OUTPUT: GenerateOutput,
}
assert set(MESSAGE_CLASSES) == set(MessageType), "every MessageType needs a record"
assert all(cls.__struct_config__.tag == int(t) for t, cls in MESSAGE_CLASSES.items())

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[tuple(MESSAGE_CLASSES.values())])
_PATH = re.compile(r" - at `\$((?:\[\d+\])*)`$")


class DecodeError(ValueError):
    """The bytes are not a valid message. The only exception `decode` raises for bad input.
    `request_id`: an AddRequest's id when that much of it reads, so its sender can fail that
    request alone instead of leaving its client waiting."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(msg: Any) -> bytes:
    """Pack a message record as `[int(MessageType), *fields]`."""
    if type(msg) not in _MESSAGE_TYPES:
        raise TypeError(f"cannot encode {type(msg).__name__}: not a message type")
    return _encoder.encode(msg)


_MESSAGE_TYPES = frozenset(MESSAGE_CLASSES.values())


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Unpack and check one message; raise DecodeError for anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise DecodeError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise DecodeError(_describe(data, str(e)), _add_request_id(data)) from None
    except Exception as e:  # msgspec.DecodeError and anything odd: never a crash for the caller
        raise DecodeError(f"not a valid msgpack message: {type(e).__name__}: {e}") from None


def _add_request_id(data: bytes | bytearray | memoryview) -> str | None:
    """The request id of an AddRequest that failed validation, if it is itself valid; only runs on a bad message."""
    try:
        fields = msgspec.msgpack.decode(data)
    except Exception:
        return None
    if (isinstance(fields, list) and len(fields) > 1 and fields[0] == int(MessageType.ADD_REQUEST)
            and isinstance(fields[1], str) and 0 < len(fields[1]) <= MAX_REQUEST_ID_LEN):
        return fields[1]
    return None


def _describe(data: bytes | bytearray | memoryview, error: str) -> str:
    """msgspec's error with its index path (`$[2][0]`) spelled in field names
    (`EngineOutputs.outputs[0]`); only runs on a bad message."""
    match = _PATH.search(error)
    indices = [int(i) for i in re.findall(r"\d+", match.group(1))] if match else []
    reason = error[:match.start()] if match else error
    try:
        cls = MESSAGE_CLASSES[MessageType(msgspec.msgpack.decode(data)[0])]
    except Exception:  # the type tag itself is what is wrong
        return f"message type: {reason}" if indices == [0] else reason
    if not indices:
        return f"{cls.__name__}: {reason}"
    # At the top the tag is element 0, so field i is element i + 1.
    return f"{cls.__name__}{_field_path(cls, [indices[0] - 1, *indices[1:]])}: {reason}"


def _field_path(cls: type, indices: list[int]) -> str:
    info: Any = msgspec.inspect.type_info(cls)
    parts = []
    for i in indices:
        while isinstance(info, msgspec.inspect.UnionType):  # `X | None`: the X
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        if isinstance(info, msgspec.inspect.StructType) and i < len(info.fields):
            parts.append(f".{info.fields[i].name}")
            info = info.fields[i].type
        elif isinstance(info, msgspec.inspect.ListType):
            parts.append(f"[{i}]")
            info = info.item_type
        else:
            parts.append(f"[{i}]")
    return "".join(parts)
