"""Tests for frontend.tool_parsers: Hermes/Qwen and Llama 3 JSON tool calls, and grammar-forced call streams.

The outputs below are written the way those models write them. Each is parsed
whole (`extract`) and streamed split at every point, one character at a time,
and at random points; the streamed content and calls must equal the whole ones.
"""

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from frontend.tool_parsers import (TOOL_PARSER_NAMES, ForcedToolCallStream, HermesToolParser, Llama3JsonToolParser,
                                   ToolCallDelta, calls_from_deltas, get_tool_parser, make_tool_call_id, merge_call_deltas,
                                   parse_forced_tool_calls)
from tests.helpers import REPO_ROOT

WEATHER_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_TOKYO = '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}'

# (model output, expected content, expected [(name, arguments)])
HERMES_CASES = [
    (f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (f"I'll check both cities for you.\n\n<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n<tool_call>\n{WEATHER_TOKYO}"
     "\n</tool_call>", "I'll check both cities for you.\n\n",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("get_weather", '{"city": "Tokyo", "unit": "celsius"}')]),
    ('<tool_call>\n{"name": "search", "arguments": {"query": "天气 São Paulo ☀️", "city": "M\\u00fcnchen"}}'
     '\n</tool_call>', None, [("search", '{"query": "天气 São Paulo ☀️", "city": "München"}')]),
    ('<tool_call>\n{"name":"get_time","arguments":{}}', None, [("get_time", "{}")]),  # unclosed, but whole JSON
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_', None, [("get_time", '{"tz": "UTC"}')]),
    (f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n\nThe tool will answer shortly.", "The tool will answer shortly.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('<tool_call>\n{"name": "echo", "arguments": {"text": "a } b { \\" c <tool_call>"}}\n</tool_call>', None,
     [("echo", '{"text": "a } b { \\" c <tool_call>"}')]),
    ("The capital of France is Paris. Use <b>tags</b> or a <tool", "The capital of France is Paris. Use <b>tags</b> or "
     "a <tool", []),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    "<tool_call>",
]
LLAMA_CASES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}; '
     '{"name": "get_time", "parameters": {"timezone": "America/Los_Angeles"}}', None,
     [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}'),
      ("get_time", '{"timezone": "America/Los_Angeles"}')]),
    ('\n {"type": "function", "name": "translate", "arguments": {"text": "Grüße, 世界 } {", "to": "ja"}};\n', None,
     [("translate", '{"text": "Grüße, 世界 } {", "to": "ja"}')]),
    ('{"name": "get_time", "parameters": {}} Hope this helps!', " Hope this helps!", [("get_time", "{}")]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  Sure! Here is JSON: {\"a\": 1}", "  Sure! Here is JSON: {\"a\": 1}", []),
    ("<|python_tag|>", "<|python_tag|>", []),
]
LLAMA_MALFORMED = [
    '{"city": "Paris", "unit": "celsius"}',  # JSON, not a call
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',  # cut short
    '{"name": "get_weather", "parameters": {"city": "Paris"}',
    '<|python_tag|>get_weather(city="Paris")',
]


def stream(parser, pieces):
    """Feed the pieces, finish; return (content or None, [(name, arguments)], all deltas)."""
    contents, deltas = [], []
    for piece in pieces:
        content, new = parser.feed(piece)
        contents.append(content)
        deltas += new
    content, new = parser.finish()
    contents.append(content)
    deltas += new
    return "".join(contents) or None, [(c.name, c.arguments) for c in calls_from_deltas(deltas)], deltas


def splits(text):
    """Every way to cut the text in two, and one character at a time."""
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)


def check_every_split(parser_type, text, content, calls):
    whole_content, whole_calls = parser_type().extract(text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    for pieces in splits(text):
        parser = parser_type()
        got_content, got_calls, deltas = stream(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        assert parser.has_tool_calls == bool(calls)
        check_delta_shapes(deltas)


def check_delta_shapes(deltas):
    """Each call's first delta is its head (id, name, empty arguments); the later ones carry arguments only."""
    seen = set()
    for delta in deltas:
        chunk = delta.to_openai()
        if delta.index in seen:
            assert chunk == {"index": delta.index, "function": {"arguments": delta.arguments}}
        else:
            seen.add(delta.index)
            assert chunk == {"index": delta.index, "id": delta.id, "type": "function",
                             "function": {"name": delta.name, "arguments": ""}}
            assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", delta.id)
    assert sorted(seen) == list(range(len(seen)))


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes(text, content, calls):
    check_every_split(HermesToolParser, text, content, calls)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_call_stays_content(text):
    check_every_split(HermesToolParser, text, text, [])


def test_hermes_good_call_stands_when_a_later_one_is_malformed():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {]}\n</tool_call>'
    text = f"<tool_call>\n{WEATHER_PARIS}\n</tool_call>\n{bad}"
    check_every_split(HermesToolParser, text, bad, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])


def test_hermes_holds_back_a_possible_marker_and_never_retracts():
    parser = HermesToolParser()
    assert parser.feed("Let me check. <tool") == ("Let me check. ", [])
    assert parser.feed("_call>\n{\"name\": \"get_time\", ") == ("", [])
    content, deltas = parser.feed('"arguments": {}}\n</tool_call>')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, "{}")]
    assert parser.feed("\n") == ("", [])
    assert parser.finish() == ("", []) and parser.has_tool_calls
    parser = HermesToolParser()
    assert parser.feed("a <to") == ("a ", []) and parser.feed("y>") == ("<toy>", [])


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    check_every_split(Llama3JsonToolParser, text, content, calls)


@pytest.mark.parametrize("text", LLAMA_MALFORMED)
def test_llama3_json_malformed_call_stays_content(text):
    check_every_split(Llama3JsonToolParser, text, text, [])


def test_llama3_json_streams_prose_at_once_and_buffers_calls():
    parser = Llama3JsonToolParser()
    assert parser.feed("  ") == ("", [])
    assert parser.feed("Hello") == ("  Hello", [])
    assert parser.feed(" {") == (" {", []) and not parser.has_tool_calls
    parser = Llama3JsonToolParser()
    assert parser.feed("<|python") == ("", [])
    assert parser.feed('_tag|>{"name": "get_time", "parameters": {"tz"') == ("", [])
    content, deltas = parser.feed(': "UTC"}}; {"name": "get_date"')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"tz": "UTC"}')]
    assert parser.feed(', "parameters": {}}')[1][0].index == 1
    assert parser.finish() == ("", []) and parser.num_calls == 2


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</tool", "\n", " ", "Hi", "<", "{", "}", ";", '"',
             WEATHER_PARIS, '{"name": "f"}', "<|python_tag|>", "<|py", '{"name": "g", "parameters": {"x": [1, "}"]}}']


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TOOL_PARSER_NAMES), st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.data())
def test_streaming_equals_extract_for_any_text_and_split(name, fragments, data):
    parser_type = get_tool_parser(name)
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content, calls = parser_type().extract(text)
    got_content, got_calls, deltas = stream(parser_type(), pieces)
    assert (got_content, got_calls) == (content, [(c.name, c.arguments) for c in calls])
    check_delta_shapes(deltas)
    if not calls:
        assert content == (text or None)


def forced_stream(function_name, pieces):
    parser = ForcedToolCallStream(function_name)
    _, _, deltas = stream(parser, pieces)
    check_delta_shapes(deltas)
    return deltas


def test_forced_named_function_streams_the_arguments_as_they_come():
    text = ' \n{"location": "Paris, France", "unit": "celsius", "note": "  ça va  "}\n '
    for pieces in splits(text):
        deltas = forced_stream("get_weather", pieces)
        (call,) = calls_from_deltas(deltas)
        assert (call.name, call.arguments) == ("get_weather", text.strip())
    parser = ForcedToolCallStream("get_weather")
    head, piece = parser.feed('{"loc')[1]
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert piece == ToolCallDelta(0, None, None, '{"loc')
    (call,) = parse_forced_tool_calls(text, "get_weather")
    assert (call.name, call.arguments) == ("get_weather", text.strip()) and parser.extract(text)[0] is None


REQUIRED_CASES = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]',
    json.dumps([{"name": "search", "parameters": {"q": "天气 \"quoted\" } {", "filters": [1, 2.5, None, True, {}]}}],
               indent=2, ensure_ascii=False),
    '[ {"name" : "get_time" , "parameters" : {} } ,{"name":"no_args"} ]',
    '[{"name": "scalar", "parameters": 42}, {"parameters": {"a": "b"}, "name": "args_first"}]',
]


@pytest.mark.parametrize("text", REQUIRED_CASES)
def test_forced_required_streams_each_parameters_value(text):
    elements = json.loads(text)
    expected = [(e["name"], e.get("parameters", {})) for e in elements]
    whole = parse_forced_tool_calls(text, None)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == expected
    for pieces in splits(text):
        calls = calls_from_deltas(forced_stream(None, pieces))
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole], pieces


def test_forced_required_emits_the_head_when_the_name_closes():
    parser = ForcedToolCallStream(None)
    assert parser.feed('[{"name": "get_wea') == ("", [])
    (head,) = parser.feed('ther"')[1]
    assert (head.index, head.name) == (0, "get_weather")
    assert [d.arguments for d in parser.feed(', "parameters": {"ci')[1]] == ['{"ci']
    assert [d.arguments for d in parser.feed('ty": "Paris"} }, {"name": "f", "parameters": {')[1]] == \
        ['ty": "Paris"}', "", "{"]
    assert parser.num_calls == 2


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=10), st.dictionaries(st.text(max_size=5), json_values,
                                                                              max_size=4)), max_size=3),
       st.sampled_from([None, 1, 2]), st.booleans(), st.data())
def test_forced_required_any_arguments_any_split(elements, indent, ensure_ascii, data):
    text = json.dumps([{"name": n, "parameters": p} for n, p in elements], indent=indent, ensure_ascii=ensure_ascii)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    calls = calls_from_deltas(forced_stream(None, pieces))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == elements
    if indent is None:
        assert [c.arguments for c in calls] == [json.dumps(p, ensure_ascii=ensure_ascii) for _, p in elements]


def test_registry_and_ids():
    assert get_tool_parser("hermes") is HermesToolParser and get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", make_tool_call_id())
    assert make_tool_call_id() != make_tool_call_id()
    (call,) = HermesToolParser().extract(f"<tool_call>{WEATHER_PARIS}</tool_call>")[1]
    arguments = '{"city": "Paris", "unit": "celsius"}'
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": arguments}}


def test_import_keeps_torch_out():
    code = ("import sys, frontend.tool_parsers; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_chunk_carries_one_entry_per_call():
    """A call's head and its argument pieces in one chunk merge; another call stays its own entry."""
    deltas = [ToolCallDelta(0, "id-0", "get_weather", ""), ToolCallDelta(0, None, None, '{"city": '),
              ToolCallDelta(0, None, None, '"Paris"}'), ToolCallDelta(1, "id-1", "get_time", "{}")]
    merged = merge_call_deltas(deltas)
    assert [d.to_openai() for d in merged] == [
        {"index": 0, "id": "id-0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"index": 1, "id": "id-1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert merge_call_deltas([ToolCallDelta(0, None, None, "a"), ToolCallDelta(0, None, None, "b")]) == \
        [ToolCallDelta(0, None, None, "ab")]
    assert calls_from_deltas(merged) == calls_from_deltas(deltas)
