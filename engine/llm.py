"""The offline API, in vLLM's style: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass, field

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.engine_core import EngineCore, StepError
from engine.request import Request
from ipc.messages import FinishReason, RequestOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams
from frontend.text_stream import TextStream

logger = logging.getLogger(__name__)


@dataclass
class RequestTimes:
    """When an offline request arrived, got its first token and finished (time.time())."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


@dataclass
class CompletionOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", "error"
    metrics: RequestTimes  # named as vLLM's RequestOutput.metrics
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, skip_tokenizer_init: bool = False, **engine_kwargs) -> None:
        """`skip_tokenizer_init`: token ids in and out only (no text), for folders without a tokenizer."""
        self.engine = EngineCore(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_path)
        self._request_counter = itertools.count()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); results come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")

        requests: dict[str, _OfflineRequest] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._request_counter))
                if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
                    raise ValueError("text prompts and stop strings need a tokenizer; "
                                     "pass token ids and no stop strings, or drop skip_tokenizer_init")
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(request_id, token_ids, params)
                text_stream = None if self.tokenizer is None else TextStream(self.tokenizer, token_ids, params)
                requests[request_id] = _OfflineRequest(prompt if isinstance(prompt, str) else None, text_stream)
        except ValueError:
            self.engine.abort_requests(list(requests))  # all or nothing: leave no half-added batch behind
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
            if was_enabled:
                gc.enable()
        return [self._to_output(request) for request in requests.values()]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else when the LLM is garbage-collected or at exit)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget cached prefix blocks that no request holds; returns how many."""
        return self.engine.reset_prefix_cache()

    def _run(self, requests: dict[str, _OfflineRequest], use_tqdm: bool) -> None:
        """Step until every request has finished, building each one's text as the server does."""
        engine = self.engine
        live = dict(engine.scheduler.requests)  # the Request objects, kept after they retire
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Generating", unit="req")
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except StepError as e:  # logged by the engine; those requests end with finish_reason "error"
                outputs = [RequestOutput(request_id, [], FinishReason.ERROR) for request_id in e.request_ids]
            stopped_request_ids = []
            for output in outputs:
                request = requests[output.request_id]
                finish_reason = request.add_output(output)
                if finish_reason is None:
                    continue
                request.finish(live[output.request_id], finish_reason)
                if output.finish_reason is None:  # a stop string: the engine is still generating it
                    stopped_request_ids.append(output.request_id)
                if progress is not None:
                    progress.update(1)
            if stopped_request_ids:
                engine.abort_requests(stopped_request_ids)
        if progress is not None:
            progress.close()

    def _to_output(self, offline: _OfflineRequest) -> CompletionOutput:
        request = offline.request
        return CompletionOutput(
            request_id=request.request_id,
            prompt=offline.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text="".join(offline.text_parts),
            finish_reason=offline.finish_reason.openai_name if offline.finish_reason is not None else None,
            metrics=RequestTimes(request.arrival_time, request.first_token_time, request.finish_time),
            logprobs=request.logprobs,
            stop_token_id=request.stop_token_id,
            num_cached_tokens=request.num_cached_tokens,
        )


@dataclass
class _OfflineRequest:
    """What `generate` keeps per request beside the engine's own: its text so far and how it ended."""

    prompt: str | None
    text_stream: TextStream | None  # None without a tokenizer: token ids only
    text_parts: list[str] = field(default_factory=list)
    request: Request | None = None  # the engine's record, once finished
    finish_reason: FinishReason | None = None

    def add_output(self, output: RequestOutput) -> FinishReason | None:
        """Add one step's tokens to the text; return the finish reason if the request is now done."""
        if self.text_stream is None:
            return output.finish_reason
        text, hit_stop = self.text_stream.add_tokens(output.new_token_ids, is_last=output.finish_reason is not None,
                                                     stop_token_id=output.stop_token_id)
        self.text_parts.append(text)
        return FinishReason.STOP if hit_stop else output.finish_reason

    def finish(self, request: Request, finish_reason: FinishReason) -> None:
        self.request = request
        self.finish_reason = finish_reason
