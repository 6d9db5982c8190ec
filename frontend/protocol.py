"""HTTP request bodies: vLLM's simple `/generate`, OpenAI completions and chat completions.

Pydantic checks types (FastAPI turns a failure into 400, see api_server); the value
ranges are SamplingParams.validate's job, so they are written down once. Responses
are plain dicts built in the serving modules.

References: vllm/entrypoints/api_server.py, vllm/entrypoints/openai/protocol.py,
https://platform.openai.com/docs/api-reference/completions
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from frontend.errors import InvalidRequestError
from ipc.sampling_params import SamplingParams

Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # the wire carries a signed 64-bit int
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class SamplingFields(BaseModel):
    """Sampling fields shared by every endpoint; the names are vLLM's."""

    # OpenAI clients send null for "default"; unknown fields are ignored like OpenAI does.
    model_config = ConfigDict(extra="ignore")

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stop,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class GenerateBody(SamplingFields):
    """`POST /generate`, vLLM's demo API: the prompt, `stream`, and SamplingParams fields."""

    model_config = ConfigDict(extra="forbid")  # vLLM passes the rest to SamplingParams(**fields)

    prompt: str
    stream: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIFields(SamplingFields):
    """Fields both OpenAI endpoints take; the unsupported ones are rejected, not ignored."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.presence_penalty or self.frequency_penalty or (self.repetition_penalty or 1.0) != 1.0:
            raise InvalidRequestError("presence, frequency and repetition penalties are not supported")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list; a flat list of ints is one tokenized prompt."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed on to the template

    role: str
    content: str | list[TextPart] | None = None

    def to_template_dict(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # OpenAI content parts: only text is supported
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
