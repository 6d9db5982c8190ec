"""A request's state inside the engine: its tokens, how many are computed, its blocks."""

from __future__ import annotations

import enum
import time

from engine.core.block_manager import ROOT_HASH, adapter_root_hash, hash_block
from ipc.messages import FinishReason, ImageInput, LoRARequest, TokenLogprobs
from ipc.pooling_params import PoolingParams
from ipc.sampling_params import SamplingParams
from ipc.speculative_config import MAX_SPECULATIVE_TOKENS


class RequestStatus(enum.IntEnum):
    # Order carries meaning: every finished status comes after the live ones.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Tokens are scheduled, not phases: the engine only tracks how far
    `num_computed_tokens` lags behind `num_tokens`. A prompt is that lag at the
    start; each sampled token adds one more; a preemption resets the count to 0
    and the whole sequence is recomputed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        images: list[ImageInput] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens  # resolved: never None
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Prefix caching: the hash chain of the sequence's full blocks, extended as they
        # are needed. Tokens never change, so it survives preemption.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0  # leading blocks whose hash the block manager knows
        self.num_cached_tokens = 0  # prompt tokens found in the cache at the first admission
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., once computed
        # Structured outputs: the matcher that follows the accepted tokens (engine.structured_output)
        self.grammar = None
        # LoRA: its adapter's read on the core's reader thread, None once cached (engine.lora.adapter_reader)
        self.adapter_read = None
        # Speculative decoding (engine.spec_decode): tokens proposed for the next step, and by what
        self.spec_token_ids: list[int] = []
        self.spec_method = None  # ipc.messages.SpecMethod of spec_token_ids
        self.spec_ema = float(MAX_SPECULATIVE_TOKENS)  # average accepted tokens per draft: starts high, adapts
        self.prediction_state = None  # engine.spec_decode.prediction_proposer.PredictionState
        self.num_preemptions = 0
        # Embeddings (engine.worker.pooler): set, the request pools its prompt's states and never samples;
        # `embedding` is its vector once the last prompt chunk has run.
        self.pooling_params = pooling_params
        self.embedding: list[float] | None = None
        self.images = list(images)  # a vision-language model's, in prompt order (ipc.messages.ImageInput)
        # The LoRA adapter it runs under (engine/lora/); None: the base model. Its blocks' hash chain
        # starts from the adapter's own root, so the prefix cache keeps adapters apart.
        self.lora_request = lora_request
        self.root_hash = ROOT_HASH if lora_request is None else adapter_root_hash(lora_request.lora_name,
                                                                                  lora_request.lora_path)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def extend_block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Hashes of the first `num_blocks` blocks (all full), computing only the missing ones."""
        for i in range(len(self.block_hashes), num_blocks):
            parent_hash = self.block_hashes[-1] if self.block_hashes else self.root_hash
            start, end = i * block_size, (i + 1) * block_size
            self.block_hashes.append(hash_block(parent_hash, self.all_token_ids[start:end], self.image_hashes(start, end)))
        return self.block_hashes[:num_blocks]

    def image_hashes(self, start: int, end: int) -> bytes:
        """The content hashes of the images with tokens in positions start..end-1, for the block key."""
        return b"".join(image.content_hash.encode() for image in self.images
                        if image.offset < end and image.offset + image.length > start)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )


def is_compiling(request: Request) -> bool:
    """Its grammar is not compiled yet, or its adapter not read: the request waits, passed over, in its place."""
    return ((request.grammar is not None and not request.grammar.is_ready)
            or (request.adapter_read is not None and not request.adapter_read.is_ready))


def check_stop(request: Request, token_id: int, eos_token_ids: set[int], max_model_len: int) -> RequestStatus | None:
    """Whether `request` ends with `token_id`, just appended: how, or None while it goes on."""
    params = request.sampling_params
    if request.grammar is not None:
        if not request.grammar.accept(token_id):  # the mask left no token: the constraints contradict
            return RequestStatus.FINISHED_ERROR
        if request.grammar.is_terminated:  # it accepted a stop token: the answer is complete
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
