"""`python -m engine.structured_output.checker`: the frontend's grammar checker, as a child process.

The frontend must refuse a schema, regex or grammar that xgrammar cannot use with a
400 and xgrammar's own reason, before anything reaches a core. xgrammar imports
torch, which the frontend never does, so the check runs here: frames in on stdin,
frames out on stdout, each a 4-byte big-endian length and a msgpack array.

    in:   [kind, text, any_whitespace]     kind: "json", "regex", "grammar"
    out:  [error]                          error: xgrammar's message, or nil when it parses

With `--tokenizer FOLDER` (what the frontend starts) the grammar is also compiled
against that tokenizer's vocabulary, as a core will compile it: what a grammar costs
to compile is found here, in a process the frontend kills and restarts when a check
takes longer than its limit, so a pathological grammar is refused with a 400 before
it can occupy a core's compile thread. Without it only the grammar is built
(milliseconds).

    python -m engine.structured_output.checker [--tokenizer FOLDER]
"""

from __future__ import annotations

import argparse
import re
import struct
import sys

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:33:00] /project/cpp/x.cc:94: "
# An assertion inside xgrammar: "Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: Integer exceeds ..."
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*\) is false: ")


def check(kind: str, text: str, any_whitespace: bool, compiler=None) -> str | None:
    """xgrammar's reason for refusing the grammar, or None; `compiler` (a GrammarCompiler)
    compiles it as well."""
    import xgrammar

    try:
        if kind == "json":
            grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            grammar = xgrammar.Grammar.from_regex(text)
        elif kind == "grammar":
            grammar = xgrammar.Grammar.from_ebnf(text)
        else:
            return f"unknown grammar kind {kind!r}"
        if compiler is not None:
            compiler.compile_grammar(grammar)
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        lines = str(e).strip().splitlines()
        return _CHECK_PREFIX.sub("", _SOURCE_PREFIX.sub("", lines[0])) if lines else type(e).__name__
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


def make_compiler(tokenizer_folder: str):
    """A GrammarCompiler over the folder's tokenizer (no cache: each check measures a fresh compile)."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer), cache_enabled=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="also compile each grammar against this folder's tokenizer")
    args = parser.parse_args()
    import xgrammar  # noqa: F401  (loaded before the first request, not during it)

    compiler = make_compiler(args.tokenizer) if args.tokenizer else None
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, ["ready"])
    while (frame := read_frame(stdin)) is not None:
        kind, text, any_whitespace = msgpack.unpackb(frame)
        write_frame(stdout, [check(kind, text, bool(any_whitespace), compiler)])


if __name__ == "__main__":
    main()
