"""An adapter's tensors are read on the core's reader thread (engine/lora/adapter_reader.py), not in
a step: while a read is slow on purpose, a running stream gets a token every step and the request on
the adapter waits unscheduled; once read it answers exactly what peft answers. A file whose data is
bad (its header fine) fails that request alone, with the reason, and the stream goes on."""

from __future__ import annotations

import shutil
import threading
import time

import torch

from engine import LLM, LoRARequest, SamplingParams
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.lora import make_peft_adapter
from tests.helpers.models import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
ENGINE_KWARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=128, enable_lora=True,
                     max_loras=2, max_lora_rank=16)
NUM_NEW_TOKENS = 12
STREAM_PROMPT = [5, 6, 7, 8, 9]
ADAPTER_PROMPT = [11, 12, 13, 14, 15, 16, 17]


def step_until_done(engine, request_ids: set[str]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each request's tokens, and the errors the steps reported, until `request_ids` have finished."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        results = engine.step()
        if not results.outputs and not engine.has_schedulable_requests():
            time.sleep(0.005)  # only a read going on: let its thread have the GIL
        errors.update(results.errors)
        for output in results.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                request_ids.discard(output.request_id)
        if not request_ids:
            return tokens, errors
    raise AssertionError(f"{request_ids} did not finish")


def test_a_slow_read_leaves_the_stream_stepping_and_the_request_waits_then_answers_exactly(tmp_path):
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    adapter, peft_model = make_peft_adapter(hf_model, tmp_path / "adapter", r=16, lora_alpha=32)
    engine = LLM(path, **ENGINE_KWARGS).engine
    is_reading, may_finish = threading.Event(), threading.Event()

    def slow_read(spec) -> None:  # on the reader thread: the read lasts until the test lets it end
        is_reading.set()
        assert may_finish.wait(60)

    engine.model_runner.lora.reader.before_read = slow_read
    engine.add_request("stream", STREAM_PROMPT, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    engine.step()  # the stream's prefill
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    engine.add_request("on-adapter", ADAPTER_PROMPT, greedy, lora_request=LoRARequest("a", 1, adapter))
    assert is_reading.wait(30)
    waiting = engine.scheduler.requests["on-adapter"]
    for _ in range(10):  # the read is still going: every step decodes the stream, and only it
        results = engine.step()
        assert [(o.request_id, len(o.new_token_ids)) for o in results.outputs] == [("stream", 1)]
    assert waiting.num_computed_tokens == 0 and waiting in engine.scheduler.waiting
    assert engine.has_schedulable_requests()
    may_finish.set()
    tokens, errors = step_until_done(engine, {"on-adapter", "stream"})
    assert errors == {}
    assert tokens["on-adapter"] == hf_greedy(peft_model, ADAPTER_PROMPT, NUM_NEW_TOKENS)
    assert tokens["on-adapter"] != hf_greedy(hf_model, ADAPTER_PROMPT, NUM_NEW_TOKENS)  # the adapter counts
    assert len(tokens["stream"]) == 64 - 11  # its prefill's token and the ten above came before
    assert engine.model_runner.lora.reading == {} and 1 in engine.model_runner.lora.cache


def test_a_bad_tensor_found_on_the_read_fails_that_request_alone(tmp_path):
    from safetensors.torch import load_file, save_file

    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    good, _ = make_peft_adapter(hf_model, tmp_path / "good", r=8, lora_alpha=16)
    bad = tmp_path / "nan"
    shutil.copytree(good, bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = torch.nan  # the header stays valid: only the read can find it
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    engine = LLM(path, **ENGINE_KWARGS).engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("stream", STREAM_PROMPT, greedy)
    engine.add_request("on-bad", ADAPTER_PROMPT, greedy, lora_request=LoRARequest("bad", 1, str(bad)))
    tokens, errors = step_until_done(engine, {"stream", "on-bad"})
    assert "holds inf or NaN" in errors["on-bad"]
    assert len(tokens["stream"]) == 8 and tokens.get("on-bad", []) == []
    assert 1 not in engine.model_runner.lora.cache
    # The engine serves on, and a good adapter under another id loads as usual; the failed read is forgotten.
    engine.add_request("on-good", ADAPTER_PROMPT, greedy, lora_request=LoRARequest("good", 2, good))
    assert list(engine.model_runner.lora.reading) == [2]
    tokens, errors = step_until_done(engine, {"on-good"})
    assert errors == {} and len(tokens["on-good"]) == 8


def test_a_slot_refilled_holds_exactly_the_new_adapter(tmp_path):
    """The fill zeroes only the rows the slot's last adapter wrote and the new one does not: after a
    rank-16 adapter on every projection, a rank-8 one on q and v leaves the slot as a fresh pool's."""
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    wide, _ = make_peft_adapter(hf_model, tmp_path / "wide", r=16, lora_alpha=32)
    narrow, _ = make_peft_adapter(hf_model, tmp_path / "narrow", r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    kwargs = {**ENGINE_KWARGS, "max_loras": 1}
    reused = LLM(path, **kwargs).engine.model_runner.lora
    fresh = LLM(path, **kwargs).engine.model_runner.lora
    assert reused.activate([LoRARequest("wide", 1, wide)]) == {1: 0}
    assert any(layer.b[0].count_nonzero() for layer in reused.layers.values())
    assert reused.activate([LoRARequest("narrow", 2, narrow)]) == {2: 0}
    assert fresh.activate([LoRARequest("narrow", 2, narrow)]) == {2: 0}
    for key, layer in reused.layers.items():
        assert torch.equal(layer.a, fresh.layers[key].a) and torch.equal(layer.b, fresh.layers[key].b), key
    assert not reused.layers[(0, "gate_up_proj")].a.any()  # the wide adapter's MLP rows are gone
