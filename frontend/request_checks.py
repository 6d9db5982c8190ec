"""The frontend's one check of a request against the served model, before anything is sent.

Every value that will reach a tensor in the core is bounded here by the model's own
limits (vocabulary, context length), so a bad request gets a 400 and the core never
sees it. The core checks again (its socket is a boundary), but a request refused
there would only be a frontend bug.
"""

from __future__ import annotations

from dataclasses import replace

from frontend.errors import InvalidRequestError
from ipc.codec import DecodeError, decode, encode
from ipc.messages import AddRequest
from ipc.sampling_params import SamplingParams

MAX_N = 128  # choices per prompt: each one is a full engine request


def check_request(prompt_token_ids: list[int], params: SamplingParams, n: int, *, vocab_size: int,
                  max_model_len: int) -> SamplingParams:
    """Raise InvalidRequestError, or return `params` with max_tokens resolved for this prompt."""
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n!r}")
    # Choice j samples with seed + j: the last seed must be valid too.
    last_seed = None if params.seed is None else params.seed + n - 1
    try:
        params.validate(vocab_size=vocab_size)
        replace(params, seed=last_seed).validate()
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(str(e)) from None
    # The core drops a message it cannot decode without knowing whose it was, and the
    # request would hang: so anything the codec would refuse is refused here.
    try:
        decode(encode(AddRequest("check", [], replace(params, seed=last_seed))))
    except (DecodeError, TypeError, ValueError, OverflowError) as e:
        raise InvalidRequestError(f"invalid sampling parameters: {e}") from None
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty")
    if not all(type(t) is int and 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    if num_prompt_tokens >= max_model_len or num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            "the completion). Please reduce the length of the prompt or of max_tokens.")
    return replace(params, max_tokens=max_tokens)
