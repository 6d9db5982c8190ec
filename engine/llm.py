"""The offline API, in vLLM's style: `LLM(model=...).generate(prompts, params)` and `.chat(messages)`.

It drives an `EngineCore` through its public API only (add_request, step,
abort_requests) and makes its text with the server's own code: prompts and chat
templates through the shared torch-free `ipc.text.tokenizer.Tokenizer`, each step's
outputs through `ipc.text.output_processor.OutputProcessor` (detokenizer and stop
strings). So a request gets the same text offline as from the server.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.loop.engine_core import EngineCore, StepError
from ipc.messages import FinishReason, LoRARequest, RequestOutput, TokenLogprobs
from ipc.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from ipc.sampling_params import SamplingParams, tokenize_bad_words
from ipc.text.output_processor import OutputProcessor, RequestDelta
from ipc.text.tokenizer import Tokenizer
from ipc.vision.chat_images import extract_images
from ipc.vision.image_decode import ImageLimits
from ipc.vision.processor import VisionProcessor

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.002  # the loop's nap while every unfinished request waits for its grammar

Conversation = list[dict[str, Any]]


@dataclass
class RequestTimes:
    """When an offline request arrived, got its first token and finished (time.time())."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


@dataclass
class CompletionOutput:
    request_id: str
    prompt: str | None  # the text given, or the rendered chat template; None for token ids
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", "error"
    metrics: RequestTimes  # named as vLLM's RequestOutput.metrics
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # vLLM's prompt_logprobs: None for the first prompt token, then each one's (with prompt_logprobs set)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]  # the model's hidden size; unit length unless PoolingParams(normalize=False)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, skip_tokenizer_init: bool = False, **engine_kwargs) -> None:
        """`skip_tokenizer_init`: token ids in and out only (no text), for folders without a tokenizer."""
        self.engine = EngineCore(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = None if skip_tokenizer_init else Tokenizer(self.engine.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self._vision: VisionProcessor | None = None  # a vision-language model's, made on its first image

    def apply_chat_template(self, messages: Conversation, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt token ids, rendered exactly as the server's chat route does."""
        return self._need_tokenizer("chat").encode_chat(messages, add_generation_prompt, tools, chat_template_kwargs)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate a reply to one conversation (a list of message dicts) or to each of a list of them.

        `chat_template_kwargs`: more template variables, e.g. `{"enable_thinking": False}` for Qwen3.
        `lora_request`: the LoRA adapter for every conversation, or one (or None: the base) for each."""
        tokenizer = self._need_tokenizer("chat")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts, images = [], []
        for conversation in conversations:
            conversation, conversation_images = extract_images(list(conversation), ImageLimits())
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt, tools, chat_template_kwargs)
            # The template writes the special tokens itself: no second BOS (Tokenizer.encode_chat).
            token_ids, records = (self._vision_processor().process(text, conversation_images, add_special_tokens=False)
                                  if conversation_images else (tokenizer.encode(text, add_special_tokens=False), []))
            prompts.append((text, token_ids))
            images.append(records)
        return self._generate(prompts, sampling_params, use_tqdm, images, lora_request)

    def generate(
        self,
        prompts: str | dict | list[int] | list[str | dict] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": text with an <image> per image,
        "multi_modal_data": {"image": a PIL image or a list}}); results come back in input order.
        `lora_request` (vLLM's): the LoRA adapter for every prompt, or one (or None: the base) for each."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tokenized, images = [], []
        for prompt in prompts:
            images.append([])
            if isinstance(prompt, dict):
                token_ids, images[-1] = self._process_images(prompt)
                tokenized.append((prompt["prompt"], token_ids))
            elif isinstance(prompt, str):
                tokenized.append((prompt, self._need_tokenizer("text prompts").encode(prompt)))
            else:
                tokenized.append((None, list(prompt)))
        return self._generate(tokenized, sampling_params, use_tqdm, images, lora_request)

    def _process_images(self, prompt: dict) -> tuple[list[int], list]:
        """A {"prompt", "multi_modal_data"} prompt's token ids and image records (ipc.vision.processor)."""
        self._need_tokenizer("image prompts")
        found = (prompt.get("multi_modal_data") or {}).get("image", [])
        found = found if isinstance(found, (list, tuple)) else [found]
        return self._vision_processor().process(prompt["prompt"], [image.convert("RGB") for image in found])

    def _vision_processor(self) -> VisionProcessor:
        if self._vision is None:
            self._vision = VisionProcessor.from_folder(self.engine.model_path, self._need_tokenizer("images"))
            if self._vision is None:
                raise ValueError("this model is text-only: it takes no images")
        return self._vision

    def embed(self, prompts: str | list[int] | list[str] | list[list[int]],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in input order (vLLM's `LLM.embed`): last-token
        pooling, normalized, unless `pooling_params` says otherwise (engine.worker.pooler)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooling_params = pooling_params or PoolingParams()
        token_ids_list = [self._need_tokenizer("text prompts").encode(p) if isinstance(p, str) else list(p)
                          for p in prompts]
        request_ids: list[str] = []
        try:
            for token_ids in token_ids_list:
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, token_ids, POOLING_SAMPLING_PARAMS, time.time(), pooling_params)
                request_ids.append(request_id)
        except ValueError:
            self.engine.abort_requests(request_ids)  # all or nothing, as generate
            raise
        embeddings: dict[str, list[float]] = {}
        while self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step().outputs
            except StepError as e:  # those requests are gone; end the rest too, and say so
                self.engine.abort_requests(request_ids)
                raise RuntimeError(f"embedding failed: {e.cause!r}") from e
            embeddings.update((o.request_id, o.embedding) for o in outputs if o.embedding is not None)
        return [EmbeddingOutput(request_id, token_ids, embeddings[request_id])
                for request_id, token_ids in zip(request_ids, token_ids_list)]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else when the LLM is garbage-collected or at exit)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget cached prefix blocks that no request holds; returns how many."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's LLM.get_tokenizer): encode, decode, apply_chat_template."""
        return self._need_tokenizer("get_tokenizer")

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer; pass token ids, or drop skip_tokenizer_init")
        return self.tokenizer

    def _generate(self, prompts: list[tuple[str | None, list[int]]],
                  sampling_params: SamplingParams | list[SamplingParams] | None,
                  use_tqdm: bool, images: list[list] | None = None,
                  lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[CompletionOutput]:
        """Add every (prompt text, prompt token ids) as one request, run them all, return them in order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        lora_requests = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(lora_requests) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_requests)} lora requests")
        requests: dict[str, _OfflineRequest] = {}
        try:
            for index, ((prompt, token_ids), params, lora) in enumerate(zip(prompts, sampling_params, lora_requests)):
                if params.stop or params.bad_words:
                    tokenizer = self._need_tokenizer("stop strings and bad words")
                    if params.bad_words:
                        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
                        params = replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, encode))
                request_id = str(next(self._request_counter))
                arrival_time = time.time()
                self.engine.add_request(request_id, token_ids, params, arrival_time, None,
                                        images[index] if images else (), lora_request=lora)
                requests[request_id] = _OfflineRequest(request_id, prompt, token_ids, arrival_time)
                self.output_processor.add_request(request_id, token_ids, params, index)
        except ValueError:
            self._forget(list(requests))  # all or nothing: leave no half-added batch behind
            raise
        # No cyclic garbage collection while the steps run: a full collection walks every
        # object torch, transformers and the model left behind (4-8% of a step here), and the
        # steps' own objects go by reference count. Whatever cycles they left are collected
        # when the collector is back on.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._run(requests, use_tqdm)
        finally:
            self.output_processor.remove_requests(requests)  # only if the run broke off
            if was_enabled:
                gc.enable()
        return [request.to_output() for request in requests.values()]

    def _forget(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)
        self.output_processor.remove_requests(request_ids)

    def _run(self, requests: dict[str, _OfflineRequest], use_tqdm: bool) -> None:
        """Step until every request has finished, its text made by the shared output processor."""
        engine = self.engine
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Generating", unit="req")
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step().outputs  # a failed request's error is logged by the engine
            except StepError as e:  # logged by the engine; those requests end with finish_reason "error"
                outputs = [RequestOutput(request_id, [], FinishReason.ERROR) for request_id in e.request_ids]
            if not outputs and not engine.has_schedulable_requests():
                # Only grammars compile: spinning here would starve their thread of the GIL.
                time.sleep(GRAMMAR_WAIT_S)
                continue
            processed = self.output_processor.process_outputs(outputs)
            now = time.time()
            finished = [requests[request_id].fail(now) for request_id in processed.failed_request_ids]
            for delta in processed.deltas:
                request = requests[delta.request_id]
                request.add_delta(delta, now)
                if delta.finish_reason is not None:
                    finished.append(request)
            if processed.request_ids_to_abort:  # a stop string ended them: the engine is still generating
                engine.abort_requests(processed.request_ids_to_abort)
            if progress is not None and finished:
                progress.update(len(finished))
        if progress is not None:
            progress.close()


@dataclass
class _OfflineRequest:
    """What `generate` gathers per request from its deltas, and the times it records itself."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None

    def add_delta(self, delta: RequestDelta, now: float) -> None:
        if delta.token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(delta.token_ids)
        self.text_parts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.output.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *delta.output.prompt_logprobs]
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.finish_time = delta.finish_reason, now
            self.stop_token_id = delta.output.stop_token_id

    def fail(self, now: float) -> _OfflineRequest:
        """Detokenizing failed (logged by the output processor): the request ends with "error"."""
        self.finish_reason, self.finish_time = FinishReason.ERROR, now
        return self

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text="".join(self.text_parts),
            finish_reason=self.finish_reason.openai_name if self.finish_reason is not None else None,
            metrics=RequestTimes(self.arrival_time, self.first_token_time, self.finish_time),
            logprobs=self.logprobs,
            stop_token_id=self.stop_token_id,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )
