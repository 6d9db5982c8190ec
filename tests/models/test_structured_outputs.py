"""Structured outputs in the engine, on the default model: the mask on fp32 and bf16 logits,
fidelity (a grammar that allows what the model writes anyway changes no token), the matcher
across preemption, several requests of one grammar, and compiles that never stall the loop."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.structured_output import GrammarCompilerPool
from engine.structured_output.bitmask import GrammarBitmask
from ipc.messages import FinishReason
from ipc.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
QUESTION = [{"role": "user", "content": "Give me a JSON object describing a person named Bob aged 31."}]


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(default_model_path, dtype="float32", block_size=8)


def greedy(max_tokens: int = 60, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def _kernels_or_none(use_kernels: bool):
    if not use_kernels:
        return None
    from engine.cpu.extension import load_cpu_kernels

    return load_cpu_kernels()


@pytest.mark.parametrize("use_kernels", [False, True], ids=["xgrammar_apply", "cpu_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_leaves_only_the_grammars_tokens(default_model_path, dtype, use_kernels):
    pool = GrammarCompilerPool(default_model_path, 49152, [2])
    import xgrammar

    matcher = xgrammar.GrammarMatcher(pool.submit(StructuredOutputsParams(regex="[0-9]")).result())
    logits = torch.randn(3, 49152).to(dtype)
    original = logits.clone()
    GrammarBitmask(_kernels_or_none(use_kernels)).apply(logits, [1], [_Grammar(matcher)])
    allowed = torch.isfinite(logits[1]).nonzero().squeeze(1).tolist()
    from ipc.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_path)
    assert allowed and all(re.fullmatch("[0-9]", tokenizer.decode([t])) for t in allowed)
    assert torch.equal(logits[1, allowed], original[1, allowed])  # allowed logits untouched
    assert torch.equal(logits[[0, 2]], original[[0, 2]])  # other rows untouched
    pool.shutdown()


@pytest.mark.parametrize("vocab_size", [49152, 1000, 37])
def test_the_cpu_kernel_masks_as_xgrammar_does(vocab_size):
    """Random bitmasks with all-zero, all-one and mixed words, a vocabulary that ends mid-word."""
    import xgrammar

    kernels = _kernels_or_none(True)
    generator = torch.Generator().manual_seed(vocab_size)
    num_words = (vocab_size + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, num_words), dtype=torch.int32, generator=generator)
    bitmask[:, ::3] = 0
    bitmask[:, 1::3] = -1
    logits = torch.randn(5, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2, 3])
    kernels.apply_token_bitmask(logits, bitmask, torch.tensor([0, 2, 3]))
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).any() and torch.isfinite(logits[0]).any()


class _Grammar:
    def __init__(self, matcher):
        self.matcher = matcher

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def test_a_grammar_that_allows_the_models_answer_changes_no_token(llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    free = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert free.text == "The capital of France is Paris." and free.finish_reason == "stop"
    constrained = llm.generate(prompt, greedy(structured_outputs=StructuredOutputsParams(choice=[free.text])),
                               use_tqdm=False)[0]
    assert constrained.token_ids == free.token_ids
    # A JSON answer the model writes by itself, held to a schema that allows exactly it.
    person = llm.apply_chat_template([{"role": "user", "content": "Reply with a JSON object with keys name and age "
                                                                  "for Bob, 31 years old. Only JSON."}])
    free_json = llm.generate(person, greedy(100), use_tqdm=False)[0]
    value = json.loads(free_json.text)
    assert value == {"name": "Bob", "age": 31}
    exact = {"type": "object", "properties": {k: {"const": v} for k, v in value.items()}, "required": list(value)}
    held = llm.generate(person, greedy(100, structured_outputs=StructuredOutputsParams(json=exact)), use_tqdm=False)[0]
    assert held.token_ids == free_json.token_ids


def test_schema_answers_parse_greedy_and_sampled_and_n_of_one_grammar(llm):
    prompt = llm.apply_chat_template(QUESTION)
    so = StructuredOutputsParams(json=PERSON)
    params = [greedy(100, structured_outputs=so)] + [
        SamplingParams(temperature=0.8, seed=seed, max_tokens=100, structured_outputs=so) for seed in range(4)]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        value = json.loads(output.text)
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
    regex = llm.generate(prompt, greedy(20, structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]+ \d\d")),
                         use_tqdm=False)[0]
    assert re.fullmatch(r"[A-Z][a-z]+ \d\d", regex.text) and regex.finish_reason == "stop"


def test_the_fill_runs_beside_the_forward_and_the_fused_kernel_masks(llm, tmp_path):
    """Every decode step of a grammar request starts its fill before the forward (issue #58), on the
    fill thread, and our C++ kernel applies it; the step trace (TOKENLOOM_STEP_TRACE) records both."""
    from engine.loop.step_trace import StepTrace

    engine = llm.engine
    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    prompt = llm.apply_chat_template(QUESTION)  # token ids
    engine.add_request("traced", prompt, greedy(40, structured_outputs=StructuredOutputsParams(json=PERSON)))
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        trace.record(engine, start)
    trace.close()
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    grammar_steps = [s for s in steps if "grammar_rows" in s]
    assert len(grammar_steps) >= 5 and all(s["grammar_rows"] == 1 for s in grammar_steps)
    assert all(s["overlapped"] and s["fused"] for s in grammar_steps)
    assert all(s["fwd0"] <= s["fill1"] and s["fill0"] <= s["fwd1"] for s in grammar_steps)  # the spans meet
    assert all(s["t0"] <= s["fwd0"] <= s["fwd1"] <= s["t1"] for s in grammar_steps)
    # the execute's ends (scripts/bench/probes/serve_path.py splits a step by them), in order
    assert all(s["t0"] <= s["prep0"] <= s["fwd0"] and s["fwd1"] <= s["sampled"] <= s["t1"] <= s["sent"]
               for s in grammar_steps)


def test_a_fill_waited_for_before_the_forward_gives_the_same_answer(llm):
    """`is_overlapping = False` (the A/B probe's serial arm) finishes the fill inside start_fill and
    changes no token."""
    bitmask = llm.engine.model_runner.logits_state.grammar_bitmask
    params = greedy(40, structured_outputs=StructuredOutputsParams(json=PERSON))
    overlapped = llm.chat(QUESTION, params, use_tqdm=False)[0]
    done_at_start = []
    start_fill = bitmask.start_fill

    def watched(*args):
        start_fill(*args)
        done_at_start.append(bitmask._started is None or bitmask._started[2].done())

    bitmask.is_overlapping, bitmask.start_fill = False, watched
    try:
        serial = llm.chat(QUESTION, params, use_tqdm=False)[0]
    finally:
        bitmask.is_overlapping = True
        del bitmask.start_fill
    assert serial.token_ids == overlapped.token_ids
    assert len(done_at_start) >= 5 and all(done_at_start)


def test_the_matcher_follows_the_tokens_across_preemption(default_model_path, llm):
    prompt = llm.apply_chat_template(QUESTION)
    params = greedy(100, structured_outputs=StructuredOutputsParams(json=PERSON))
    expected = llm.generate(prompt, params, use_tqdm=False)[0]
    tight = LLM(default_model_path, dtype="float32", block_size=8, num_kv_blocks=24)
    fillers = [greedy(80, ignore_eos=True)] * 3
    outputs = tight.generate([prompt] * 4, [params] + fillers, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert outputs[0].token_ids == expected.token_ids and json.loads(outputs[0].text)


def test_a_slow_compile_does_not_stall_other_requests(llm, monkeypatch):
    """The compile runs on a worker thread: the plain request streams its tokens meanwhile."""
    engine = llm.engine
    pool = engine._grammar_compiler()
    release = threading.Event()
    original = pool._compile

    def slow_compile(params):
        release.wait(30)
        return original(params)

    monkeypatch.setattr(pool, "_compile", slow_compile)
    engine.add_request("slow", [1, 2, 3], greedy(5, structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    engine.add_request("plain", [1, 2, 3], greedy(8, ignore_eos=True))
    finished = {}
    start = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - start < 120:
        for output in engine.step().outputs:
            if output.finish_reason is not None:
                finished[output.request_id] = output.finish_reason
        if "plain" in finished:
            release.set()
    assert list(finished) == ["plain", "slow"]  # plain ran to its end while the grammar compiled


def run_steps(engine) -> tuple[dict, dict, list]:
    """Step until every request ends: (finish reason, tokens) by request id, and the errors the steps returned."""
    finish_reasons, num_tokens, errors = {}, {}, []
    while engine.has_unfinished_requests():
        results = engine.step()  # an error comes back with the step that found it
        errors.extend(results.errors)
        for output in results.outputs:
            num_tokens[output.request_id] = num_tokens.get(output.request_id, 0) + len(output.new_token_ids)
            if output.finish_reason is not None:
                finish_reasons[output.request_id] = output.finish_reason
    return finish_reasons, num_tokens, errors


def test_an_overdue_compile_fails_that_request_alone(default_model_path, monkeypatch):
    llm = LLM(default_model_path, dtype="float32", grammar_compile_timeout_s=0.5)
    pool = llm.engine._grammar_compiler()
    original = pool._compile
    monkeypatch.setattr(pool, "_compile", lambda params: (time.sleep(3), original(params))[1])
    llm.engine.add_request("slow", [1, 2, 3], greedy(5, structured_outputs=StructuredOutputsParams(regex="a+")))
    llm.engine.add_request("plain", [1, 2, 3], greedy(5, ignore_eos=True))
    finish_reasons, num_tokens, errors = run_steps(llm.engine)
    assert finish_reasons == {"slow": FinishReason.ERROR, "plain": FinishReason.LENGTH}
    assert num_tokens.get("slow", 0) == 0 and num_tokens["plain"] == 5
    (request_id, reason), = errors
    assert request_id == "slow" and "did not compile within" in reason


@pytest.mark.parametrize("fields", [
    {"structured_outputs": StructuredOutputsParams(choice=["a"]), "min_tokens": 5},  # ends, but EOS is banned
    {"structured_outputs": StructuredOutputsParams(regex="[0-9]+"), "allowed_token_ids": [0]},  # 0: no digit
], ids=["choice_with_min_tokens", "digits_with_no_digit_allowed"])
def test_contradicting_constraints_fail_that_request_with_the_reason(llm, fields):
    engine = llm.engine
    engine.add_request("bad", [1, 2, 3], greedy(8, **fields))
    engine.add_request("plain", [1, 2, 3], greedy(5, ignore_eos=True))
    finish_reasons, num_tokens, errors = run_steps(engine)
    assert finish_reasons == {"bad": FinishReason.ERROR, "plain": FinishReason.LENGTH} and num_tokens["plain"] == 5
    (request_id, reason), = errors
    assert request_id == "bad" and "no token satisfies the request's constraints" in reason
    assert engine.block_manager.num_used_blocks == 0


def test_a_grammar_after_reasoning_masks_only_from_the_token_after_the_end_sequence(llm):
    """--reasoning-parser's wire field: the grammar sleeps until the output ends with
    reasoning_end_token_ids. The "end of reasoning" here is two tokens the model writes
    by itself, so the tokens up to them must be the free answer's, and the rest the regex's."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    free = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    end = free.token_ids[1:3]  # " capital of"
    assert free.token_ids[0:2] != end and not re.fullmatch(r"[0-9]+", free.text)
    held = StructuredOutputsParams(regex=r"[0-9]{3}", reasoning_end_token_ids=end)
    output = llm.generate(prompt, greedy(structured_outputs=held), use_tqdm=False)[0]
    assert output.finish_reason == "stop"
    assert output.token_ids[:3] == free.token_ids[:3]  # no mask, and the matcher unmoved, while dormant
    assert re.fullmatch(r"[0-9]{3}", llm.tokenizer.decode(output.token_ids[3:]))  # the mask from the next token on
    never = StructuredOutputsParams(regex=r"[0-9]{3}", reasoning_end_token_ids=[free.token_ids[0]] * 3)
    assert llm.generate(prompt, greedy(structured_outputs=never), use_tqdm=False)[0].token_ids == free.token_ids


def test_reasoning_parsers_split_a_think_answer_the_model_was_forced_to_write(llm):
    """A `<think>...</think>` answer from the default model (which does not think), forced by a
    regex with no reasoning parser; both parsers split it, whole and token by token."""
    from frontend.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France? Think first."}])
    forced = StructuredOutputsParams(regex=r"<think>[A-Za-z ,.]{5,60}</think>[A-Za-z ,.]{5,60}")
    output = llm.generate(prompt, greedy(80, structured_outputs=forced), use_tqdm=False)[0]
    match = re.fullmatch(r"<think>(.*)</think>(.*)", output.text, re.S)
    assert match, output.text
    pieces = [llm.tokenizer.decode(output.token_ids[:i + 1]) for i in range(len(output.token_ids))]
    deltas = [piece[len(before):] for before, piece in zip([""] + pieces, pieces)]
    assert "".join(deltas) == output.text and len(deltas) > 5
    for parser_class in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        assert parser_class().extract(output.text) == (match[1], match[2])
        parser, reasoning, content = parser_class(), "", ""
        for delta in deltas + [None]:
            r, c = parser.feed(delta) if delta is not None else parser.finish()
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == (match[1], match[2])
