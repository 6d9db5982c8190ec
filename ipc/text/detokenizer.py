"""Incremental detokenization: token ids in, final text deltas out.

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

import logging

logger = logging.getLogger(__name__)

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
