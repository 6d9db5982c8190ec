"""`POST /tokenize` and `POST /detokenize`, with vLLM's shapes.

    /tokenize    {"prompt": str, "add_special_tokens": true}
                 or {"messages": [...], "add_generation_prompt": true, "tools": [...]}
                 -> {"count", "max_model_len", "tokens", "token_strs"}   (token_strs with return_token_strs)
    /detokenize  {"tokens": [int]} -> {"prompt": str}

The same tokenizer and chat template as generation, off the event loop and under the
same size cap, so a count here is the count a completion would see.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from frontend.chat_tools import ChatTool, template_messages
from frontend.engine_client import AsyncEngineClient
from frontend.errors import InvalidRequestError
from frontend.protocol import ChatMessage, TokenId
from frontend.request_fields import check_extra_fields


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId]


async def tokenize(body: TokenizeRequest, client: AsyncEngineClient) -> dict:
    if body.model_extra:  # fields the body does not declare (frontend.request_fields)
        check_extra_fields(body.model_extra)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages")
    if body.prompt is not None:
        token_ids = await client.prompt_tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                                         is not False)
    else:
        if body.add_special_tokens:
            raise InvalidRequestError("add_special_tokens is not supported with messages (the template writes them)")
        messages = template_messages([message.to_template_dict() for message in body.messages])
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        token_ids = await client.tokenize_chat(messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
    token_strs = client.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": client.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}


async def detokenize(body: DetokenizeRequest, client: AsyncEngineClient) -> dict:
    if body.model_extra:  # fields the body does not declare (frontend.request_fields)
        check_extra_fields(body.model_extra)
    if any(t >= client.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be token ids in [0, {client.vocab_size})")
    return {"prompt": client.tokenizer.decode(body.tokens, skip_special_tokens=False)}
