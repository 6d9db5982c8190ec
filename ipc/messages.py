"""Inter-process message records: the contract between frontend and engine core.

This file holds only message types and int enums, no logic beyond field
validation helpers in `ipc.codec`. It imports neither torch nor transformers.

Every record travels as a msgpack array whose first element is its
`MessageType`; the remaining elements are the record's fields in declaration
order. Fields are append-only: a new field goes at the end with a default, so
an older peer that sends fewer elements still decodes.

A request is sent once in full (`AddRequest`); afterwards only per-step deltas
flow back (`EngineOutputs`, one per engine step, holding a `RequestOutput` for
each request that produced tokens or finished in that step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ipc.sampling_params import SamplingParams


class MessageType(enum.IntEnum):
    # frontend -> engine core
    ADD_REQUEST = 1
    ABORT_REQUESTS = 2
    SHUTDOWN = 3
    HELLO = 4
    RESET_PREFIX_CACHE = 5
    # engine core -> frontend
    ENGINE_READY = 10
    ENGINE_OUTPUTS = 11
    ENGINE_ERROR = 12
    # local-socket client <-> frontend (skips HTTP)
    GENERATE_REQUEST = 20
    GENERATE_OUTPUT = 21


class FinishReason(enum.IntEnum):
    """Why a request ended. Every value means "finished"; running has no value."""

    STOP = 1  # EOS or one of stop_token_ids (or a stop string, frontend side)
    LENGTH = 2  # max_tokens or the model's max length
    ABORT = 3  # the client went away or asked to cancel
    ERROR = 4  # the request failed (bad input found late, or the engine died)

    @property
    def openai_name(self) -> str:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}[int(self)]


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    reason: str = ""


@dataclass
class Hello:
    """The frontend's first message on a fresh connection; the core answers EngineReady."""

    frontend_id: str = ""


@dataclass
class ResetPrefixCache:
    """Forget every cached prefix block that no request holds (benchmarks start cold)."""


@dataclass
class EngineReady:
    """The core's handshake once its model is loaded: the facts the frontend needs."""

    engine_id: int
    model_name: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = ""  # what the weights and activations run in ("bfloat16"); "" from older cores


@dataclass
class TokenLogprobs:
    """Log-probability of one sampled token and the top-N alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One request's delta for one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    # The stop token id that ended the request, when finish_reason is STOP.
    stop_token_id: int | None = None
    # Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_preemptions: int = 0  # cumulative
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    num_prefix_cache_hits: int = 0  # of those, tokens found cached, cumulative
    num_cached_blocks: int = 0  # blocks findable in the prefix cache now, held or free


@dataclass
class EngineOutputs:
    """Everything one engine step produced, sent as one message."""

    engine_id: int
    outputs: list[RequestOutput]
    stats: SchedulerStats
    timestamp: float = 0.0


@dataclass
class EngineError:
    """A failure report. With request_id, only that request failed; is_fatal means the core is going down."""

    message: str
    request_id: str | None = None
    is_fatal: bool = False
    engine_id: int = 0


@dataclass
class GenerateRequest:
    """A local-socket client's request to the frontend: text in, text deltas out."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams


@dataclass
class GenerateOutput:
    """A text delta for a local-socket client; `error` set means the request failed."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
