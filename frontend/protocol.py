"""HTTP request bodies: vLLM's simple `/generate`, OpenAI completions and chat completions.

Pydantic checks types (FastAPI turns a failure into 400, see api_server); the value
ranges are SamplingParams.validate's job, so they are written down once. Responses
are plain dicts built in the serving modules.

References: vllm/entrypoints/api_server.py, vllm/entrypoints/openai/protocol.py,
https://platform.openai.com/docs/api-reference/completions
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from frontend.chat_tools import ChatTool, ToolChoice
from frontend.errors import InvalidRequestError
from frontend.request_fields import check_extra_fields
from ipc.sampling_params import SamplingParams
from ipc.structured_outputs import StructuredOutputsParams

Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # the wire carries a signed 64-bit int
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one form."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object),
                                       any_whitespace=not self.disable_any_whitespace)


class SamplingFields(BaseModel):
    """Sampling fields shared by every endpoint; the names are vLLM's."""

    # OpenAI clients send null for "default". Undeclared fields are refused or logged
    # (frontend.request_fields), never silently dropped.
    model_config = ConfigDict(extra="allow")

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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's form: token ids as strings
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's params; `structured_outputs` as resolved by the endpoint (see structured_outputs_fields)."""
        if self.model_extra:  # fields the body does not declare (frontend.request_fields)
            check_extra_fields(self.model_extra)
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
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=_logit_bias_pairs(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words=list(self.bad_words or []),
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=structured_outputs,
        )

    def structured_outputs_fields(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Every structured-output form this body sets, with the field that set it."""
        forms = []
        if self.structured_outputs is not None:
            forms.append(("structured_outputs", self.structured_outputs.to_params()))
        return forms

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured-output form asked for, or None; two forms at once are a 400."""
        forms = self.structured_outputs_fields()
        if len(forms) > 1:
            raise InvalidRequestError("only one structured output may be asked for, got " +
                                      ", ".join(name for name, _ in forms))
        return forms[0][1] if forms else None


def _logit_bias_pairs(logit_bias: dict[str, float] | None) -> list[tuple[int, float]]:
    pairs = []
    for key, value in (logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        pairs.append((token_id, value))
    return sorted(pairs)


class GenerateBody(SamplingFields):
    """`POST /generate`, vLLM's demo API: the prompt, `stream`, and SamplingParams fields."""

    model_config = ConfigDict(extra="forbid")  # vLLM passes the rest to SamplingParams(**fields)

    prompt: str
    stream: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the answer is expected to copy (the file being edited).
    Its tokens draft the answer (speculative decoding): same answer, fewer engine steps."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar always holds the answer to the schema


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAIFields(SamplingFields):
    """Fields both OpenAI endpoints take."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older names for structured_outputs' forms; many clients still send them.
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: Prediction | None = None

    def check_supported(self) -> None:
        if self.model_extra:  # fields the body does not declare (frontend.request_fields)
            check_extra_fields(self.model_extra)

    @property
    def prediction_text(self) -> str | None:
        return None if self.prediction is None else self.prediction.text

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_outputs_fields(self) -> list[tuple[str, StructuredOutputsParams]]:
        forms = super().structured_outputs_fields()
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                forms.append((name, StructuredOutputsParams(**{kind: value})))
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            forms.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema")
            forms.append(("response_format", StructuredOutputsParams(json=response_format.json_schema.schema_)))
        return forms



class CompletionRequest(OpenAIFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs returns the prompt's log-probs too, as vLLM does."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list; a flat list of ints is one tokenized prompt."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return list(prompt)


class ImagePart(BaseModel):
    """An image content part in any route's shape (ipc.vision.chat_images), checked when it is decoded."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image_url", "input_image", "image"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed on to the template

    role: str
    content: str | list[TextPart | ImagePart] | None = None

    def to_template_dict(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and not any(isinstance(p, ImagePart) for p in self.content):
            message["content"] = "".join(part.text for part in self.content)  # text parts: one string
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, False leaves reasoning_content out
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, e.g. enable_thinking

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request an adapter (Responses, Messages) built; a field chat refuses is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(str(part) for part in problem.get("loc", ()))
        raise InvalidRequestError(f"{where}: {problem.get('msg')}") from None
