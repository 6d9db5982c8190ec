"""The records between rank 0 and its tensor-parallel workers; message types only.

msgspec Structs as in `ipc.messages` (msgpack arrays, the int type first, no
pickle). They stay inside one engine group, whose ranks run the same code, so
they live here rather than in `ipc/`, the frontend's contract.

    worker ── WorkerHello ──► rank 0     connected (before the process group forms)
    worker ── WorkerReady ──► rank 0     model loaded, KV pool allocated
    rank 0 ── StepInputs ───► workers    once per step: what the model runner turns into tensors
                                         (declared with the runner, engine/worker/step_inputs.py)
    rank 0 ── StopWorker ───► workers    the engine is shutting down
"""

from __future__ import annotations

import enum
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from engine.worker.step_inputs import STEP_INPUTS_TAG, StepInputs

MAX_STEP_BYTES = 256 * 1024 * 1024


class WorkerMessageType(enum.IntEnum):
    HELLO = 1
    READY = 2
    STEP_INPUTS = STEP_INPUTS_TAG  # StepInputs is the model runner's record (engine.worker.step_inputs)
    STOP = 4


class _Message(Struct, array_like=True, forbid_unknown_fields=True):
    pass


class WorkerHello(_Message, tag=int(WorkerMessageType.HELLO)):
    rank: Annotated[int, Meta(ge=1)]
    pid: int
    host_id: str = ""  # process_checks.host_id(): rank 0 watches a worker with its own id through /proc


class WorkerReady(_Message, tag=int(WorkerMessageType.READY)):
    rank: Annotated[int, Meta(ge=1)]


class StopWorker(_Message, tag=int(WorkerMessageType.STOP)):
    reason: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[WorkerHello, WorkerReady, StepInputs, StopWorker])


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview):
    """Raises ValueError (msgspec's errors) for anything malformed or too large."""
    if len(data) > MAX_STEP_BYTES:
        raise ValueError(f"a worker message of {len(data)} bytes exceeds {MAX_STEP_BYTES}")
    return _decoder.decode(data)
