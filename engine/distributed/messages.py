"""The records between rank 0 and its tensor-parallel workers; message types only.

msgspec Structs as in `ipc.messages` (msgpack arrays, the int type first, no
pickle). They stay inside one engine group, whose ranks run the same code, so
they live here rather than in `ipc/`, the frontend's contract.

    worker ── WorkerHello ──► rank 0     connected (before the process group forms)
    worker ── WorkerReady ──► rank 0     model loaded, KV pool allocated
    rank 0 ── StepInputs ───► workers    once per step: what the model runner turns into tensors
    rank 0 ── StopWorker ───► workers    the engine is shutting down
"""

from __future__ import annotations

import enum
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

MAX_STEP_BYTES = 256 * 1024 * 1024
Ints = list[int]


class WorkerMessageType(enum.IntEnum):
    HELLO = 1
    READY = 2
    STEP_INPUTS = 3
    STOP = 4


class _Message(Struct, array_like=True, forbid_unknown_fields=True):
    pass


class WorkerHello(_Message, tag=int(WorkerMessageType.HELLO)):
    rank: Annotated[int, Meta(ge=1)]
    pid: int
    host_id: str = ""  # process_checks.host_id(): rank 0 watches a worker with its own id through /proc


class WorkerReady(_Message, tag=int(WorkerMessageType.READY)):
    rank: Annotated[int, Meta(ge=1)]


class StepInputs(_Message, tag=int(WorkerMessageType.STEP_INPUTS)):
    """One step's flat batch as Python lists; every rank builds the same tensors from it."""

    input_ids: Ints  # [num_tokens]
    positions: Ints  # [num_tokens]
    slot_mapping: Ints  # [num_tokens]: block_id * block_size + offset
    query_start_loc: Ints  # [num_seqs + 1]
    seq_lens: Ints  # [num_seqs]
    query_lens: Ints  # [num_seqs]
    block_tables: list[Ints]  # [num_seqs][max_num_blocks], padded with block 0
    sample_rows: Ints  # [num_sampled]: the rows whose logits are sampled
    # [num_pooled]: rows whose final hidden states an embedding request pools (engine.worker.pooler); they
    # leave the last layer after the sampled rows, so every rank must select them too
    pooling_rows: Ints = msgspec.field(default_factory=list)


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
