"""Speculative decoding's configuration, in vLLM's names: `--speculative-config '{"method": "ngram", ...}'`.

It travels in the engine config as JSON text (the flag's value), so the frontend can pass it on to
the cores it starts untouched; `SpeculativeConfig.parse` checks it once, naming the bad field.
No torch here: the frontend validates it too.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft", "model": "self-int4", "num_speculative_tokens": 4}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ipc.bounded_json import loads_bounded

SPEC_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
MAX_CONFIG_BYTES = 4096  # five short fields
SELF_INT4 = "self-int4"  # the draft model: the served checkpoint, quantized to int4 by our own kernels
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # the most tokens proposed per request per step (the engine may propose fewer)
    prompt_lookup_min: int = 1  # ngram: the shortest suffix of the sequence looked up
    prompt_lookup_max: int = 4  # ngram: the longest, tried first
    model: str | None = None  # draft: a folder, or "self-int4"

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """The config of a flag's JSON text or a dict (`LLM(speculative_config={...})`); None for none.
        Raises ValueError naming the bad field."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = loads_bounded(value, "speculative_config", max_bytes=MAX_CONFIG_BYTES)
            except ValueError as e:  # not JSON, or past the bounds: say what the flag wants
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {list(_FIELDS)}")
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {method!r}")
        num = value.get("num_speculative_tokens")
        if not _is_int(num) or not 1 <= num <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {num!r}")
        lookup_min, lookup_max = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max", 4)
        for name, n in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if not _is_int(n) or not 1 <= n <= 64:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, 64], got {n!r}")
        if lookup_min > lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max")
        model = value.get("model")
        if method == "draft" and not (isinstance(model, str) and model):
            raise ValueError(f'speculative_config.model is required for method "draft" (a folder or "{SELF_INT4}")')
        if method == "ngram" and model is not None:
            raise ValueError('speculative_config.model applies to method "draft" only')
        return cls(method, num, lookup_min, lookup_max, model)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
