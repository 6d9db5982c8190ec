"""`POST /v1/embeddings`, in OpenAI's shape (vLLM's route for a pooling model).

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "model", "encoding_format": "float" | "base64", "dimensions", "user",
     "pooling_type": "last" | "mean", "normalize": true}            (the last two: ours, as vLLM's pooler)
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request with pooling parameters (ipc.pooling_params): the same
tokenizer, admission, checks and cores as generation, mixed into the same steps. Inputs
are checked here, before any reaches a core. base64 is the vector's little-endian float32
bytes, as OpenAI's (the `openai` package asks for it by default and decodes it with numpy).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from frontend.engine_client import AsyncEngineClient
from frontend.errors import InvalidRequestError, RequestFailedError
from frontend.request_fields import check_extra_fields
from frontend.serving_utils import now_s, random_id, run_unless_disconnected
from ipc.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams, PoolingType

# Inputs per request: OpenAI's own limit. Their tokens together are bounded as every route's
# prompts are (--max-request-prompt-tokens, by default two contexts).
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: Any  # checked by `prompts_of`, so that each way it can be wrong gets its own message
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling_type: Literal["last", "mean"] = "last"
    normalize: bool = True
    add_special_tokens: bool = True  # vLLM's; false would change every vector: refused, not ignored

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(PoolingType[self.pooling_type.upper()], self.normalize)


def prompts_of(value: Any) -> list[str | list[int]]:
    """`input` as prompts: a string, strings, one token-id list, or token-id lists; 400 otherwise."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"input must be {_KINDS}, got {type(value).__name__}")
    if not value:
        raise InvalidRequestError("input must not be empty")
    kind = _kind(value[0])
    if kind is None:
        raise InvalidRequestError("input[0] must be a string, a token id or a list of token ids")
    if kind != "a token id" and len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"input may hold at most {MAX_EMBEDDING_INPUTS} items, got {len(value)}")
    for i, item in enumerate(value):
        if _kind(item) != kind:
            raise InvalidRequestError(f"input[{i}] must be {kind}, as input[0] is ({_KINDS})")
        if not item and kind != "a token id":
            raise InvalidRequestError(f"input[{i}] is empty")
    return [value] if kind == "a token id" else value


async def create_embedding(body: EmbeddingRequest, raw_request: Request, client: AsyncEngineClient) -> dict:
    check_extra_fields(body.model_extra)
    if body.dimensions is not None and body.dimensions != client.hidden_size:
        raise InvalidRequestError(f"dimensions must be this model's embedding size, {client.hidden_size} (vectors "
                                  f"are not shortened), got {body.dimensions}")
    if not body.add_special_tokens:
        raise InvalidRequestError("add_special_tokens false is not supported on /v1/embeddings")
    prompts = prompts_of(body.input)
    request_id = random_id("embd")
    stream = await client.generate_batch(prompts, POOLING_SAMPLING_PARAMS, request_id,
                                         pooling_params=body.pooling_params(), max_choices=MAX_EMBEDDING_INPUTS)
    vectors = await run_unless_disconnected(raw_request, _collect(stream))
    if len(vectors) != len(prompts):  # a core that finished an input without pooling it (not one of ours)
        raise RequestFailedError("the engine returned no embedding for an input")
    data = [{"object": "embedding", "index": i, "embedding": _encode(vectors[i], body.encoding_format)}
            for i in range(len(prompts))]
    num_prompt_tokens = sum(len(ids) for ids in stream.prompt_token_ids)
    return {"id": request_id, "object": "list", "created": now_s(), "model": client.model_name, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


async def _collect(stream) -> dict[int, list[float]]:
    vectors: dict[int, list[float]] = {}
    async with stream:
        async for delta in stream:
            if delta.output is not None and delta.output.embedding is not None:
                vectors[delta.index] = delta.output.embedding
    return vectors


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


_KINDS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _kind(item: Any) -> str | None:
    if isinstance(item, str):
        return "a string"
    if _is_token_id(item):
        return "a token id"
    if isinstance(item, list) and all(_is_token_id(t) for t in item):
        return "a list of token ids"
    return None


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0
