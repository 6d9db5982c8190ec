"""The one output path: engine `RequestOutput`s in, per-request text deltas out.

Both consumers of an engine core go through here: the server's
`frontend.engine_client.AsyncEngineClient` (each `EngineOutputs` message) and the
offline `engine.llm.LLM` (each `EngineCore.step()`). Per request it keeps a
`TextStream` (incremental detokenizer + stop checker: one sequence's text as its tokens
arrive, final deltas cut at stop strings) and the usage counts, so both paths make the
same text, hold back the same characters and cut at the same stop string. Like vLLM V1's
`OutputProcessor.process_outputs`, a step's outputs come back as deltas plus the request
ids the engine must abort: a stop string ended them here while the core was still
generating them.

A request is forgotten as soon as a delta finishes it (or `remove_requests` says it
ended elsewhere); later outputs for it, such as its abort's, are dropped. The
consumer keeps its own queues, timings and metrics: this is only the text logic.

Incremental detokenization (`IncrementalDetokenizer`): token ids in, final text deltas out.

Decoding the whole sequence after every token costs O(length) per token, and
decoding each token alone is wrong: byte-level BPE splits one character over
several tokens, and SentencePiece-style decoders strip the leading space of
whatever token comes first. So, like vLLM's `detokenize_incrementally` and
SGLang's `DecodeStatus`, we decode a small window twice and take the string
difference:

    ids:   ... | prefix window |  read window  |
               ^prefix_offset  ^read_offset    ^len(ids)
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    delta       = full_text[len(prefix_text):]

The prefix window gives the decoder context (so spaces are neither dropped nor
added) and always starts where earlier text was complete. When `delta` ends in
U+FFFD a character is still incomplete: we send what comes before it (counting
it in `_num_sent_chars`, SGLang's sent offset) and keep the offsets until a
later token completes it. A sequence that ends mid-character drops it.

One known gap: a Llama-style ByteFallback decoder turns a whole run of <0xXX>
tokens into U+FFFDs if the run ends incomplete, so a stream cut mid-character
can differ from a full decode in characters that were already complete (and
sent). Complete text always matches.

The tokenizer only needs `decode(ids, skip_special_tokens=...)`; this module
imports nothing heavy (neither ipc nor the frontend may import torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from ipc.messages import FinishReason, RequestOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams
from ipc.text.stop_checker import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class RequestDelta:
    """What one engine step added to one request (one choice of an HTTP request)."""

    index: int  # the consumer's tag: the choice of an n > 1 request, the offline prompt's position
    text: str  # final text only: never retracted later
    token_ids: list[int]
    finish_reason: FinishReason | None  # a stop-string hit reads STOP
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, for usage
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    request_id: str = ""
    # The engine's record this delta came from: read any field not copied above here
    # (stop_token_id, and whatever later fields RequestOutput grows).
    output: RequestOutput | None = None


@dataclass
class ProcessedOutputs:
    """One step's result: deltas in output order, and what the engine must be told."""

    deltas: list[RequestDelta] = field(default_factory=list)
    # Ended here (a stop string, a failure) while the engine is still generating them.
    request_ids_to_abort: list[str] = field(default_factory=list)
    # Detokenizing raised (logged): these got no delta, are forgotten, and should fail.
    failed_request_ids: list[str] = field(default_factory=list)


REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first output token (vLLM uses 5).
NUM_PROMPT_CONTEXT_TOKENS = 5
# Tokens that decode to nothing (skipped special tokens) keep the window open so
# the next token still has real text before it; past this many we move on anyway
# so the cost per token stays bounded.
MAX_WINDOW_TOKENS = 64


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of final text deltas."""

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's tail is needed, as context for the first output token.
        context_ids = list(prompt_token_ids or [])[-NUM_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context_ids
        self._prefix_offset = 0
        self._read_offset = len(context_ids)
        # Characters of the current delta already sent while its tail was incomplete.
        self._num_sent_chars = 0

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append new token ids; return the text that became final."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        delta = self._pending_delta()
        num_window_ids = len(self._ids) - self._prefix_offset
        if delta.endswith(REPLACEMENT_CHAR):
            # Incomplete character at the end: send only what comes before it.
            # Everything before the trailing U+FFFD run cannot change any more.
            return self._send(delta.rstrip(REPLACEMENT_CHAR))
        if not delta and num_window_ids <= MAX_WINDOW_TOKENS:
            # Nothing visible (e.g. a skipped special token): keep the prefix so
            # the next token is decoded after real text, not at a window start
            # where a SentencePiece decoder would strip its leading space.
            return ""
        out = self._send(delta)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._num_sent_chars = 0
        return out

    def flush(self) -> str:
        """Return any held-back text at the end of the sequence. A character left
        incomplete (the last token was cut mid-character, e.g. by max_tokens) is
        dropped rather than shown as U+FFFD, as vLLM does; token ids still report it."""
        out = self._send(self._pending_delta().rstrip(REPLACEMENT_CHAR))
        if out:
            logger.debug("flushed %d held-back chars", len(out))
        self._prefix_offset = self._read_offset = len(self._ids)
        self._num_sent_chars = 0
        return out

    def _pending_delta(self) -> str:
        """Text of the read window, decoded with the prefix window as context."""
        window_ids = self._ids[self._prefix_offset:]
        num_prefix_ids = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window_ids[:num_prefix_ids]) if num_prefix_ids else ""
        full_text = self._decode(window_ids)
        if not full_text.startswith(prefix_text):
            # Only happens with decoders that rewrite earlier text (e.g.
            # clean_up_tokenization_spaces); sent text cannot be taken back.
            logger.debug("window decode changed its prefix: %r -> %r", prefix_text, full_text)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _send(self, delta: str) -> str:
        """Return the unsent part of `delta` and record it as sent."""
        out = delta[self._num_sent_chars:]
        self._num_sent_chars = max(self._num_sent_chars, len(delta))
        return out


class TextStream:
    """Token ids in, text that will never be retracted out; reports a stop-string hit."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        # None without stop strings: nothing to hold back or cut (ipc.text.stop_checker)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output) if any(params.stop) else None

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
        if self.stop_checker is None:
            return text, False
        text, hit_stop = self.stop_checker.process(text)
        if is_last and not hit_stop:
            text += self.stop_checker.flush()
        return text, hit_stop


class _RequestText:
    """One request's text state: its TextStream (None: token ids only) and usage counts."""

    def __init__(self, request_id: str, index: int, num_prompt_tokens: int, text_stream: TextStream | None):
        self.request_id = request_id
        self.index = index
        self.num_prompt_tokens = num_prompt_tokens
        self.text_stream = text_stream
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def make_delta(self, output: RequestOutput) -> RequestDelta:
        token_ids = output.new_token_ids
        logprobs = output.new_logprobs
        # Kept from the first output on: a later one (an abort) may not carry it.
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        finish_reason = output.finish_reason
        text = ""
        if self.text_stream is not None:
            text, num_kept, hit_stop = self._add_tokens(token_ids, output)
            if hit_stop:
                finish_reason = FinishReason.STOP
                token_ids = token_ids[:num_kept]
                logprobs = logprobs[:num_kept] if logprobs is not None else None
        self.num_output_tokens += len(token_ids)
        return RequestDelta(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            request_id=self.request_id,
            output=output,
        )

    def _add_tokens(self, token_ids: list[int], output: RequestOutput) -> tuple[str, int, bool]:
        """(the text that became final, how many of the step's tokens stand, whether a stop string
        was hit). A step may bring several tokens (speculative decoding): they go in one at a time,
        so a stop string found at one of them drops those after it, as if each had come alone."""
        is_last = output.finish_reason is not None
        text = ""
        for i, token_id in enumerate(token_ids):
            is_final = i == len(token_ids) - 1
            piece, hit_stop = self.text_stream.add_tokens([token_id], is_last=is_last and is_final,
                                                          stop_token_id=output.stop_token_id if is_final else None)
            text += piece
            if hit_stop:
                return text, i + 1, True
        if not token_ids:  # a finish without tokens (an abort) still flushes what was held back
            text, hit_stop = self.text_stream.add_tokens([], is_last=is_last, stop_token_id=output.stop_token_id)
            return text, 0, hit_stop
        return text, len(token_ids), False


class OutputProcessor:
    """Owns every live request's text state; `process_outputs` turns a step into deltas.

    `tokenizer`: anything with `decode(ids, skip_special_tokens=...)` (the shared
    `ipc.text.tokenizer.Tokenizer`); None makes token-id-only deltas (text "")."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    index: int = 0) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer")
        text_stream = None if self.tokenizer is None else TextStream(self.tokenizer, prompt_token_ids, params)
        self._requests[request_id] = _RequestText(request_id, index, len(prompt_token_ids), text_stream)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests that ended elsewhere (aborted, failed); unknown ids are ignored."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process_outputs(self, outputs: Iterable[RequestOutput]) -> ProcessedOutputs:
        """Turn one engine step's outputs into text deltas; outputs of unknown requests are dropped."""
        processed = ProcessedOutputs()
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue  # finished here already (stop string, abort): a late output
            try:
                delta = request.make_delta(output)
            except Exception:
                logger.exception("detokenizing request %s failed", output.request_id)
                del self._requests[output.request_id]
                processed.failed_request_ids.append(output.request_id)
                if output.finish_reason is None:
                    processed.request_ids_to_abort.append(output.request_id)
                continue
            processed.deltas.append(delta)
            if delta.finish_reason is not None:
                del self._requests[output.request_id]
                if output.finish_reason is None:  # a stop string: the engine is still generating it
                    processed.request_ids_to_abort.append(output.request_id)
        return processed
