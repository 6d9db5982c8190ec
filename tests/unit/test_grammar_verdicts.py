"""The frontend's grammar check and a core's compile give every grammar the same verdict:
the checker's child calls the core's `make_grammar_compiler` and `compile_grammar` with the
vocabulary size and stop tokens a core passes. Fed the same grammars, good and bad, under the
model's own vocabulary, a padded one, a cut one, and no stop tokens at all (which xgrammar
refuses for every grammar)."""

from __future__ import annotations

import asyncio

import pytest

from engine.models.config import ModelConfig
from engine.structured_output import GrammarCompilerPool
from engine.structured_output.checker import reason
from frontend.errors import InvalidRequestError
from frontend.grammar_checker import GrammarChecker
from ipc.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
GRAMMARS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(json=PERSON, any_whitespace=False),
    StructuredOutputsParams(json={"type": "string", "maxLength": 0}),  # only the stop token after the quotes
    StructuredOutputsParams(regex="[0-9]{3}"),
    StructuredOutputsParams(regex="0?"),  # may end at once: a stop token
    StructuredOutputsParams(choice=['say "hi"', "naïve\\n", "東京"]),  # tokens far into the vocabulary
    StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
    StructuredOutputsParams(grammar='root ::= ""'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(json={"type": "objectx"}),
    StructuredOutputsParams(json={"type": "integer", "minimum": 1e308}),
    StructuredOutputsParams(regex="a(b"),
    StructuredOutputsParams(grammar="root ::= "),
]


def core_verdict(pool: GrammarCompilerPool, params: StructuredOutputsParams) -> str | None:
    try:
        pool.submit(params).result()
    except Exception as e:
        return reason(e)
    return None


async def checker_verdict(checker: GrammarChecker, params: StructuredOutputsParams) -> str | None:
    try:
        await checker.check(params)
    except InvalidRequestError as e:
        return str(e)
    return None


@pytest.mark.parametrize("vocabulary", ["model", "padded", "cut", "no_stop_tokens"])
def test_the_checker_and_the_core_agree_on_every_grammar(default_model_path, vocabulary):
    config = ModelConfig.from_folder(default_model_path)
    vocab_size, stop_token_ids = {"model": (config.vocab_size, list(config.eos_token_ids)),
                                  "padded": (config.vocab_size + 64, [*config.eos_token_ids, 0]),
                                  "cut": (1000, list(config.eos_token_ids)),
                                  "no_stop_tokens": (config.vocab_size, [])}[vocabulary]
    pool = GrammarCompilerPool(default_model_path, vocab_size, stop_token_ids)
    core = [core_verdict(pool, params) for params in GRAMMARS]
    pool.shutdown()

    async def main():
        checker = GrammarChecker(timeout_s=60, tokenizer_folder=default_model_path)
        await checker.use_core_vocabulary(vocab_size, stop_token_ids)  # as the frontend does after the handshake
        try:
            return [await checker_verdict(checker, params) for params in GRAMMARS]
        finally:
            await checker.close()

    frontend = asyncio.run(main())
    assert [error is None for error in frontend] == [error is None for error in core]
    for core_error, frontend_error in zip(core, frontend):
        assert core_error is None or core_error in frontend_error  # the same reason, as a 400
    num_refused = sum(error is not None for error in core)
    assert num_refused == (len(GRAMMARS) if vocabulary == "no_stop_tokens" else 4)
