"""The one check of a request against the model that will run it: torch-free, written once.

`check_request` is what every entry point runs before a request may reach a tensor:
the frontend (HTTP and the local socket, turning a ValueError into a 400 or an error
output) and `EngineCore.add_request`, which both the offline `LLM` and the core's
socket go through, because anyone who can reach that socket can send a request.
The codec only types and bounds sizes; ranges and the model's own limits are here.
"""

from __future__ import annotations

from msgspec.structs import replace

from ipc.sampling_params import SamplingParams


MAX_N = 128  # choices per prompt: each one is a full engine request
PREDICTION_WITH_N = "prediction cannot be used with n > 1 (as OpenAI's Predicted Outputs)"


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  cap_max_tokens: bool = False, n: int = 1, is_pooling: bool = False) -> SamplingParams:
    """Raise ValueError naming what is wrong, or return `params` with max_tokens resolved
    for this prompt (None becomes "up to the context length").

    A max_tokens that runs past the context is an error (the server's 400, as OpenAI's),
    or with `cap_max_tokens` is cut to fit (the offline API, as vLLM's `LLM`). `n`: the
    frontend's choices per prompt, sampled with seeds seed, seed + 1, ..., seed + n - 1.
    `is_pooling`: an embedding request, which samples no token, so its prompt may fill the
    whole context (as vLLM's pooling models take it); its params are returned as they came."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be between 1 and {MAX_N}, got {n!r}")
    params.validate(vocab_size=vocab_size)
    if params.prediction_token_ids is not None:
        if n > 1:
            raise ValueError(PREDICTION_WITH_N)
        if len(params.prediction_token_ids) > max_model_len:
            raise ValueError(f"prediction is {len(params.prediction_token_ids)} tokens long, more than this "
                             f"model's maximum context length of {max_model_len} tokens")
    if n > 1 and params.seed is not None:
        replace(params, seed=params.seed + n - 1).validate()  # the last choice's seed must be valid too
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    # max() runs in C; a non-int id makes the type check below fail or max() raise TypeError.
    try:
        is_in_vocab = all(type(t) is int for t in prompt_token_ids) and 0 <= min(prompt_token_ids) \
            and max(prompt_token_ids) < vocab_size
    except TypeError:
        is_in_vocab = False
    if not is_in_vocab:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if is_pooling:
        if num_prompt_tokens > max_model_len:
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, the input "
                             f"is {num_prompt_tokens} tokens. Please reduce the length of the input.")
        return params
    max_tokens = params.max_tokens
    if max_tokens is None or (cap_max_tokens and num_prompt_tokens + max_tokens > max_model_len):
        max_tokens = max_model_len - num_prompt_tokens
    if num_prompt_tokens >= max_model_len or num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            "the completion). Please reduce the length of the prompt or of max_tokens.")
    return params if params.max_tokens == max_tokens else replace(params, max_tokens=max_tokens)
