"""The grammar compiler is built when the engine starts, on its own thread (issue #58): the first
constrained request waits for its own compile only, not for xgrammar's import and the tokenizer
info (1-3.5 s on 2 cores), and one that comes while the build still runs gets its answer too."""

from __future__ import annotations

import re
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import compiler
from ipc.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

DIGITS = StructuredOutputsParams(regex=r"[0-9]{2} [a-z]+")


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def first_token_s(engine, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    """Seconds from add_request to the request's first token (stepping until every request ends)."""
    start, first = time.perf_counter(), None
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.request_id == request_id and output.new_token_ids and first is None:
                first = time.perf_counter() - start
    return first


def test_the_compiler_is_ready_before_the_first_request_and_its_ttft_is_a_free_ones(default_model_path):
    llm = LLM(default_model_path, dtype="float32")
    engine = llm.engine
    assert engine.grammar_compiler is not None  # made at start, with no structured request yet
    assert engine.grammar_compiler.wait_until_ready(120)
    prompt = llm.apply_chat_template([{"role": "user", "content": "How many apples? Answer with a number."}])
    free = [first_token_s(engine, "free-0", prompt, greedy(4))]
    compile_start = time.perf_counter()
    future = engine.grammar_compiler.submit(StructuredOutputsParams(regex="[a-z]{3}"))  # a first, uncached compile
    future.result()
    compile_s = time.perf_counter() - compile_start
    constrained = first_token_s(engine, "grammar", prompt, greedy(4, structured_outputs=DIGITS))
    free.append(first_token_s(engine, "free-1", prompt, greedy(4)))
    # A compile is milliseconds; building the compiler had taken seconds before the first compile.
    assert compile_s < 0.5, compile_s
    assert constrained < max(free) + 0.5, (constrained, free)


def test_a_request_that_comes_while_the_compiler_builds_waits_for_it_alone(default_model_path, monkeypatch):
    reference = LLM(default_model_path, dtype="float32")
    prompt = reference.apply_chat_template([{"role": "user", "content": "How many apples? Answer with a number."}])
    expected = reference.generate(prompt, greedy(12, structured_outputs=DIGITS), use_tqdm=False)[0]
    assert re.fullmatch(r"[0-9]{2} [a-z]+", expected.text)

    release = threading.Event()
    original = compiler.load_tokenizer_info

    def slow_info(*args, **kwargs):
        release.wait(60)  # the build is still going when the requests arrive
        return original(*args, **kwargs)

    monkeypatch.setattr(compiler, "load_tokenizer_info", slow_info)
    llm = LLM(default_model_path, dtype="float32")
    engine = llm.engine
    assert not engine.grammar_compiler.is_ready
    engine.add_request("grammar", prompt, greedy(12, structured_outputs=DIGITS))
    engine.add_request("plain", prompt, greedy(6, ignore_eos=True))
    tokens, finished = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.append(output.request_id)
        if "plain" in finished:
            release.set()
    assert finished == ["plain", "grammar"]  # the plain request ran while the compiler was built
    assert tokens["grammar"] == expected.token_ids  # then the grammar's answer, as an engine started long ago gives
