"""The engine against hostile inputs and failing steps, on a tiny random Llama (no sockets).

Every value that reaches a tensor must be checked against the model before a step;
a step whose model call raises fails only its own requests, and the engine serves on.
"""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from engine.loop.engine_core import EngineCore, StepError
from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.helpers.models import make_tiny_model

VOCAB_SIZE = 512
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("robust"), "LlamaForCausalLM")
    return path


def make_engine(path: str) -> EngineCore:
    # A short context keeps "generate up to the context" cases quick.
    return EngineCore(EngineConfig(model=path, block_size=4, num_kv_blocks=64, max_model_len=40, dtype="float32"))


@pytest.fixture(scope="module")
def engine(tiny_path):
    return make_engine(tiny_path)


def run_to_end(engine: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("stop_token_id", [VOCAB_SIZE, 100_000, 2**31 - 1])
def test_out_of_vocabulary_stop_token_is_refused_before_any_step(engine, stop_token_id):
    params = greedy(min_tokens=1, stop_token_ids=[stop_token_id])
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 512\)"):
        engine.add_request("bad", PROMPT, params)
    assert not engine.has_unfinished_requests()
    engine.add_request("good", PROMPT, greedy(min_tokens=1, stop_token_ids=[VOCAB_SIZE - 1]))
    assert len(run_to_end(engine)["good"]) >= 1


# Values at and beyond every bound; each must be refused by add_request or run cleanly.
EXTREMES = [-(2**63), -(2**31), -1, 0, 1, VOCAB_SIZE - 1, VOCAB_SIZE, 39, 40, 2**31 - 1, 2**31, 2**63 - 1,
            2**63, 2**64, 1e-40, 0.5, 1e308, math.inf, -math.inf, math.nan, True, "3", None]
FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs"]


@pytest.mark.parametrize("field", FIELDS)
def test_fuzzed_sampling_fields_are_refused_or_run(engine, field):
    for i, value in enumerate(EXTREMES):
        params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
        setattr(params, field, value)
        if field in ("max_tokens", "min_tokens") and isinstance(value, int) and value > 3:
            params.max_tokens = None  # let a huge min_tokens through to the context cap
        try:
            engine.add_request(f"{field}-{i}", PROMPT, params)
        except ValueError:
            continue
        outputs = run_to_end(engine)  # must not raise
        assert all(0 <= t < VOCAB_SIZE for t in outputs[f"{field}-{i}"])
    assert engine.block_manager.num_used_blocks == 0


def test_fuzzed_stop_and_prompt_token_ids_are_refused(engine):
    for bad in (-1, VOCAB_SIZE, 2**31, 2**63, "7", 1.5, None):
        with pytest.raises(ValueError):
            engine.add_request("stop", PROMPT, greedy(stop_token_ids=[bad]))
        with pytest.raises(ValueError):
            engine.add_request("prompt", [1, bad], greedy())
    assert not engine.has_unfinished_requests()


def test_tiny_temperature_is_greedy(engine):
    engine.add_request("greedy", PROMPT, greedy())
    engine.add_request("tiny", PROMPT, SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True))
    engine.add_request("tiny-seeded", PROMPT, SamplingParams(temperature=1e-37, seed=3, max_tokens=8, ignore_eos=True))
    tokens = run_to_end(engine)
    assert tokens["tiny"] == tokens["greedy"] == tokens["tiny-seeded"]


def inject_fault(engine: EngineCore, at_call: int) -> None:
    num_calls = 0

    def raise_once(module, args):
        nonlocal num_calls
        num_calls += 1
        if num_calls == at_call:
            raise RuntimeError("injected")

    # The embedding runs once a step on every path, the decode stack's too.
    engine.model_runner.model.embed_tokens.register_forward_pre_hook(raise_once)


def test_a_failed_step_fails_only_its_requests_and_the_engine_serves_on(tiny_path):
    engine = make_engine(tiny_path)  # its own: the fault hook stays on the model
    engine.add_request("before", PROMPT, greedy())
    expected = run_to_end(engine)["before"]
    inject_fault(engine, at_call=3)
    engine.add_request("a", PROMPT, greedy())
    engine.add_request("b", PROMPT[:3], greedy())
    engine.step()  # prefill both
    engine.step()
    with pytest.raises(StepError) as failure:
        engine.step()
    assert sorted(failure.value.request_ids) == ["a", "b"]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("after", PROMPT, greedy())
    assert run_to_end(engine)["after"] == expected


def test_offline_generate_reports_a_failed_step_as_error(tiny_path):
    llm = LLM(tiny_path, skip_tokenizer_init=True, block_size=4, dtype="float32")
    inject_fault(llm.engine, at_call=2)
    outputs = llm.generate([PROMPT, PROMPT[:2]], greedy(max_tokens=4), use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["error", "error"]
    again = llm.generate([PROMPT], greedy(max_tokens=4), use_tqdm=False)
    assert again[0].finish_reason == "length" and len(again[0].token_ids) == 4


def test_a_raw_request_on_the_core_socket_fails_alone(engine):
    """A hostile peer skips the frontend: out-of-vocabulary ids and bad ranges in raw msgpack
    get an EngineError for that request id, and the core serves the next request."""
    import threading

    import msgpack
    import zmq

    from engine.loop.core_process import EngineCoreProcess
    from ipc.messages import EngineError, EngineOutputs, EngineReady, Hello, MessageType, Shutdown
    from ipc.sockets import bind_router, connect_dealer, new_ipc_address, recv_message, send_message

    ctx = zmq.Context()
    address = new_ipc_address("core")
    process = EngineCoreProcess(engine, bind_router(ctx, address), engine_id=0, model_name="tiny")
    thread = threading.Thread(target=process.run, daemon=True)
    thread.start()
    dealer = connect_dealer(ctx, address)
    try:
        send_message(dealer, Hello("hostile"))
        assert isinstance(recv_message(dealer), EngineReady)
        params = [0.0, 1.0, -1, 0.0, None, 4, 0, True]
        bad = {"oov-prompt": ([1, VOCAB_SIZE], params), "oov-stop": (PROMPT, [*params, [2**31 - 1]]),
               "nan": (PROMPT, [float("nan"), *params[1:]]), "long": (list(range(40)), params)}
        for request_id, (prompt, raw_params) in bad.items():
            dealer.send(msgpack.packb([MessageType.ADD_REQUEST, request_id, prompt, raw_params]))
        dealer.send(msgpack.packb([MessageType.ADD_REQUEST, "good", PROMPT, params]))
        errors, finished = {}, None
        while finished is None:
            assert dealer.poll(60_000), "the core went silent"
            msg = recv_message(dealer)
            if isinstance(msg, EngineError):
                assert not msg.is_fatal
                errors[msg.request_id] = msg.message
            elif isinstance(msg, EngineOutputs):
                finished = next((o for o in msg.outputs if o.request_id == "good" and o.finish_reason), None)
        assert set(errors) == set(bad), errors
        assert "prompt token ids" in errors["oov-prompt"] and "stop_token_ids" in errors["oov-stop"]
        assert "temperature" in errors["nan"] and "maximum context length" in errors["long"]
    finally:
        send_message(dealer, Shutdown("test over"))
        thread.join(30)
        dealer.close()
        process.sock.close()
        ctx.term()
    assert not thread.is_alive() and engine.block_manager.num_used_blocks == 0
