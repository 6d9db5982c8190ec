"""The frontend's check of a request before anything is sent: `n`, then the shared one.

Every value that will reach a tensor in the core is bounded by `ipc.request_checks`
(the same function the core runs at its socket), so a bad request gets a 400 here and
the core never sees it. What is only the frontend's concern, `n` and the seeds of the
n choices, is checked here.
"""

from __future__ import annotations

from msgspec.structs import replace

from frontend.errors import InvalidRequestError
from ipc import request_checks
from ipc.sampling_params import SamplingParams

MAX_N = 128  # choices per prompt: each one is a full engine request


def check_request(prompt_token_ids: list[int], params: SamplingParams, n: int, *, vocab_size: int,
                  max_model_len: int) -> SamplingParams:
    """Raise InvalidRequestError, or return `params` with max_tokens resolved for this prompt."""
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n!r}")
    try:
        resolved = request_checks.check_request(prompt_token_ids, params, vocab_size=vocab_size,
                                                max_model_len=max_model_len)
        if n > 1 and params.seed is not None:
            # Choice j samples with seed + j: the last seed must be valid too.
            replace(params, seed=params.seed + n - 1).validate()
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(str(e)) from None
    return resolved
