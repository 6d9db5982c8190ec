"""Pooling parameters: what makes a request an embedding request (no sampling, no decode).

A request that carries `PoolingParams` runs its prompt through the same scheduler and
paged prefill as generation; at its last prompt chunk the model's final hidden states
(after the final norm, not logits) are pooled into one vector and the request ends.
Last-token pooling, L2-normalized, is vLLM's default for decoder models; mean pooling
averages every prompt position's state. No torch here: the record travels on the wire.
"""

from __future__ import annotations

import enum

from msgspec import Struct

from ipc.sampling_params import SamplingParams

MAX_EMBEDDING_SIZE = 65_536  # an embedding is the model's hidden size: far below this in any model in use


class PoolingType(enum.IntEnum):
    LAST = 1  # the prompt's last token's state (a causal model's only state that saw the whole text)
    MEAN = 2  # every prompt position's state, averaged


class PoolingParams(Struct, array_like=True, forbid_unknown_fields=True):
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True  # L2-normalize the pooled vector (OpenAI's embeddings are unit length)

    def validate(self) -> None:
        """Raise ValueError naming the bad field (params built in Python are not type-checked)."""
        if not isinstance(self.pooling_type, PoolingType):
            raise ValueError(f"pooling_type must be one of {[t.name.lower() for t in PoolingType]}, "
                             f"got {self.pooling_type!r}")
        if type(self.normalize) is not bool:
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


# What an embedding request carries where a generation request has its sampling: nothing is
# sampled, but the prompt must leave one position of context, as any request's must.
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def needs_every_position(params: PoolingParams | None) -> bool:
    """Mean pooling reads every prompt position's state: no prefix-cache hits for it."""
    return params is not None and params.pooling_type == PoolingType.MEAN
