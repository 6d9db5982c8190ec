"""The frontend's grammar checker: xgrammar's reasons as 400s, from a child process that a
check which takes too long kills (the next check starts a fresh one)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from frontend.errors import InvalidRequestError
from frontend.grammar_checker import GrammarChecker
from ipc.structured_outputs import MAX_GRAMMAR_BYTES, StructuredOutputsParams

# Says it is ready, then never answers: a check that hangs.
HANGING_CHECKER = (sys.executable, "-c",
                   "import sys, time, msgpack, struct; d = msgpack.packb(['ready']); "
                   "sys.stdout.buffer.write(struct.pack('>I', len(d)) + d); sys.stdout.flush(); time.sleep(60)")


def test_bad_grammars_get_xgrammars_reason_and_good_ones_pass():
    async def main():
        checker = GrammarChecker()
        try:
            await checker.check(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
            await checker.check(StructuredOutputsParams(choice=['say "hi"', "naïve\\n"]))
            await checker.check(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
            await checker.check(StructuredOutputsParams(json_object=True))
            cases = [(StructuredOutputsParams(json={"type": "objectx"}), 'Unsupported type "objectx"'),
                     (StructuredOutputsParams(regex="a(b"), "parenthesis is not closed"),
                     (StructuredOutputsParams(grammar="root ::= "), "EBNF parser error"),
                     (StructuredOutputsParams(json="{not json"), "not valid JSON"),
                     (StructuredOutputsParams(regex="a", grammar="b"), "exactly one"),
                     (StructuredOutputsParams(regex="a" * (MAX_GRAMMAR_BYTES + 1)), "over the limit"),
                     (StructuredOutputsParams(json={"type": "integer", "minimum": 1e308}),
                      "Integer exceeds maximum limit")]
            for params, reason in cases:
                with pytest.raises(InvalidRequestError, match=reason) as refused:
                    await checker.check(params)
                assert "Check failed" not in str(refused.value)  # xgrammar's assertion text is left out
        finally:
            await checker.close()

    asyncio.run(main())


def test_concurrent_requests_with_one_new_grammar_make_one_check():
    """32 requests that bring one schema at once: one compile in the child, not 32 beside the core's
    forward (issue #58); a bad grammar's verdict reaches every request that brought it."""
    async def main():
        checker = GrammarChecker()
        trips = []
        ask = checker._ask

        async def counted(*key):
            trips.append(key[0])
            return await ask(*key)

        checker._ask = counted
        try:
            schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
            await asyncio.gather(*(checker.check(StructuredOutputsParams(json=schema)) for _ in range(32)))
            assert trips == ["json"]
            await checker.check(StructuredOutputsParams(json=schema))  # remembered
            results = await asyncio.gather(*(checker.check(StructuredOutputsParams(regex="a(b")) for _ in range(8)),
                                           return_exceptions=True)
            assert trips == ["json", "regex"]
            assert all(isinstance(r, InvalidRequestError) and "parenthesis is not closed" in str(r) for r in results)
            with pytest.raises(InvalidRequestError):  # a refusal is not remembered: asked again, refused again
                await checker.check(StructuredOutputsParams(regex="a(b"))
            assert trips == ["json", "regex", "regex"] and not checker._in_flight
        finally:
            await checker.close()

    asyncio.run(main())


def test_a_check_that_hangs_is_refused_and_the_next_gets_a_fresh_checker():
    async def main():
        checker = GrammarChecker(timeout_s=0.5, command=HANGING_CHECKER)
        with pytest.raises(InvalidRequestError, match="took longer than 0.5 s"):
            await checker.check(StructuredOutputsParams(regex="(a+)+b"))
        assert checker._process is None  # killed
        checker.command = GrammarChecker().command
        await checker.check(StructuredOutputsParams(regex="(a+)+b"))  # a fresh, real one answers
        await checker.close()

    asyncio.run(main())


def test_with_the_tokenizer_a_grammar_slow_to_compile_is_refused(default_model_path):
    """`(a|b)` 4,000 times builds in milliseconds but compiles against a vocabulary for over a
    second (20,000 times: a minute of a core's compile thread); the checker measures the compile."""
    slow = StructuredOutputsParams(regex="(a|b)" * 4000)

    async def main():
        checker = GrammarChecker(timeout_s=0.25, tokenizer_folder=str(default_model_path))
        try:
            await checker.check(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
            with pytest.raises(InvalidRequestError, match="took longer than 0.25 s"):
                await checker.check(slow)
            await checker.check(StructuredOutputsParams(regex="[0-9]{3}"))  # a fresh checker serves the next
        finally:
            await checker.close()
        build_only = GrammarChecker(timeout_s=0.25)
        try:
            await build_only.check(slow)
        finally:
            await build_only.close()

    asyncio.run(main())
