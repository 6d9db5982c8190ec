"""Sampling parameters: one record shared by the offline API, the wire and the engine.

Kept in `ipc` (no torch) so the frontend can validate requests and the engine can
re-export it as `engine.SamplingParams`. A msgspec Struct: the field types bound
what decodes off the wire (typed, sizes capped); `validate` checks the ranges,
also on params built in Python, which msgspec does not check.

`check_request` is the one check of a request against the model that will run it, written
once: every entry point runs it before a request may reach a tensor: the frontend (HTTP
and the local socket, turning a ValueError into a 400 or an error output) and
`EngineCore.add_request`, which both the offline `LLM` and the core's socket go through,
because anyone who can reach that socket can send a request. The codec only types and
bounds sizes; ranges and the model's own limits are here.
"""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta, Struct, field
from msgspec.structs import replace

from ipc.structured_outputs import StructuredOutputsParams

MAX_STOP_SEQUENCES = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit is 300
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI clamps biases to [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 262_144  # beyond any vocabulary in use
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64  # a bad word's tokens, per spelling
MAX_PENALTY = 2.0  # presence/frequency in [-2, 2] and repetition in (0, 2], as vLLM checks
MAX_PREDICTION_TOKENS = 262_144  # a prediction must fit the context anyway
MAX_INT = 2**31 - 1  # counts and token ids: far beyond any context length, and they fit int32 tensors
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # a signed 64-bit int on the wire
# Temperatures below this are greedy, as in vLLM: dividing logits by ~1e-40 overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5

# Wire types, shared with ipc.messages: what a decoded value can be at most.
MAX_TOKEN_ID = 2**31 - 1  # token ids index int32 tensors on the engine side
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Int64 = Annotated[int, Meta(ge=MIN_SEED, le=MAX_SEED)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_LEN)]
BadWordTokenIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]


class SamplingParams(Struct, array_like=True, forbid_unknown_fields=True):
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: Int64 = -1  # -1 (or 0) means all tokens
    min_p: float = 0.0
    seed: Int64 | None = None  # per-request generator: same seed, same tokens, in any batch
    max_tokens: Int64 | None = 16  # None: up to the model's max length
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = field(default_factory=list)
    # stop strings: the text is cut at the first (ipc.text.stop_checker.StopChecker)
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)] = field(default_factory=list)
    logprobs: Int64 | None = None  # None: no log-probs; N: chosen token plus top-N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Appended fields (the wire is append-only). Penalties as vLLM applies them: repetition over
    # the prompt's and the output's tokens, presence and frequency over the output's only.
    repetition_penalty: float = 1.0  # 1: off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # (token id, bias) pairs, added to the logits; a dict given in Python becomes pairs.
    logit_bias: Annotated[list[tuple[TokenId, float]], Meta(max_length=MAX_LOGIT_BIAS)] = field(default_factory=list)
    allowed_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # Words never to write: the strings (kept for the record) and their spellings as token ids,
    # which the frontend or the offline LLM fills in from the strings.
    bad_words: Annotated[list[StopString], Meta(max_length=MAX_BAD_WORDS)] = field(default_factory=list)
    bad_words_token_ids: Annotated[list[BadWordTokenIds], Meta(max_length=2 * MAX_BAD_WORDS)] = \
        field(default_factory=list)
    prompt_logprobs: Int64 | None = None  # None: none; N: each prompt token's log-prob plus top-N
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's Predicted Outputs: the text the client expects (the file being edited), as tokens. The
    # engine drafts from it while the output follows it (speculative decoding), then looks up n-grams in it.
    prediction_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PREDICTION_TOKENS)] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            self.logit_bias = sorted(self.logit_bias.items())

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_logits_processing(self) -> bool:
        """Whether anything beyond temperature and the filters touches this row's logits."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.structured_outputs is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message naming the bad field. With `vocab_size`, token ids
        must also be in the model's vocabulary: they index its logits."""
        # isfinite: NaN compares False with everything and would slip past `< 0`.
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer up to {MAX_INT}, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT):
            raise ValueError(f"max_tokens must be between 1 and {MAX_INT}, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT:
            raise ValueError(f"min_tokens must be between 0 and {MAX_INT}, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and 0 <= t <= MAX_INT for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got "
                             f"{max(self.stop_token_ids)}")
        if not isinstance(self.stop, list):
            raise ValueError("stop must be a list of strings")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"each stop sequence must be a non-empty string of at most {MAX_STOP_STRING_LEN} characters")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._validate_logits_processing(vocab_size)

    def _validate_logits_processing(self, vocab_size: int | None) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, list) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries")
        for entry in self.logit_bias:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not _is_int(entry[0]) \
                    or not _is_number(entry[1]) or not math.isfinite(entry[1]):
                raise ValueError("logit_bias must map token ids to finite numbers")
        _check_token_ids("logit_bias", [t for t, _ in self.logit_bias], vocab_size)
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids \
                    or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                                 "token ids")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS \
                or not all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_STRING_LEN for w in self.bad_words):
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORDS} non-empty strings of at most "
                             f"{MAX_STOP_STRING_LEN} characters")
        if not isinstance(self.bad_words_token_ids, list) or len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise ValueError("bad_words_token_ids must be a list of token-id lists")
        for ids in self.bad_words_token_ids:
            if not isinstance(ids, list) or not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens long")
            _check_token_ids("bad_words", ids, vocab_size)
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        if self.prediction_token_ids is not None:
            if not isinstance(self.prediction_token_ids, list) or len(self.prediction_token_ids) > MAX_PREDICTION_TOKENS:
                raise ValueError(f"prediction must be at most {MAX_PREDICTION_TOKENS} tokens")
            _check_token_ids("prediction", self.prediction_token_ids, vocab_size)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
            if self.structured_outputs.reasoning_end_token_ids is not None:
                _check_token_ids("structured_outputs.reasoning_end_token_ids",
                                 self.structured_outputs.reasoning_end_token_ids, vocab_size)


def tokenize_bad_words(words: list[str], encode) -> list[list[int]]:
    """vLLM's spellings of each bad word: as written and with a leading space (the word inside a
    sentence), each encoded without special tokens by `encode(text) -> token ids`."""
    spellings: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            token_ids = encode(prefix + word.lstrip())
            if token_ids and token_ids not in spellings:
                spellings.append(token_ids)
    return spellings


def clamp_logit_bias(value: float) -> float:
    """OpenAI's rule: biases beyond [-100, 100] act as the bound."""
    return max(-MAX_LOGIT_BIAS_VALUE, min(MAX_LOGIT_BIAS_VALUE, value))


def _check_token_ids(name: str, token_ids: list, vocab_size: int | None) -> None:
    limit = vocab_size if vocab_size is not None else MAX_INT + 1
    if not all(_is_int(t) and 0 <= t < limit for t in token_ids):
        raise ValueError(f"{name} must hold token ids in [0, {limit})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
