"""A step's encoder budget (vLLM's max_num_encoder_input_tokens): how far a prompt chunk may run
into a vision-language request's images.

An image costs its token range's length in the step whose chunk reaches its first token; a chunk
stops before the first image that would pass the step's budget. An image larger than the whole
budget still runs when nothing else has spent any of it, so every request makes progress. A chunk
that starts inside an image (the rest of one cut by an earlier chunk, or a prefix-cache hit that
ends inside it) costs nothing for it: the runner's encoder cache holds its output.

    images:   [ img0: 10..25 ]      [ img1: 40..55 ]        budget left: 20, none spent
    chunk 5..60 -> img0 costs 16 (fits), img1 would make 32 > 20: the chunk becomes 5..40
"""

from __future__ import annotations

from engine.core.request import Request


class EncoderBudget:
    def __init__(self, max_num_encoder_input_tokens: int) -> None:
        self.max_tokens = max_num_encoder_input_tokens
        self.num_used = 0

    def reset(self) -> None:
        """A new step: nothing spent."""
        self.num_used = 0

    def fit(self, request: Request, start: int, max_num_tokens: int) -> int:
        """How many of `request`'s tokens from `start` (at most `max_num_tokens`) this step takes."""
        end = min(request.num_tokens, start + max_num_tokens)
        cost = 0
        for image in request.images:
            if image.offset >= end:
                break
            if image.offset >= start:
                if self.num_used + cost + image.length > self.max_tokens and (self.num_used or cost):
                    end = image.offset
                    break
                cost += image.length
        self.num_used += cost
        return max(0, end - start)
