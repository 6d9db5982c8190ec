"""The values the field fuzzer (scripts/hostile/fuzz.py) sends: integers and floats at the model's
bounds, and for the newer fields values of their own kind (penalties, logit_bias, allowed and banned
ids, schemas, regexes and grammars, embeddings' input)."""

from __future__ import annotations

from dataclasses import dataclass

from scripts.hostile.client import Raw

MAX_GRAMMAR_BYTES = 256 * 1024  # ipc.structured_outputs: a schema, regex or grammar
MAX_ALLOWED_TOKEN_IDS = 262_144  # ipc.sampling_params: allowed_token_ids on the wire
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}


@dataclass(frozen=True)
class Big:
    """A value too long for the report: sent as `value`, shown as `label`."""

    label: str
    value: object


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def huge_schema() -> Big:
    properties = {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(MAX_GRAMMAR_BYTES // 100)}
    return Big(f"a schema over {MAX_GRAMMAR_BYTES} bytes", {"type": "object", "properties": properties})


def new_field_values(kind: str, vocab: int, quick: bool) -> list:
    """Values for the newer fields' kinds; [] for a kind that is not one of them."""
    over = MAX_GRAMMAR_BYTES + 1
    if kind == "bias":
        keys = [str(vocab), str(2**31), "-1", "abc", "1.5", ""] + ([] if quick else [str(2**64), " 5", "5" * 5000])
        return [{key: 1} for key in keys] + [
            Big("10000 entries", {str(i): 1 for i in range(10_000)}), {"5": 1, "05": 1}, [], "x"]
    if kind == "id_count":
        return [MAX_ALLOWED_TOKEN_IDS + 1]
    if kind == "words":
        values = [[""], ["x" * 300], Big("200 words", ["a"] * 200), Big("a word of 120 tokens", ["🌍" * 40]), [5]]
        return values + ([] if quick else ["abc", None, ["<|endoftext|>"], ["\u0000"], [" "]])
    if kind == "regex":
        values = ["a(b", "", "[", "(?<=a)b", "a{5,2}", Big(f"{over} bytes", "a" * over), 5]
        return values + ([] if quick else ["\u0000", "\\", "\\p{L}+", "a{1000}{1000}", "a{99999999}", None, [],
                                           Raw("NaN")])
    if kind == "grammar":
        values = ["root ::= foo", 'root ::= "a', "", 'x ::= "a"', Big(f"{over} bytes", 'root ::= "' + "a" * over + '"')]
        return values + ([] if quick else [5, None, 'root ::= "a"{99999999}', "root ::= root root | \"a\""])
    if kind == "choices":
        values = [[], [""], Big("300 choices", ["a"] * 300), Big("a choice of 2000 chars", ["x" * 2000])]
        return values + ([] if quick else [[5], "abc", None, ["\u0000"]])
    if kind == "schema":
        values = [{"type": "objectx"}, {"$ref": "#/nope"}, {"type": "string", "pattern": "a(b"},
                  {"type": "integer", "minimum": 5, "maximum": 2}, {"type": "integer", "minimum": 1e308},
                  {"type": "array", "minItems": 100_000}, "not json", huge_schema()]
        return values + ([] if quick else [{"$ref": "#"}, {"type": "number", "multipleOf": 0}, {"enum": []}, False,
                                           True, 5, [], None, Big("60 levels deep", deep_schema(60))])
    if kind == "structured":
        values = [{}, {"foo": "x"}, {"regex": "a", "choice": ["a"]}, {"json_object": False}]
        return values + ([] if quick else [{"json_object": "yes"}, "abc", [],
                                           {"regex": "a", "disable_any_whitespace": 5}])
    if kind == "format":
        values = [{"type": "yaml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}]
        return values + ([] if quick else [{"type": "json_object", "json_schema": 5}, {"type": "text"}, None])
    if kind == "tools":
        return [Big("200 tools", [TOOL] * 200), [], "x", [{"type": "function"}]] + (
            [] if quick else [[{"type": "function", "function": {"name": 5}}], None])
    if kind == "tool_choice":
        values = ["nonsense", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 5]
        return values + ([] if quick else ["auto", "none", "required", None])
    if kind == "embedding_input":  # empty, too many, too long, mixed kinds, not text at all
        return [[], "", [""], [[]], Big("10000 inputs", ["a"] * 10_000), Big("2049 inputs", ["a"] * 2049),
                Big("a text over the context", "hello " * 9000), Big("token ids over the context", [5] * 9000),
                ["a", 5], [5, "a"], [[5], "a"], [{"text": "a"}], [True], [None], 5, None, {"a": 1}]
    if kind == "prediction":  # OpenAI's Predicted Outputs: not text, the wrong type, over the context
        return [{"type": "content", "content": 5}, {"type": "text", "content": "a"}, {"type": "content"}, "abc", 5,
                {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"type": "content", "content": [5]}, {"type": "content", "content": "a", "extra": 1}, [], {},
                Big("a prediction over the context", {"type": "content", "content": "hello " * 9000})]
    if kind == "encoding":
        return ["int8", "", None, 5, ["float"], "FLOAT"]
    if kind == "bias_pairs":
        return [[[vocab, 1.0]], [[5, float("nan")]], [[5, float("inf")]], [[5, 1.0], [5, 2.0]], [[5]],
                Big("1025 pairs", [[i, 1.0] for i in range(1025)])]
    if kind == "id_lists":
        return [[[vocab]], [[]], Big("a word of 65 tokens", [[5] * 65]), [[2**31]]]
    if kind == "wire_structured":  # [json, regex, choice, grammar, json_object, any_whitespace]
        return [[None, "a(b", None, None, False, True], ['{"type": "objectx"}', None, None, None, False, True],
                [None, None, None, None, False, True], [None, "a", ["a"], None, False, True],
                [None, None, None, "root ::= foo", False, True], [None, None, [], None, False, True],
                Big(f"a regex of {over} bytes", [None, "a" * over, None, None, False, True])]
    return []


def int_values(vocab: int, max_len: int, quick: bool) -> list:
    if quick:
        return [vocab, max_len + 1, 2**31 - 1, 2**31, 2**63, 2**64, -1, 0, 1.5, "1", None]
    return [vocab - 1, vocab, max_len, max_len + 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -1, 0,
            -2**31 - 1, -2**63, -2**63 - 1, 1.5, 1e308, Raw("NaN"), Raw("Infinity"), "1", True, None, [], {}]


def float_values(quick: bool) -> list:
    if quick:
        return [1e-40, 5e-324, 1e308, -1.0, 2**64, Raw("1e400"), Raw("NaN"), Raw("-Infinity"), "x", None]
    return [0.0, -0.0, 1e-40, 5e-324, 1e308, -1e308, -1.0, 1.5, 1e40, 2**31, 2**63, 2**64, -1, Raw("1e400"),
            Raw("-1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), "0.5", True, None, [], {}]


def values_for(kind: str, vocab: int, max_len: int, quick: bool) -> list:
    if values := new_field_values(kind, vocab, quick):
        return values
    if kind == "float":
        return float_values(quick)
    values = int_values(vocab, max_len, quick)
    return [v for v in values if kind == "int" or not isinstance(v, (list, dict))]  # ids are list entries
