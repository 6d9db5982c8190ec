"""Predicted Outputs' proposals: the client's expected text (`prediction_token_ids`) as the draft.

The prediction is consumed in order while the output follows it. Once the output diverges (an
edit), the request looks up its output's last n tokens in the prediction and, where they occur,
follows the prediction from there again:

    prediction   A B C D E F G H
    output       A B C X D E ...     X diverged; "X D" is not in the prediction, "D" is:
                                      re-synced after D, propose E F G H

The state (where the output stands in the prediction) lives on the request: the prediction and
the request's tokens never change, so it survives preemption.
"""

from __future__ import annotations

from engine.request import Request
from engine.spec_decode.ngram_proposer import find_after

LOOKUP_MAX = 4  # the longest output suffix looked up in the prediction after a divergence
LOOKUP_MIN = 2  # a single token re-syncs too eagerly (" the", ",") and wastes verification rows


class PredictionState:
    def __init__(self) -> None:
        self.position: int | None = 0  # the prediction token the next output token should equal; None: diverged
        self.num_output_tokens = 0  # output tokens already followed


def propose_prediction(request: Request, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens of the request's prediction that should come next."""
    prediction = request.sampling_params.prediction_token_ids
    state = request.prediction_state
    if state is None:
        state = request.prediction_state = PredictionState()
    output = request.output_token_ids
    for token_id in output[state.num_output_tokens :]:
        if state.position is not None and state.position < len(prediction) and prediction[state.position] == token_id:
            state.position += 1
        else:
            state.position = None
    state.num_output_tokens = len(output)
    if state.position is None:
        state.position = _resync(prediction, output)
    if state.position is None:
        return []
    return prediction[state.position : state.position + num_tokens]


def _resync(prediction: list[int], output: list[int]) -> int | None:
    """Where the prediction continues after the output's last tokens, longest suffix first."""
    for n in range(min(LOOKUP_MAX, len(output)), LOOKUP_MIN - 1, -1):
        position = find_after(prediction, output[-n:])
        if position is not None:
            return position
    return None
