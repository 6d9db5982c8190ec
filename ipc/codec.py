"""The one wire codec: msgpack arrays, positional fields, no pickle.

A message is `[int(MessageType), field1, field2, ...]` in dataclass field order.
Nested records (SamplingParams, TokenLogprobs, RequestOutput, SchedulerStats)
are plain positional arrays without a type tag; enums travel as ints; None is nil.
There are no maps anywhere, so field names never cross the wire.

Decoding trusts nothing: the size is bounded before unpacking, msgpack's own
length limits are set, every field is type- and bounds-checked by a per-type
decoder from `_DECODERS`, and every problem surfaces as `DecodeError`. Sampling
values' ranges and the model's limits are not the codec's: `ipc.request_checks`
runs them where a request is handled, so a bad one fails that request by its id. Fields
are append-only: an older peer may send fewer trailing fields (defaults fill
in), but never more than this side knows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import msgpack

from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    Hello,
    MessageType,
    RequestOutput,
    ResetPrefixCache,
    SchedulerStats,
    Shutdown,
    TokenLogprobs,
)
from ipc.sampling_params import MAX_LOGPROBS, MAX_STOP_SEQUENCES, MAX_STOP_STRING_LEN, SamplingParams

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_PROMPT_TOKENS = 1_000_000  # also bounds any other token-id list and msgpack's array length
MAX_REQUEST_ID_LEN = 256
MAX_NAME_LEN = 4096  # model names may be local paths
MAX_DTYPE_NAME_LEN = 32
MAX_ABORT_REQUEST_IDS = 65_536  # a frontend shutting down aborts everything in flight at once
MAX_OUTPUTS_PER_STEP = 65_536  # far above any batch size an engine step can hold
MAX_SPECIAL_TOKEN_IDS = 1024  # eos_token_ids, stop_token_ids
MAX_TOKEN_ID = 2**31 - 1  # token ids index int32 tensors on the engine side
MAX_COUNT = 2**63 - 1

MESSAGE_CLASSES: dict[MessageType, type] = {
    MessageType.ADD_REQUEST: AddRequest,
    MessageType.ABORT_REQUESTS: AbortRequests,
    MessageType.SHUTDOWN: Shutdown,
    MessageType.HELLO: Hello,
    MessageType.RESET_PREFIX_CACHE: ResetPrefixCache,
    MessageType.ENGINE_READY: EngineReady,
    MessageType.ENGINE_OUTPUTS: EngineOutputs,
    MessageType.ENGINE_ERROR: EngineError,
    MessageType.GENERATE_REQUEST: GenerateRequest,
    MessageType.GENERATE_OUTPUT: GenerateOutput,
}
_TYPE_OF_CLASS: dict[type, MessageType] = {cls: t for t, cls in MESSAGE_CLASSES.items()}
_NESTED_CLASSES = (SamplingParams, TokenLogprobs, RequestOutput, SchedulerStats)
_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*MESSAGE_CLASSES.values(), *_NESTED_CLASSES)
}


class DecodeError(ValueError):
    """The bytes are not a valid message. The only exception `decode` raises for bad input."""


# ---------------------------------------------------------------- encoding


def _pack_record(obj: Any) -> list:
    # msgpack calls this for any object it cannot pack itself; nested records become arrays.
    # IntEnums need no help: msgpack packs int subclasses as plain ints.
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a tokenloom wire record")
    return [getattr(obj, name) for name in names]


def encode(msg: Any) -> bytes:
    """Pack a message record as `[int(MessageType), *fields]`."""
    msg_type = _TYPE_OF_CLASS.get(type(msg))
    if msg_type is None:
        raise TypeError(f"cannot encode {type(msg).__name__}: not a message type")
    return msgpack.packb([int(msg_type), *_pack_record(msg)], default=_pack_record, use_bin_type=True)


# ---------------------------------------------------------------- field checks
# A check takes the wire value and returns the Python value or raises _FieldError.
# The error collects its path on the way up, so the happy path builds no strings.


class _FieldError(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []  # innermost first


Check = Callable[[Any], Any]


def _type_name(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _int(lo: int = -MAX_COUNT - 1, hi: int = MAX_COUNT) -> Check:
    def check(value: Any) -> int:
        if type(value) is not int:  # `is`, not isinstance: bools are not ints here
            raise _FieldError(f"expected int, got {_type_name(value)}")
        if not lo <= value <= hi:
            raise _FieldError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return check


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:  # a peer may pack 1.0 as 1
        return float(value)
    raise _FieldError(f"expected float, got {_type_name(value)}")


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _FieldError(f"expected bool, got {_type_name(value)}")
    return value


def _str(min_len: int = 0, max_len: int | None = None) -> Check:
    def check(value: Any) -> str:
        if type(value) is not str:
            raise _FieldError(f"expected str, got {_type_name(value)}")
        if len(value) < min_len:
            raise _FieldError(f"string of length {len(value)} is shorter than {min_len}")
        if max_len is not None and len(value) > max_len:
            raise _FieldError(f"string of length {len(value)} exceeds the limit of {max_len}")
        return value

    return check


def _enum(enum_cls: type) -> Check:
    int_check = _int()

    def check(value: Any) -> Any:
        try:
            return enum_cls(int_check(value))
        except ValueError:
            raise _FieldError(f"{value!r} is not a valid {enum_cls.__name__}") from None

    return check


def _optional(inner: Check) -> Check:
    return lambda value: None if value is None else inner(value)


def _array(value: Any, max_len: int) -> list:
    if type(value) is not list:
        raise _FieldError(f"expected array, got {_type_name(value)}")
    if len(value) > max_len:
        raise _FieldError(f"array of {len(value)} elements exceeds the limit of {max_len}")
    return value


def _list(inner: Check, max_len: int) -> Check:
    def check(value: Any) -> list:
        out = []
        for i, item in enumerate(_array(value, max_len)):
            try:
                out.append(inner(item))
            except _FieldError as e:
                e.path.append(f"[{i}]")
                raise
        return out

    return check


def _token_ids(max_len: int) -> Check:
    # The hot case (a 1M-token prompt) gets a tight loop and returns the list as unpacked.
    def check(value: Any) -> list[int]:
        for i, t in enumerate(_array(value, max_len)):
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                e = _FieldError(f"expected a token id in [0, {MAX_TOKEN_ID}], got {t!r}")
                e.path.append(f"[{i}]")
                raise e
        return value

    return check


class _Record:
    """Decoder for one dataclass: positional fields, trailing ones optional when they have defaults."""

    def __init__(self, cls: type, checks: dict[str, Check]):
        fields = dataclasses.fields(cls)
        # The check table must mirror the dataclass exactly, so a new field cannot be forgotten.
        assert tuple(checks) == tuple(f.name for f in fields), f"{cls.__name__}: checks do not match fields"
        self.cls = cls
        self.checks = tuple(checks.items())
        self.num_required = sum(
            1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    def __call__(self, values: Any) -> Any:
        if type(values) is not list:
            raise _FieldError(f"expected array, got {_type_name(values)}")
        if not self.num_required <= len(values) <= len(self.checks):
            raise _FieldError(
                f"got {len(values)} fields, {self.cls.__name__} takes {self.num_required} to {len(self.checks)}"
            )
        kwargs = {}
        for (name, check), value in zip(self.checks, values):
            try:
                kwargs[name] = check(value)
            except _FieldError as e:
                e.path.append(f".{name}")
                raise
        return self.cls(**kwargs)


# ---------------------------------------------------------------- per-type decoders

_request_id = _str(1, MAX_REQUEST_ID_LEN)
_count = _int(0)
_stop_token_ids = _token_ids(MAX_SPECIAL_TOKEN_IDS)

_sampling_params = _Record(
    SamplingParams,
    {
        "temperature": _float,
        "top_p": _float,
        "top_k": _int(),
        "min_p": _float,
        "seed": _optional(_int()),
        "max_tokens": _optional(_int()),
        "min_tokens": _int(),
        "ignore_eos": _bool,
        "stop_token_ids": _stop_token_ids,
        "stop": _list(_str(1, MAX_STOP_STRING_LEN), MAX_STOP_SEQUENCES),
        "logprobs": _optional(_int()),
        "skip_special_tokens": _bool,
        "include_stop_str_in_output": _bool,
    },  # ranges and the model's limits: ipc.request_checks, run where the request is handled
)
_token_logprobs = _Record(
    TokenLogprobs,
    {
        "token_id": _int(0, MAX_TOKEN_ID),
        "logprob": _float,
        "top_token_ids": _token_ids(MAX_LOGPROBS + 1),
        "top_logprobs": _list(_float, MAX_LOGPROBS + 1),
    },
)
_request_output = _Record(
    RequestOutput,
    {
        "request_id": _request_id,
        "new_token_ids": _token_ids(MAX_PROMPT_TOKENS),
        "finish_reason": _optional(_enum(FinishReason)),
        "new_logprobs": _optional(_list(_token_logprobs, MAX_PROMPT_TOKENS)),
        "num_prompt_tokens": _int(0, MAX_PROMPT_TOKENS),
        "stop_token_id": _optional(_int(0, MAX_TOKEN_ID)),
        "num_cached_tokens": _int(0, MAX_PROMPT_TOKENS),
    },
)
_scheduler_stats = _Record(SchedulerStats, {name: _count for name in _FIELD_NAMES[SchedulerStats]})

_DECODERS: dict[MessageType, _Record] = {
    MessageType.ADD_REQUEST: _Record(
        AddRequest,
        {
            "request_id": _request_id,
            "prompt_token_ids": _token_ids(MAX_PROMPT_TOKENS),
            "sampling_params": _sampling_params,
            "arrival_time": _float,
        },
    ),
    MessageType.ABORT_REQUESTS: _Record(AbortRequests, {"request_ids": _list(_request_id, MAX_ABORT_REQUEST_IDS)}),
    MessageType.SHUTDOWN: _Record(Shutdown, {"reason": _str(0, MAX_NAME_LEN)}),
    MessageType.HELLO: _Record(Hello, {"frontend_id": _str(0, MAX_NAME_LEN)}),
    MessageType.RESET_PREFIX_CACHE: _Record(ResetPrefixCache, {}),
    MessageType.ENGINE_READY: _Record(
        EngineReady,
        {
            "engine_id": _count,
            "model_name": _str(0, MAX_NAME_LEN),
            "max_model_len": _count,
            "vocab_size": _int(0, MAX_TOKEN_ID + 1),
            "num_kv_blocks": _count,
            "block_size": _count,
            "eos_token_ids": _stop_token_ids,
            "dtype": _str(0, MAX_DTYPE_NAME_LEN),
        },
    ),
    MessageType.ENGINE_OUTPUTS: _Record(
        EngineOutputs,
        {
            "engine_id": _count,
            "outputs": _list(_request_output, MAX_OUTPUTS_PER_STEP),
            "stats": _scheduler_stats,
            "timestamp": _float,
        },
    ),
    MessageType.ENGINE_ERROR: _Record(
        EngineError,
        {"message": _str(), "request_id": _optional(_request_id), "is_fatal": _bool, "engine_id": _count},
    ),
    MessageType.GENERATE_REQUEST: _Record(
        GenerateRequest,
        {
            "request_id": _request_id,
            "prompt": _optional(_str()),  # bounded by the message size
            "prompt_token_ids": _optional(_token_ids(MAX_PROMPT_TOKENS)),
            "sampling_params": _sampling_params,
        },
    ),
    MessageType.GENERATE_OUTPUT: _Record(
        GenerateOutput,
        {
            "request_id": _request_id,
            "text": _str(),
            "token_ids": _token_ids(MAX_PROMPT_TOKENS),
            "finish_reason": _optional(_enum(FinishReason)),
            "error": _optional(_str()),
        },
    ),
}
assert set(_DECODERS) == set(MessageType), "every MessageType needs a decoder"


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack ext type {code} is not allowed")


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Unpack and check one message; raise DecodeError for anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise DecodeError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=0,  # no field is binary
            max_array_len=MAX_PROMPT_TOKENS,
            max_map_len=0,  # everything is positional
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ValueError, TypeError, StackError, ...)
        raise DecodeError(f"not a valid msgpack message: {type(e).__name__}: {e}") from None
    if type(obj) is not list or not obj:
        raise DecodeError(f"a message must be a non-empty array, got {_type_name(obj)}")
    if type(obj[0]) is not int:
        raise DecodeError(f"the first element must be an int MessageType, got {_type_name(obj[0])}")
    try:
        decoder = _DECODERS[MessageType(obj[0])]
    except ValueError:
        raise DecodeError(f"unknown message type {obj[0]}") from None
    try:
        return decoder(obj[1:])
    except _FieldError as e:
        path = "".join(reversed(e.path))
        raise DecodeError(f"{decoder.cls.__name__}{path}: {e.reason}") from None
