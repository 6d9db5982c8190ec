"""Decode-only steps in one C++ call (engine/cpu/decode_stack.py): the same tokens and the
same log-probabilities, bit for bit, as the eager layer loop, for every kind of matmul it
takes (bf16 slabs, int8 and int4 panels, oneDNN-prepacked fp32, plain weights), with q/k biases
(Qwen2) and a per-head q/k norm (Qwen3), and with a KV cache in a dtype of its own; models it
cannot run say why and stay eager."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu.host import detect_cpu_features
from tests.helpers.models import make_tiny_model, quantization_runs

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2_bias": ("Qwen2ForCausalLM", {}),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", dict(head_dim=32)),
}
CPU = detect_cpu_features()
# Each matmul kind the stack calls, by the settings that give it.
SETTINGS = {
    "fp32_onednn": dict(dtype="float32"),
    "fp32_plain": dict(dtype="float32", cpu_prepack=False),
    "bf16": dict(dtype="bfloat16"),  # slabs with AVX512_BF16; oneDNN's or plain weights elsewhere
    "int8": dict(quantization="int8"),  # fp32 activations; KV and attention in bf16 where the CPU has it
    "int8_fp32_kv": dict(quantization="int8", kv_cache_dtype="float32"),
    "int4": dict(quantization="int4"),
    "fp32_bf16_kv": dict(dtype="float32", kv_cache_dtype="bfloat16"),  # qkv cast to bf16, attention's output back
}
NEEDS = {
    # Without it bf16 attention runs the torch backend (engine/worker/attention_choice.py), which the stack does not take.
    "bf16": (CPU.has_avx512_bf16, "bf16 on the C++ attention backend needs AVX512_BF16"),
    "int8": (quantization_runs("int8"), "int8 needs AVX512_VNNI or AVX2"),
    "int8_fp32_kv": (quantization_runs("int8"), "int8 needs AVX512_VNNI or AVX2"),
    "int4": (quantization_runs("int4"), "int4 needs AVX512_VNNI or AVX2"),
    "fp32_bf16_kv": (CPU.has_avx512_bf16, "the C++ bf16 attention needs AVX512_BF16"),
}
ENGINE_KWARGS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, enable_prefix_caching=False)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (2, 9, 31)]


def params() -> list[SamplingParams]:
    # Different lengths: rows leave the batch one by one, so decode steps of 3, 2 and 1 rows.
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (20, 12, 6)]


def run(path: str, stack: bool, **settings):
    llm = LLM(path, cpu_decode_stack=stack, **ENGINE_KWARGS, **settings)
    runner = llm.engine.model_runner
    calls = []
    if stack:
        assert runner.decode_stack is not None, "the stack should take this model"
        forward = runner.decode_stack.forward
        runner.decode_stack.forward = lambda *args: calls.append(1) or forward(*args)
    else:
        assert runner.decode_stack is None
    outputs = llm.generate(prompts(), params(), use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outputs], len(calls)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_stack_equals_eager_bit_for_bit(arch, setting, tmp_path):
    possible, why = NEEDS.get(setting, (True, ""))
    if not possible:
        pytest.skip(f"{why}; this CPU has none")
    architecture, overrides = ARCHITECTURES[arch]
    path, _ = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    eager, _ = run(path, stack=False, **SETTINGS[setting])
    stacked, num_calls = run(path, stack=True, **SETTINGS[setting])
    assert num_calls >= 19  # every decode step after the prompts' went through the stack
    assert all(len(set(tokens)) >= 3 for tokens, _ in eager)  # answers that vary: a real check
    assert stacked == eager


def test_shared_prefix_decodes_stay_eager_and_agree(tmp_path):
    """Decodes whose block tables share cached blocks take the shared-prefix kernel from Python:
    the stack declines those steps, and answers are the same as without it."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    common = list(range(100, 164))  # 64 tokens: the shared kernel's minimum
    batch = [common + [7, 8], common + [9]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    answers = []
    for stack in (False, True):
        llm = LLM(path, cpu_decode_stack=stack, dtype="float32", skip_tokenizer_init=True, block_size=16,
                  num_kv_blocks=64)
        llm.generate([common], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the common blocks
        outputs = llm.generate(batch, greedy, use_tqdm=False)
        answers.append([(o.token_ids, o.logprobs) for o in outputs])
        assert outputs[0].num_cached_tokens == 64
    assert answers[0] == answers[1]


@pytest.mark.parametrize("architecture, overrides, reason", [
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "MLP MoEBlock"),
    ("Gemma3ForCausalLM", dict(head_dim=16), "a second rotary for local layers"),
])
def test_other_layers_stay_eager_and_say_why(architecture, overrides, reason, tmp_path, caplog):
    path, _ = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    with caplog.at_level(logging.INFO, logger="engine.cpu.execution_plan"):
        llm = LLM(path, dtype="float32", **ENGINE_KWARGS)
    assert llm.engine.model_runner.decode_stack is None
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps:")]
    assert "eager" in line and reason in line
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids) == 4


POOLED = {"fp32_onednn": False, "fp32_plain": False, "bf16": CPU.has_avx512_bf16, "int8": True}


@pytest.mark.parametrize("setting", list(POOLED))
def test_stack_runs_on_the_work_pool_where_every_matmul_shares_out(setting, tmp_path):
    """Slabs and int8 panels share their work out on the decode steps' work pool (work_pool.h);
    oneDNN's and ATen's matmuls would run on one thread inside it, so those stacks do not use it."""
    possible, why = NEEDS.get(setting, (True, ""))
    if not possible:
        pytest.skip(f"{why}; this CPU has none")
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    llm = LLM(path, **ENGINE_KWARGS, **SETTINGS[setting])
    assert llm.engine.model_runner.decode_stack._stack.is_pooled() is POOLED[setting]


@pytest.mark.skipif(not (quantization_runs("int8") or CPU.has_avx512_bf16), reason="no pooled matmul kind on this CPU")
def test_an_error_inside_the_work_pool_reaches_python_and_the_pool_stays_usable(tmp_path):
    """A kernel's check failing in the pool's OpenMP region is raised to the caller (an exception
    must not cross the region's end), and the next steps run on the pool as before."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    setting = SETTINGS["int8"] if quantization_runs("int8") else SETTINGS["bf16"]
    llm = LLM(path, num_threads=2, **ENGINE_KWARGS, **setting)
    runner = llm.engine.model_runner
    stack = runner.decode_stack._stack
    assert stack.is_pooled()
    expected = llm.generate(prompts(), params(), use_tqdm=False)
    hidden = runner.model.embed(torch.tensor([5]))  # [1, hidden_size]
    cos = sin = torch.zeros(1, runner.model_config.head_dim, dtype=runner.kv_dtype)
    block_tables = torch.zeros(1, 1, dtype=torch.int32)
    too_long = torch.tensor([1000], dtype=torch.int32)  # past its one-block table: the attention kernel refuses
    with pytest.raises(RuntimeError, match="seq_len outside its block table"):
        stack.forward(hidden, cos, sin, torch.tensor([0]), block_tables, too_long)
    again = llm.generate(prompts(), params(), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


@pytest.mark.skipif(not quantization_runs("int8"), reason="int8 needs AVX512_VNNI or AVX2")
@pytest.mark.parametrize("intermediate_size", [128, 200])
def test_one_row_steps_split_silu_over_the_pool_bit_for_bit(intermediate_size, tmp_path):
    """A step of fewer rows than the pool has threads cuts each row's SiLU*up into one piece per
    thread (fused_ops.cpp, silu_pieces) at multiples of ATen's vector step: the same bits as eager.
    At 200 (12 steps of 16, then 8) the second piece ends in the row's scalar tail."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL | dict(intermediate_size=intermediate_size))
    setting = dict(SETTINGS["int8_fp32_kv"], num_threads=2)  # fp32 rows on the pool: the kernel's own SiLU
    eager, _ = run(path, stack=False, **setting)
    stacked, num_calls = run(path, stack=True, **setting)
    assert num_calls >= 19  # the last 8 steps have one row
    assert all(len(set(tokens)) >= 3 for tokens, _ in eager)
    assert stacked == eager


@pytest.mark.skipif(not CPU.has_amx_bf16, reason="slabs have a size limit (and a wide stack) only beside AMX")
def test_steps_past_the_slabs_take_the_wide_stack_bit_for_bit(tmp_path):
    """On AMX, bf16 steps of more tokens than the slabs take run a second stack on oneDNN's
    weights, as the eager path's PackedLinear does there: the same bits as eager."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    generator = torch.Generator().manual_seed(4)
    batch = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in range(2, 14)]  # 12 rows
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    answers, widths = [], []
    for stack in (False, True):
        llm = LLM(path, cpu_decode_stack=stack, dtype="bfloat16", **ENGINE_KWARGS)
        if stack:
            decode_stack = llm.engine.model_runner.decode_stack
            assert decode_stack._wide_stack is not None
            forward_rows = decode_stack.forward_rows
            decode_stack.forward_rows = lambda *args: widths.append(args[0].shape[0]) or forward_rows(*args)
        answers.append([(o.token_ids, o.logprobs) for o in llm.generate(batch, greedy, use_tqdm=False)])
    assert max(widths) == 12  # decode steps of 12 rows went through a stack: the wide one
    assert answers[0] == answers[1]


def test_profiling_times_every_layer_and_op_and_changes_no_bits(tmp_path):
    """With profiling on (scripts/bench/gguf_decode_profile.py), each forward adds every op's time
    to [num_layers, phases], every cell positive, and the tokens and log-probabilities are the
    same as without it; set_profiling starts the sums again from zero."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    llm = LLM(path, dtype="float32", **ENGINE_KWARGS)
    stack = llm.engine.model_runner.decode_stack._stack
    expected = [(o.token_ids, o.logprobs) for o in llm.generate(prompts(), params(), use_tqdm=False)]
    stack.set_profiling(True)
    profiled = [(o.token_ids, o.logprobs) for o in llm.generate(prompts(), params(), use_tqdm=False)]
    seconds = stack.phase_seconds()
    assert profiled == expected
    assert seconds.shape == (SMALL["num_hidden_layers"], 9) and seconds.dtype == torch.float64
    assert bool((seconds > 0).all()), seconds
    stack.set_profiling(False)
    assert float(stack.phase_seconds().abs().sum()) == 0.0
