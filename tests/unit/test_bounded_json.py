"""ipc.bounded_json: the one parse of JSON text a client sends, and the parsers that use it
(structured outputs, the speculative config, the tool parsers on a model's own output)."""

from __future__ import annotations

import json

import pytest

from frontend.tool_parsers.base import parse_function_json
from frontend.tool_parsers.forced import parse_forced_tool_calls
from ipc.bounded_json import (MAX_JSON_DEPTH, JSONTooDeepError, JSONTooLargeError, check_bounds, loads_bounded,
                              nesting_depth)
from ipc.speculative_config import SpeculativeConfig
from ipc.structured_outputs import StructuredOutputsParams

DEEP = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize(("text", "depth"), [
    ("5", 0), ('"[[["', 0), ("[]", 1), ('{"a": [1, {"b": "]]]}"}]}', 3), ('["\\"[", [[]]]', 3), (DEEP, 50_000),
])
def test_nesting_depth_counts_brackets_outside_strings(text, depth):
    assert nesting_depth(text) == depth


def test_loads_bounded_parses_what_json_loads_parses():
    text = json.dumps({"a": [1, 2.5, None, True, "x]}"], "b": {"c": "é"}})
    assert loads_bounded(text, "x") == json.loads(text)
    assert loads_bounded(text.encode(), "x") == json.loads(text)
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_bounded(nested, "x") == json.loads(nested)


def test_each_failure_is_a_value_error_naming_the_field():
    with pytest.raises(JSONTooDeepError, match=r"^arguments nests arrays and objects 50000 levels deep"):
        loads_bounded(DEEP, "arguments")
    too_deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(JSONTooDeepError):
        loads_bounded(too_deep, "x")
    with pytest.raises(JSONTooLargeError, match="^x is 2000002 bytes"):
        loads_bounded('"' + "a" * 2_000_000 + '"', "x")
    with pytest.raises(JSONTooLargeError):
        check_bounds("[1, 2]", "x", max_bytes=3)
    with pytest.raises(ValueError, match="^x is not valid JSON"):
        loads_bounded("{nope", "x")
    with pytest.raises(ValueError, match="^x is not valid UTF-8"):
        loads_bounded(b"\xff", "x")
    # Unbalanced brackets behind a valid prefix: json.loads would recurse here too.
    with pytest.raises(JSONTooDeepError):
        loads_bounded("[" * 5000, "x")


def test_structured_outputs_and_speculative_config_refuse_deep_json_as_value_errors():
    with pytest.raises(ValueError, match="structured_outputs.json nests"):
        StructuredOutputsParams(json=DEEP).validate()
    with pytest.raises(ValueError, match="speculative_config nests"):
        SpeculativeConfig.parse("[" * 1500 + "]" * 1500)
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        SpeculativeConfig.parse("{")
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2


def test_tool_parsers_take_a_deep_answer_as_malformed_not_as_a_crash():
    assert parse_function_json('{"name": "f", "arguments": ' + DEEP + "}") is None
    assert parse_function_json('{"name": "f", "arguments": "' + DEEP + '"}') is None
    assert parse_function_json('{"name": "f", "arguments": {"x": 1}}') == ("f", '{"x": 1}')
    parse_forced_tool_calls("[" + DEEP, None)  # logs "not a whole JSON array", returns what it could read
