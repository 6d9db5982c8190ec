"""`python -m engine.structured_output.checker`: the frontend's grammar checker, as a child process.

The frontend must refuse a schema, regex or grammar that xgrammar cannot use with a
400 and xgrammar's own reason, before anything reaches a core. xgrammar imports
torch, which the frontend never does, so the check runs here: frames in on stdin,
frames out on stdout, each a 4-byte big-endian length and a msgpack array.

    in:   [kind, text, any_whitespace]     kind: "json", "regex", "grammar"
    out:  [error]                          error: xgrammar's message, or nil when it parses

Only the grammar is built (no tokenizer), which takes milliseconds; the frontend
kills and restarts a checker that takes longer than its limit.
"""

from __future__ import annotations

import re
import struct
import sys

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:33:00] /project/cpp/x.cc:94: "


def check(kind: str, text: str, any_whitespace: bool) -> str | None:
    import xgrammar

    try:
        if kind == "json":
            xgrammar.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(text)
        else:
            return f"unknown grammar kind {kind!r}"
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        lines = str(e).strip().splitlines()
        return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__
    return None


def read_frame(stream) -> bytes | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is over the limit")
    return stream.read(size)


def write_frame(stream, obj) -> None:
    data = msgpack.packb(obj)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def main() -> None:
    import xgrammar  # noqa: F401  (loaded before the first request, not during it)

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, ["ready"])
    while (frame := read_frame(stdin)) is not None:
        kind, text, any_whitespace = msgpack.unpackb(frame)
        write_frame(stdout, [check(kind, text, bool(any_whitespace))])


if __name__ == "__main__":
    main()
