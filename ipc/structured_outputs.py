"""What a constrained answer must look like: one record for the offline API, the wire and the engine.

In the style of vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON
schema, carried as its JSON text), `regex`, `choice`, `grammar` (EBNF, xgrammar's
dialect) or `json_object` (any JSON object) is set; `reasoning_end_token_ids` holds
the grammar back while a reasoning model thinks. The engine compiles it with
xgrammar and masks the logits with it every step; this file only types, bounds
and checks the shape, so it stays torch-free.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from msgspec import Meta, Struct

from ipc.bounded_json import loads_bounded

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema, regex or grammar: far above any real one, and a bounded compile
MAX_CHOICES = 256
MAX_CHOICE_LEN = 1024
MAX_REASONING_END_TOKENS = 16  # "</think>" is one token in reasoning models' vocabularies, a few elsewhere
MAX_TOKEN_ID = 2**31 - 1  # as ipc.sampling_params (which imports this file): ids index int32 tensors

GrammarText = Annotated[str, Meta(max_length=MAX_GRAMMAR_BYTES)]
Choice = Annotated[str, Meta(max_length=MAX_CHOICE_LEN)]
ReasoningEndTokenIds = Annotated[list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]],
                                 Meta(min_length=1, max_length=MAX_REASONING_END_TOKENS)]


class StructuredOutputsParams(Struct, array_like=True, forbid_unknown_fields=True):
    json: GrammarText | None = None  # a JSON schema's text (a dict given in Python is dumped)
    regex: GrammarText | None = None
    choice: Annotated[list[Choice], Meta(max_length=MAX_CHOICES)] | None = None
    grammar: GrammarText | None = None  # EBNF
    json_object: bool = False
    # Whitespace inside JSON as the model likes it (xgrammar's any_whitespace); False: one compact form.
    any_whitespace: bool = True
    # Appended (the wire is append-only). Set by a server with --reasoning-parser: the grammar
    # sleeps (no mask, the matcher unmoved) until the output's token ids end with these, the
    # end of the reasoning ("</think>"), and constrains from the next token on. None: from the first.
    reasoning_end_token_ids: ReasoningEndTokenIds | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            self.json = json.dumps(self.json, ensure_ascii=False)

    @property
    def kind(self) -> str:
        """Which form is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """Raise ValueError naming the problem. Whether xgrammar accepts the text is
        checked where xgrammar runs (the frontend's grammar checker, the engine's compiler)."""
        num_set = sum(getattr(self, name) is not None for name in ("json", "regex", "choice", "grammar"))
        num_set += bool(self.json_object)
        if num_set != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar "
                             f"and json_object, got {num_set}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if isinstance(value, str) and len(value.encode("utf-8")) > MAX_GRAMMAR_BYTES:
                raise ValueError(f"structured_outputs.{name} is over the limit of {MAX_GRAMMAR_BYTES} bytes")
        if self.json is not None:
            schema = _parse_json(self.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_LEN for c in self.choice):
                raise ValueError(f"each choice must be a non-empty string of at most {MAX_CHOICE_LEN} characters")
        for name in ("json_object", "any_whitespace"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"structured_outputs.{name} must be true or false")
        end_ids = self.reasoning_end_token_ids
        if end_ids is not None and (not isinstance(end_ids, list) or not 0 < len(end_ids) <= MAX_REASONING_END_TOKENS):
            raise ValueError("structured_outputs.reasoning_end_token_ids must be a list of 1 to "
                             f"{MAX_REASONING_END_TOKENS} token ids")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices, each written out as a JSON string
    literal (xgrammar's EBNF reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str | None]:
    """(kind, text): the one text xgrammar compiles for `params` (choices written as a grammar;
    None for json_object, xgrammar's built-in JSON grammar)."""
    kind = params.kind
    if kind == "choice":
        return kind, choice_grammar(params.choice)
    return kind, None if kind == "json_object" else getattr(params, kind)


def _parse_json(text: str) -> Any:
    return loads_bounded(text, "structured_outputs.json", max_bytes=MAX_GRAMMAR_BYTES)
