"""`python -m engine.structured_output.checker`: the frontend's grammar checker, as a child process.

The frontend must refuse a schema, regex or grammar that xgrammar cannot use with a
400 and xgrammar's own reason, before anything reaches a core. xgrammar imports
torch, which the frontend never does, so the check runs here: frames in on stdin,
frames out on stdout (`ipc.pipe_frames`).

    in:   [kind, text, any_whitespace]     (kind, text): ipc.structured_outputs.grammar_source
    out:  [error]                          error: xgrammar's message, or nil when it compiles

With `--tokenizer FOLDER` (what the frontend starts, with the core's `--vocab-size` and
`--stop-token-ids`) each grammar is compiled by the core's own `compile_grammar` on a
compiler from the core's own `make_grammar_compiler`, uncached: what a grammar costs
to compile is found here, in a process the frontend kills and restarts when a check
takes longer than its limit, so a pathological grammar is refused with a 400 before
it can occupy a core's compile thread. Without it only the grammar is built, with the
same options (milliseconds).

    python -m engine.structured_output.checker [--tokenizer FOLDER [--vocab-size N] [--stop-token-ids 2,3]]
"""

from __future__ import annotations

import argparse
import re
import sys

from engine.structured_output.compiler import build_grammar, compile_grammar, make_grammar_compiler
from ipc.pipe_frames import pack_frame, read_frame

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:33:00] /project/cpp/x.cc:94: "
# An assertion inside xgrammar: "Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: Integer exceeds ..."
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*\) is false: ")


def check(kind: str, text: str | None, any_whitespace: bool, compiler=None) -> str | None:
    """xgrammar's reason for refusing the grammar, or None; with `compiler` (from
    make_grammar_compiler) it is compiled as a core compiles it, else only built."""
    try:
        if compiler is not None:
            compile_grammar(compiler, kind, text, any_whitespace)
        else:
            build_grammar(kind, text, any_whitespace)
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        return reason(e)
    return None


def reason(error: Exception) -> str:
    """xgrammar's message without its source location and assertion text."""
    lines = str(error).strip().splitlines()
    return _CHECK_PREFIX.sub("", _SOURCE_PREFIX.sub("", lines[0])) if lines else type(error).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="also compile each grammar against this folder's tokenizer")
    parser.add_argument("--vocab-size", type=int, help="the core's vocabulary size (its logits' width)")
    parser.add_argument("--stop-token-ids", type=lambda text: [int(t) for t in text.split(",") if t],
                        help="the core's stop token ids, comma-separated")
    args = parser.parse_args()
    import xgrammar  # noqa: F401  (loaded before the first request, not during it)

    compiler, compiler_error = None, None
    if args.tokenizer:
        try:
            compiler = make_grammar_compiler(args.tokenizer, args.vocab_size, args.stop_token_ids,
                                             cache_enabled=False)  # each check measures a fresh compile
        except Exception as e:  # the core's compiler fails the same way, on every request
            compiler_error = reason(e)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(pack_frame(["ready"]))
    stdout.flush()
    while (request := read_frame(stdin)) is not None:
        kind, text, any_whitespace = request
        stdout.write(pack_frame([compiler_error or check(kind, text, bool(any_whitespace), compiler)]))
        stdout.flush()


if __name__ == "__main__":
    main()
