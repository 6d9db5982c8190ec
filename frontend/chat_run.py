"""One chat request from body to answer, shared by every API that speaks chat.

`/v1/chat/completions` takes a ChatCompletionRequest as it comes; the Responses
(frontend.serving_responses) and Messages (frontend.serving_messages) adapters translate
their bodies into one and go the same way. `start_chat` is the whole way in (checks,
tools, structured outputs, the chat template, the reasoning state, sampling params,
the engine); `ChatRun` reads the answer back out, whole (`answer`) or delta by delta
(`new_delta_parser`), through the request's reasoning and tool parsers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from frontend.chat_tools import ToolMode, ToolOptions, resolve_tool_mode, template_messages
from frontend.engine_client import AsyncEngineClient
from frontend.media import MediaOptions, expand_images, take_images
from frontend.errors import InvalidRequestError
from frontend.protocol import ChatCompletionRequest
from frontend.reasoning_parsers import ReasoningParser, ReasoningPrompt, ReasoningState
from frontend.request_state import RequestStream
from frontend.serving_utils import random_id
from frontend.tool_parsers import ToolCall, ToolCallDelta, ToolParser

logger = logging.getLogger(__name__)


@dataclass
class ChatAnswer:
    """A whole answer split by the parsers; `content` None: the answer was all reasoning or all calls."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


@dataclass
class ChatDelta:
    """What one delta of a streamed choice comes to once parsed."""

    reasoning_content: str = ""
    content: str = ""
    call_deltas: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None


def tool_finish_reason(finish_reason: str | None) -> str | None:
    # A call cut short by max_tokens still says "length".
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _feed(parser, text: str, is_last: bool) -> tuple:
    """A streaming parser's (two-part) output for this delta, and what it held back when it is the last."""
    first, second = parser.feed(text)
    if is_last:
        more_first, more_second = parser.finish()
        first, second = first + more_first, second + more_second
    return first, second


class ChatDeltaParser:
    """One streamed choice's parsers: reasoning first, then tool calls on the content part."""

    def __init__(self, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser

    def feed(self, text: str, finish_reason: str | None) -> ChatDelta:
        """`finish_reason`: the engine's (OpenAI's names), set on the choice's last delta."""
        is_last = finish_reason is not None
        reasoning_text = ""
        if self.reasoning_parser is not None:
            reasoning_text, text = _feed(self.reasoning_parser, text, is_last)
        if self.tool_parser is None:
            return ChatDelta(reasoning_text, text, [], finish_reason)
        content, call_deltas = _feed(self.tool_parser, text, is_last)
        if is_last and self.tool_parser.has_tool_calls:
            finish_reason = tool_finish_reason(finish_reason)
        return ChatDelta(reasoning_text, content, call_deltas, finish_reason)


@dataclass
class ChatRun:
    """A chat request sent to the engine: its stream, and how to read its answers."""

    request_id: str
    stream: RequestStream
    prompt_token_ids: list[int]
    tool_mode: ToolMode | None  # None: plain chat, no tools asked for (frontend.chat_tools never runs)
    reasoning: ReasoningPrompt | None
    reasoning_state: ReasoningState

    def answer(self, text: str, finish_reason: str | None) -> ChatAnswer:
        """A whole choice's text -> its reasoning, content and calls."""
        reasoning_content, content = None, text
        if self.reasoning is not None:
            reasoning_content, content = self.reasoning.new_parser(self.reasoning_state).extract(text)
        parser = self.tool_mode.new_parser() if self.tool_mode is not None else None
        if parser is None:
            return ChatAnswer(reasoning_content, content, [], finish_reason)
        content, calls = parser.extract(content or "")
        if not calls:
            return ChatAnswer(reasoning_content, content or "", [], finish_reason)
        return ChatAnswer(reasoning_content, content, calls, tool_finish_reason(finish_reason))

    def new_delta_parser(self) -> ChatDeltaParser:
        reasoning_parser = self.reasoning.new_parser(self.reasoning_state) if self.reasoning is not None else None
        tool_parser = self.tool_mode.new_parser() if self.tool_mode is not None else None
        return ChatDeltaParser(reasoning_parser, tool_parser)


async def start_chat(body: ChatCompletionRequest, client: AsyncEngineClient, tool_options: ToolOptions | None,
                     reasoning: ReasoningPrompt | None, id_prefix: str = "chatcmpl") -> ChatRun:
    """Check the body, render the template, send the request; InvalidRequestError before anything is sent."""
    body.check_supported()
    tool_mode = None
    if body.tools is not None or body.tool_choice is not None:
        tool_mode = resolve_tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls,
                                      tool_options or ToolOptions())
    structured_outputs = body.structured_outputs_params()
    if tool_mode is not None and tool_mode.structured_outputs is not None:
        if structured_outputs is not None:
            raise InvalidRequestError(f'tool_choice "{tool_mode.kind}" cannot be combined with a structured output')
        structured_outputs = tool_mode.structured_outputs
    messages = [message.to_template_dict() for message in body.messages]
    if any("tool_calls" in message for message in messages):  # earlier answers' calls, arguments as JSON text
        messages = template_messages(messages)
    images = []
    if any(isinstance(m.get("content"), list) for m in messages):  # parts other than text: images, maybe
        media = client.config.media_options or MediaOptions()
        messages, images = take_images(messages, media, client.model_folder, client.tokenizer)
    template_tools = tool_mode.template_tools if tool_mode is not None else None
    prompt_token_ids = await client.tokenize_chat(messages, body.add_generation_prompt, template_tools,
                                                  body.chat_template_kwargs)
    image_records = []
    if images:
        prompt_token_ids, image_records = await expand_images(prompt_token_ids, images, client.model_folder,
                                                              client.tokenizer)
    reasoning_state = reasoning.state_after(prompt_token_ids) if reasoning is not None else ReasoningState.CONTENT
    if reasoning is not None:
        structured_outputs = reasoning.hold_grammar(structured_outputs, reasoning_state)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.to_sampling_params(max_tokens, body.num_logprobs, structured_outputs)
    request_id = random_id(id_prefix)
    stream = await client.generate(None, params, request_id, prompt_token_ids=prompt_token_ids, n=body.n,
                                   prediction=body.prediction_text, images=image_records)
    return ChatRun(request_id, stream, prompt_token_ids, tool_mode, reasoning, reasoning_state)
