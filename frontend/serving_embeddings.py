"""`POST /v1/embeddings`, in OpenAI's shape (vLLM's route for a pooling model).

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "model", "encoding_format": "float" | "base64", "dimensions", "user",
     "pooling_type": "last" | "mean", "normalize": true}            (the last two: ours, as vLLM's pooler)
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request with pooling parameters (ipc.pooling_params): the same
tokenizer, admission, checks and cores as generation, mixed into the same steps. Inputs
are checked before any reaches a core (the body: frontend.protocol_embeddings). base64 is the vector's little-endian float32
bytes, as OpenAI's (the `openai` package asks for it by default and decodes it with numpy).
"""

from __future__ import annotations

import base64
import struct
from fastapi import Request

from frontend.engine_client import AsyncEngineClient
from frontend.errors import InvalidRequestError, RequestFailedError
from frontend.protocol_embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest, prompts_of
from frontend.request_fields import check_extra_fields
from frontend.request_state import RequestDelta, relay
from frontend.serving_utils import now_s, random_id, run_unless_disconnected
from ipc.pooling_params import POOLING_SAMPLING_PARAMS

async def create_embedding(body: EmbeddingRequest, raw_request: Request, client: AsyncEngineClient) -> dict:
    if body.model_extra:  # fields the body does not declare (frontend.request_fields)
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

    def on_delta(delta: RequestDelta, finish_reason: str | None) -> tuple:
        if delta.output is not None and delta.output.embedding is not None:
            vectors[delta.index] = delta.output.embedding
        return ()

    async for _ in relay(stream, on_delta):  # errors reach the caller
        pass
    return vectors


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
