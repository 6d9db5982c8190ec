"""Inter-process message records: the contract between frontend and engine core.

This file holds only message types and int enums, declared once as msgspec
Structs: their field types are the wire schema, decoded and bounded in C by
`ipc.codec`. It imports neither torch nor transformers.

Every record travels as a msgpack array whose first element is its
`MessageType` (the Struct's int tag); the remaining elements are the record's
fields in declaration order. Fields are append-only: a new field goes at the end
with a default, so an older peer that sends fewer elements still decodes.

A request is sent once in full (`AddRequest`); afterwards only per-step deltas
flow back (`EngineOutputs`, one per engine step, holding a `RequestOutput` for
each request that produced tokens or finished in that step).
"""

from __future__ import annotations

import enum
from typing import Annotated

from msgspec import Meta, Struct, field

from ipc.pooling_params import MAX_EMBEDDING_SIZE, PoolingParams
from ipc.sampling_params import MAX_STOP_TOKEN_IDS, Int64, SamplingParams, TokenId

MAX_PROMPT_TOKENS = 1_000_000  # also bounds any other token-id list
MAX_REQUEST_ID_LEN = 256
MAX_NAME_LEN = 4096  # model names may be local paths
MAX_DTYPE_NAME_LEN = 32
MAX_ABORT_REQUEST_IDS = 65_536  # a frontend shutting down aborts everything in flight at once
MAX_OUTPUTS_PER_STEP = 65_536  # far above any batch size an engine step can hold
MAX_LOGPROBS_PER_TOKEN = 21  # the sampled token and its top 20
MAX_IMAGES_PER_REQUEST = 64  # far above any --limit-mm-per-prompt a frontend allows
# One image's preprocessed pixels as sent: 17 uint8 frames of 3 x 512 x 512 (SmolVLM's largest split) are 13 MiB.
MAX_IMAGE_BYTES = 48 * 1024 * 1024
MAX_IMAGE_DIM = 65_536

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
NumTokens = Annotated[int, Meta(ge=0, le=MAX_PROMPT_TOKENS)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]


class _Message(Struct, array_like=True, forbid_unknown_fields=True):
    """A top-level record: `[tag, *fields]`. Subclasses set `tag=int(MessageType.X)`."""


class _Record(Struct, array_like=True, forbid_unknown_fields=True):
    """A nested record: `[*fields]`, no tag."""


class MessageType(enum.IntEnum):
    # frontend -> engine core
    ADD_REQUEST = 1
    ABORT_REQUESTS = 2
    SHUTDOWN = 3
    HELLO = 4
    RESET_PREFIX_CACHE = 5
    WATCH_STEPS = 6
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


class PixelDType(enum.IntEnum):
    """How an image's pixel bytes are laid out, element by element."""

    UINT8 = 1  # 0..255, normalised in the core: (x * rescale_factor - image_mean) / image_std, per channel
    FLOAT32 = 2  # already normalised, little-endian


class ImageInput(_Record):
    """One preprocessed image of a request: its frames' pixels as raw bytes (never pickled),
    and the prompt positions its tokens fill. The encoder's output replaces the embeddings of the
    model's image placeholder tokens inside offset .. offset + length - 1, in order."""

    data: Annotated[bytes, Meta(max_length=MAX_IMAGE_BYTES)]
    shape: Annotated[list[Annotated[int, Meta(ge=1, le=MAX_IMAGE_DIM)]], Meta(min_length=4, max_length=4)]  # [frames, C, H, W]
    dtype: PixelDType
    content_hash: Annotated[str, Meta(min_length=1, max_length=128)]  # hex SHA-256 of the pixels, shape and dtype
    offset: NumTokens
    length: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    rescale_factor: float = 1.0
    image_mean: Annotated[list[float], Meta(max_length=4)] = field(default_factory=list)
    image_std: Annotated[list[float], Meta(max_length=4)] = field(default_factory=list)
class LoRARequest(_Record):
    """The LoRA adapter a request runs under, in vLLM's names and order: LoRARequest(name, int_id, path).
    The id picks the adapter in the engine (one id, one adapter); the name keys its prefix cache."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LEN)]
    lora_int_id: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    lora_path: Name = ""


class AddRequest(_Message, tag=int(MessageType.ADD_REQUEST)):
    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # Set: an embedding request (sampling_params unused); its output carries `embedding`, no tokens.
    pooling_params: PoolingParams | None = None
    # A vision-language model's images, in prompt order (their ranges never overlap).
    images: Annotated[list[ImageInput], Meta(max_length=MAX_IMAGES_PER_REQUEST)] = field(default_factory=list)
    # Set: the request runs under this LoRA adapter (engine/lora/); None: the base model.
    lora_request: LoRARequest | None = None


class AbortRequests(_Message, tag=int(MessageType.ABORT_REQUESTS)):
    request_ids: Annotated[list[RequestId], Meta(max_length=MAX_ABORT_REQUEST_IDS)]


class Shutdown(_Message, tag=int(MessageType.SHUTDOWN)):
    reason: Name = ""


class Hello(_Message, tag=int(MessageType.HELLO)):
    """The frontend's first message on a fresh connection; the core answers EngineReady."""

    frontend_id: Name = ""


class ResetPrefixCache(_Message, tag=int(MessageType.RESET_PREFIX_CACHE)):
    """Forget every cached prefix block that no request holds (benchmarks start cold)."""


class WatchSteps(_Message, tag=int(MessageType.WATCH_STEPS)):
    """A dashboard opened (True) or the last one closed (False): only while one watches does
    the core count each step's batch for it (`EngineOutputs.step_counts`)."""

    is_on: bool = False


class EngineReady(_Message, tag=int(MessageType.ENGINE_READY)):
    """The core's handshake once its model is loaded: the facts the frontend needs."""

    engine_id: Count
    model_name: Name
    max_model_len: Count
    vocab_size: Annotated[int, Meta(ge=0, le=2**31)]
    num_kv_blocks: Count
    block_size: Count
    eos_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = field(default_factory=list)
    dtype: Annotated[str, Meta(max_length=MAX_DTYPE_NAME_LEN)] = ""  # what the weights and activations run in ("bfloat16"); "" from older cores
    quantization: Annotated[str, Meta(max_length=MAX_DTYPE_NAME_LEN)] = ""  # "int8"; "": none (weights in dtype)
    hidden_size: Count = 0  # an embedding's length; 0 from older cores
    runner: Annotated[str, Meta(max_length=MAX_DTYPE_NAME_LEN)] = ""  # "generate" or "pooling" (embeddings only)


class TokenLogprobs(_Record):
    """Log-probability of one sampled token and the top-N alternatives."""

    token_id: TokenId
    logprob: float
    top_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_LOGPROBS_PER_TOKEN)] = field(default_factory=list)
    top_logprobs: Annotated[list[float], Meta(max_length=MAX_LOGPROBS_PER_TOKEN)] = field(default_factory=list)


class RequestOutput(_Record):
    """One request's delta for one engine step."""

    request_id: RequestId
    new_token_ids: TokenIds
    finish_reason: FinishReason | None = None
    new_logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    # The stop token id that ended the request, when finish_reason is STOP.
    stop_token_id: TokenId | None = None
    # Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: NumTokens = 0
    # With the first token of a request that asked for prompt_logprobs: prompt tokens 1.. (the first has none).
    prompt_logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    # Predicted Outputs, this step: drafted from the request's prediction and accepted by the model,
    # or drafted from it and rejected (OpenAI's usage.completion_tokens_details, summed by the frontend).
    num_accepted_prediction_tokens: NumTokens = 0
    num_rejected_prediction_tokens: NumTokens = 0
    # An embedding request's pooled vector, with its finish (no tokens): see ipc.pooling_params.
    embedding: Annotated[list[float], Meta(max_length=MAX_EMBEDDING_SIZE)] | None = None


class SpecMethod(enum.IntEnum):
    """Where a speculative decoding draft came from."""

    NGRAM = 1  # prompt lookup over the request's own prompt and output
    DRAFT = 2  # a draft model ("self-int4": the served checkpoint in int4)
    PREDICTION = 3  # the request's `prediction` (OpenAI's Predicted Outputs)


class SpecDecodeStats(_Record):
    """Speculative decoding's cumulative counts for one method, since the core started."""

    method: SpecMethod
    num_drafts: Count = 0  # verification rows that carried at least one proposed token
    num_proposed_tokens: Count = 0
    num_accepted_tokens: Count = 0
    num_emitted_tokens: Count = 0  # tokens out of those rows: the accepted ones plus one sampled each


class SchedulerStats(_Record):
    num_running: Count = 0
    num_waiting: Count = 0
    num_kv_blocks_used: Count = 0
    num_kv_blocks_free: Count = 0
    num_preemptions: Count = 0  # cumulative
    num_prefix_cache_queries: Count = 0  # prompt tokens looked up in the prefix cache, cumulative
    num_prefix_cache_hits: Count = 0  # of those, tokens found cached, cumulative
    num_cached_blocks: Count = 0  # blocks findable in the prefix cache now, held or free
    spec_decode: Annotated[list[SpecDecodeStats], Meta(max_length=len(SpecMethod))] = field(default_factory=list)


class StepCounts(_Record):
    """One step's batch as the scheduler made it (the dashboard's occupancy strip)."""

    num_prefill_tokens: Count = 0  # prompt chunks, and recomputation after a preemption
    num_decode_tokens: Count = 0  # one a decoding request, and its proposed tokens
    num_prefill_requests: Count = 0
    num_decode_requests: Count = 0


class EngineOutputs(_Message, tag=int(MessageType.ENGINE_OUTPUTS)):
    """Everything one engine step produced, sent as one message."""

    engine_id: Count
    outputs: Annotated[list[RequestOutput], Meta(max_length=MAX_OUTPUTS_PER_STEP)]
    stats: SchedulerStats
    # The step's batch, exact; None from a message that is no step (a heartbeat, an abort's reply)
    # and while no dashboard watches (WatchSteps)
    step_counts: StepCounts | None = None


class EngineError(_Message, tag=int(MessageType.ENGINE_ERROR)):
    """A failure report. With request_id, only that request failed; is_fatal means the core is going down."""

    message: str
    request_id: RequestId | None = None
    is_fatal: bool = False
    engine_id: Count = 0
    is_request_error: bool = False  # the request's own parameters caused it: the client's error (400)


class GenerateRequest(_Message, tag=int(MessageType.GENERATE_REQUEST)):
    """A local-socket client's request to the frontend: text in, text deltas out."""

    request_id: RequestId
    prompt: str | None  # bounded by the message size
    prompt_token_ids: TokenIds | None
    sampling_params: SamplingParams


class GenerateOutput(_Message, tag=int(MessageType.GENERATE_OUTPUT)):
    """A text delta for a local-socket client; `error` set means the request failed."""

    request_id: RequestId
    text: str
    token_ids: TokenIds
    finish_reason: FinishReason | None = None
    error: str | None = None
