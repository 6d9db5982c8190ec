"""Predicted Outputs' proposals: the client's expected text (`prediction_token_ids`) as the draft.

The prediction is consumed in order while the output follows it. Once the output diverges (an
edit), the request looks up its output's last n tokens in the prediction and, where they occur,
follows the prediction from there again:

    prediction   A B C D E F G H
    output       A B C X D E ...     X diverged; "X D" is not in the prediction, "D" is:
                                      re-synced after D, propose E F G H

Where the output's suffix is not in the prediction past where the output last stood, but occurs
earlier in the request's own prompt or output, what followed it there is proposed instead (as
n-gram lookup, and counted as such: not as prediction tokens in the usage); _resync has the order.

The state (where the output stands in the prediction) lives on the request: the prediction and
the request's tokens never change, so it survives preemption.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.spec_decode.ngram_proposer import encode, find_after
from ipc.messages import SpecMethod

LOOKUP_MAX = 4  # the longest output suffix looked up in the prediction after a divergence
LOOKUP_MIN = 2  # a single token re-syncs too eagerly (" the", ",") and wastes verification rows


class PredictionState:
    def __init__(self) -> None:
        self.position: int | None = 0  # the prediction token the next output token should equal; None: diverged
        self.last_position = 0  # where the output last stood in the prediction: a resync looks after it first
        self.num_output_tokens = 0  # output tokens already followed


def propose_prediction(request: Request, num_tokens: int) -> tuple[list[int], SpecMethod]:
    """Up to `num_tokens` tokens that should come next, and where they came from: the prediction,
    or (diverged, and the prediction has no match) lookup over the request's own tokens."""
    prediction = request.sampling_params.prediction_token_ids
    state = request.prediction_state
    if state is None:
        state = request.prediction_state = PredictionState()
    output = request.output_token_ids
    for token_id in output[state.num_output_tokens :]:
        if state.position is not None and state.position < len(prediction) and prediction[state.position] == token_id:
            state.position += 1
            state.last_position = state.position
        else:
            state.position = None
    state.num_output_tokens = len(output)
    if state.position is None:
        token_ids = request.all_token_ids
        state.position, after = _resync(prediction, token_ids, len(output), state.last_position)
        if state.position is None:
            return token_ids[after : after + num_tokens] if after is not None else [], SpecMethod.NGRAM
    return prediction[state.position : state.position + num_tokens], SpecMethod.PREDICTION


def _resync(prediction: list[int], token_ids: list[int], num_output_tokens: int,
            last_position: int) -> tuple[int | None, int | None]:
    """Where to go on after the output's last tokens, longest suffix first. For each suffix: the
    prediction after where the output last stood (an edit resumes past itself); else what followed
    the suffix at its latest earlier occurrence in the request's own prompt or output (which an
    edit copies from too; a better guess, measured, than a match further back in the prediction);
    else the prediction's first match. -> (the prediction's position, or None and where in
    token_ids to go on from, or None twice)"""
    encoded_prediction, encoded_tokens = encode(prediction), encode(token_ids)  # once for every n tried
    for n in range(min(LOOKUP_MAX, num_output_tokens), LOOKUP_MIN - 1, -1):
        suffix = token_ids[-n:]
        position = find_after(prediction, suffix, start=last_position, encoded=encoded_prediction)
        if position is not None:
            return position, None
        after = find_after(token_ids, suffix, end=len(token_ids) - 1, last=True, encoded=encoded_tokens)
        if after is not None:
            return None, after
        position = find_after(prediction, suffix, encoded=encoded_prediction)
        if position is not None:
            return position, None
    return None, None
