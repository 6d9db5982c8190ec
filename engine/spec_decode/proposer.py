"""Which running requests get proposed tokens for the next step, how many, and from what.

After each step the engine core asks `SpecProposer.propose` to fill `Request.spec_token_ids` for
the requests that are decoding. A request with a prediction (OpenAI's Predicted Outputs) drafts
from it, with or without --speculative-config; otherwise the configured method (n-gram lookup).

How many (k) adapts twice:
- to the batch: a step's verification rows are nearly free while the step is bound by reading the
  weights, not once it is bound by computing them. The proposals of one step share
  `SPEC_STEP_TOKENS` tokens: one user may propose up to its full k, 4 users about 5 each, and from
  `SPEC_STEP_TOKENS` decoding requests on, none: batched throughput is what it was without.
- to the request: an exponential average of how many of its proposed tokens were accepted; k is that
  plus 4 (so it can grow back), within the configured k.

Not speculated (speculation off for the row, output unchanged): rows whose logits depend on the
tokens before each position (penalties, logit_bias, allowed_token_ids, bad words, a grammar, and
min_tokens still banning the stop tokens). Verification scores every proposed position with the
same sampling parameters, which would be wrong for those; running the logits pipeline once per
proposed position would cost more than the proposal saves at these batch sizes.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.spec_decode.ngram_proposer import propose_ngram
from engine.spec_decode.prediction_proposer import propose_prediction
from ipc.messages import SpecMethod
from ipc.speculative_config import SpeculativeConfig

SPEC_STEP_TOKENS = 24  # a step's tokens (decodes and proposals) below which the CPU step stays weight-bound
PREDICTION_MAX_TOKENS = 16  # k for a prediction without --speculative-config (the configurable maximum)
# k is the average accepted count plus this, so it can grow back. Rows past the average cost
# little beside a step's weight reads, and a copy that resumes after a miss runs long: +4 beat +2
# by 8-15% one user and 4 users on AMX (docs/speculative-decoding.md#figures), and +16 lost.
EMA_HEADROOM = 4


class SpecProposer:
    def __init__(self, config: SpeculativeConfig | None, max_model_len: int, draft=None) -> None:
        """`draft`: the DraftModelProposer (engine.spec_decode.draft_proposer) for method "draft"."""
        if config is not None and config.method == "draft" and draft is None:
            raise ValueError('speculative_config.method "draft" needs its draft model loaded')
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` (and `spec_method`) on every running request; [] for those not speculated."""
        if self.draft is not None:
            self.draft.keep_only({r.request_id for r in running})  # finished, aborted or preempted: state dropped
        candidates = [r for r in running if self._can_speculate(r)]
        for request in running:
            request.spec_token_ids = []
        if not candidates:
            return
        num_per_request = SPEC_STEP_TOKENS // len(candidates) - 1  # the decode token itself counts
        if num_per_request <= 0:
            return
        drafted: list[tuple[Request, int]] = []  # the draft model proposes for these at once, batched
        for request in candidates:
            num_tokens = min(num_per_request, self._max_tokens(request), int(request.spec_ema) + EMA_HEADROOM,
                             request.max_tokens - request.num_output_tokens - 1,
                             self.max_model_len - request.num_tokens)
            if num_tokens <= 0:
                continue
            if request.sampling_params.prediction_token_ids:
                request.spec_token_ids, request.spec_method = propose_prediction(request, num_tokens)
                if request.spec_token_ids or self.draft is None:
                    continue
            if self.draft is not None:
                drafted.append((request, num_tokens))
            else:
                config = self.config
                request.spec_token_ids = propose_ngram(request.all_token_ids, num_tokens, config.prompt_lookup_min,
                                                       config.prompt_lookup_max)
                request.spec_method = SpecMethod.NGRAM
        if drafted:
            proposals = self.draft.propose([r for r, _ in drafted], [n for _, n in drafted])
            for (request, _), token_ids in zip(drafted, proposals):
                request.spec_token_ids, request.spec_method = token_ids, SpecMethod.DRAFT

    def _max_tokens(self, request: Request) -> int:
        if request.sampling_params.prediction_token_ids:
            return self.config.num_speculative_tokens if self.config is not None else PREDICTION_MAX_TOKENS
        return self.config.num_speculative_tokens

    def _can_speculate(self, request: Request) -> bool:
        params = request.sampling_params
        return (request.status == RequestStatus.RUNNING and request.pooling_params is None
                and (self.config is not None or bool(params.prediction_token_ids))
                and request.num_computed_tokens == request.num_tokens - 1  # decoding, not prefilling
                and not params.needs_logits_processing and request.num_output_tokens >= params.min_tokens)
