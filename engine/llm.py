"""The offline API, in vLLM's style: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine_core import EngineCore, StepError
from ipc.messages import FinishReason, RequestOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestMetrics:
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
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


class LLM:
    def __init__(self, model: str = "smollm2", skip_tokenizer_init: bool = False, **engine_kwargs) -> None:
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

        requests = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._request_counter))
                if isinstance(prompt, str) and self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or drop skip_tokenizer_init")
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(request_id, token_ids, params)
                requests[request_id] = (prompt if isinstance(prompt, str) else None, params)
        except ValueError:
            self.engine.abort_requests(list(requests))  # all or nothing: leave no half-added batch behind
            raise
        order = list(requests)
        finished = self._run(len(order), use_tqdm)
        return [self._to_output(finished[request_id], *requests[request_id]) for request_id in order]

    def reset_prefix_cache(self) -> int:
        """Forget cached prefix blocks that no request holds; returns how many."""
        return self.engine.reset_prefix_cache()

    def _run(self, num_requests: int, use_tqdm: bool) -> dict:
        engine = self.engine
        live = dict(engine.scheduler.requests)  # the Request objects, kept after they retire
        finished = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=num_requests, desc="Generating", unit="req")
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except StepError as e:  # logged by the engine; those requests end with finish_reason "error"
                outputs = [RequestOutput(request_id, [], FinishReason.ERROR) for request_id in e.request_ids]
            for output in outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = live[output.request_id]
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return finished

    def _to_output(self, request, prompt: str | None, params: SamplingParams) -> CompletionOutput:
        token_ids = request.output_token_ids
        text = ""
        if self.tokenizer is not None:
            # A last token cut mid-character (max_tokens) is dropped from the text, not shown as
            # U+FFFD: the same rule as the server's detokenizer.
            text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens).rstrip("\ufffd")
        finish_reason = request.status.finish_reason
        return CompletionOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason.openai_name if finish_reason is not None else None,
            metrics=RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time),
            logprobs=request.logprobs,
            stop_token_id=request.stop_token_id,
            num_cached_tokens=request.num_cached_tokens,
        )
