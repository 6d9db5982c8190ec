"""`POST /v1/embeddings`' body (OpenAI's, with vLLM's pooler fields) and the check of its `input`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from frontend.errors import InvalidRequestError
from ipc.pooling_params import PoolingParams, PoolingType

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
