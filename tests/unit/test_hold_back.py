"""num_held_chars: the tail that may still grow into a marker is held, nothing else."""

import pytest

from ipc.text.hold_back import num_held_chars


@pytest.mark.parametrize("text, markers, expected", [
    ("answer: <tool", ["<tool_call>"], 5),
    ("answer: <", ["<tool_call>"], 1),
    ("answer.", ["<tool_call>"], 0),
    ("<tool_call>", ["<tool_call>"], 0),  # a whole marker is the caller's to find, not to hold
    ("x </thi", ["</think>"], 5),
    ("ab", ["abc", "bcd"], 2),  # the longest tail over all markers
    ("xb", ["abc", "bcd"], 1),
    ("END", ["EN", "ENDING"], 3),  # "END" begins "ENDING" though "EN" is shorter
    ("", ["<tool_call>"], 0),
    ("text", [], 0),
])
def test_num_held_chars(text, markers, expected):
    assert num_held_chars(text, markers) == expected
