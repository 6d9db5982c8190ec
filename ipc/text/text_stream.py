"""One sequence's output text as its tokens arrive: final text deltas, cut at stop strings.

`ipc.text.output_processor.OutputProcessor` keeps one per request and feeds it
each engine step's new token ids, for the server and the offline API alike, so a
prompt gets the same text, the same held-back characters and the same stop-string
cut on either path.
"""

from __future__ import annotations

from ipc.sampling_params import SamplingParams
from ipc.text.detokenizer import IncrementalDetokenizer
from ipc.text.stop_checker import StopChecker


class TextStream:
    """Token ids in, text that will never be retracted out; reports a stop-string hit."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)

    def add_tokens(self, token_ids: list[int], *, is_last: bool, stop_token_id: int | None = None) -> tuple[str, bool]:
        """Return (text that became final, whether a stop string was hit).

        `is_last`: the engine finished the sequence, so held-back text is flushed.
        `stop_token_id`: the stop token that ended it, if any.
        """
        text_ids = token_ids
        if stop_token_id is not None and token_ids and token_ids[-1] == stop_token_id \
                and not self.include_stop_str_in_output:
            text_ids = token_ids[:-1]  # like vLLM: a stop token ends the text, it is not part of it
        text = self.detokenizer.add_tokens(text_ids)
        if is_last:
            text += self.detokenizer.flush()
        text, hit_stop = self.stop_checker.process(text)
        if is_last and not hit_stop:
            text += self.stop_checker.flush()
        return text, hit_stop
