"""The decode stack (engine/cpu/decode_stack.py) runs GgufLinear layers through their op, as it
runs the int8 panels: the same tokens and log-probabilities, bit for bit, as the eager layer loop,
on a tiny Llama whose matmuls are a GGUF's blocks of mixed types (a merged qkv of Q4_K and Q6_K
rows, Q8_0, Q4_K, Q5_K), on the decode steps' work pool."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.cpu.decode_stack import build_decode_stack
from engine.worker.step_executors import make_step_executor
from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import GgufLinear
from engine.cpu.prefetch_tuner import PrefetchTuner
from tests.helpers.models import make_tiny_model
from tests.kernels.test_gguf_linear import make_blocks

CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.05)
ENGINE_KWARGS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, enable_prefix_caching=False,
                     dtype="float32", cpu_prepack=False)


def gguf_rows(type_name: str, weight: torch.Tensor, seed: int) -> torch.Tensor:
    """`weight` quantized by gguf's quantizer where it has one; else random valid blocks."""
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        return torch.from_numpy(gguf.quants.quantize(weight.detach().float().numpy(),
                                                     gguf.GGMLQuantizationType[type_name]))
    # codes and 6-bit scales average about 8 and 32: weights of a few hundredths, as the model's
    return make_blocks(type_name, weight.shape[0], weight.shape[1], seed, d_max=2e-4, centered=True)


def to_gguf(model) -> None:
    """Each layer's matmuls swapped for GgufLinears of mixed types."""
    num_kv = CONFIG["num_key_value_heads"] * CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj.weight
        qk_rows = qkv.shape[0] - num_kv
        attn.qkv_proj = GgufLinear([("Q4_K", gguf_rows("Q4_K", qkv[:qk_rows], i)),
                                    ("Q6_K", gguf_rows("Q6_K", qkv[qk_rows:], i))], qkv.shape[1])
        attn.o_proj = GgufLinear([("Q8_0", gguf_rows("Q8_0", attn.o_proj.weight, i))], CONFIG["hidden_size"])
        mlp.gate_up_proj = GgufLinear([("Q4_K", gguf_rows("Q4_K", mlp.gate_up_proj.weight, i))],
                                      CONFIG["hidden_size"])
        mlp.down_proj = GgufLinear([("Q5_K", gguf_rows("Q5_K", mlp.down_proj.weight, i))],
                                   CONFIG["intermediate_size"])


def generate(llm: LLM):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (2, 9, 31)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (16, 10, 5)]
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_stack_runs_gguf_blocks_bit_for_bit_on_the_work_pool(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **CONFIG)
    llm = LLM(path, cpu_decode_stack=True, **ENGINE_KWARGS)
    runner = llm.engine.model_runner
    model = runner.model
    to_gguf(model)
    fused_ops = model.layers[0].input_layernorm.fused
    stack, note = build_decode_stack(model, runner.kv_caches, runner.backend, fused_ops, fused_ops.kernels)
    assert stack is not None, note
    assert stack._stack.is_pooled()  # every matmul shares its rows out on the pool
    assert stack._stack.has_final_norm()  # model.norm inside the same call, not from Python after it
    calls = []
    runner.decode_stack = runner.step_executor.decode_stack = stack  # the runner's one way to run steps: the stack
    forward = stack.forward
    stack.forward = lambda *args: calls.append(1) or forward(*args)
    stacked = generate(llm)
    assert len(calls) >= 15  # every decode step after the prompts' went through the stack
    runner.decode_stack = None
    runner.step_executor = make_step_executor(runner.model, runner.kv_caches, runner.backend, runner.device,
                                              runner.dtype, group=None)  # eager: no stack
    assert runner.step_executor.name == "eager"
    eager = generate(llm)
    assert len({t for tokens, _ in eager for t in tokens}) >= 6, eager  # answers that vary: a real check
    assert all(np.isfinite(lp.logprob) for _, lps in eager for lp in lps)
    assert stacked == eager


def test_the_prefetch_tuner_steers_one_sequences_steps_without_changing_its_tokens(tmp_path):
    """A GGUF model's stack step carries the tuner of the kernels' one-token prefetch
    (engine/cpu/prefetch_tuner.py); its explored steps give the same tokens and log-probs."""
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **CONFIG)
    llm = LLM(path, cpu_decode_stack=True, **ENGINE_KWARGS)
    runner = llm.engine.model_runner
    assert runner.step_executor.prefetch_tuner is None  # fp32, no slabs: none of its linears has the switch
    to_gguf(runner.model)
    fused_ops = runner.model.layers[0].input_layernorm.fused
    stack, note = build_decode_stack(runner.model, runner.kv_caches, runner.backend, fused_ops, fused_ops.kernels)
    assert stack is not None, note
    runner.decode_stack = stack
    runner.step_executor = make_step_executor(runner.model, runner.kv_caches, runner.backend, runner.device,
                                              runner.dtype, group=None, decode_stack=stack)
    assert isinstance(runner.step_executor.prefetch_tuner, PrefetchTuner)
    set_prefetch = load_gguf_kernels().set_one_token_prefetch
    tuner = runner.step_executor.prefetch_tuner = PrefetchTuner(set_prefetch, explore_every=2, max_explore_every=2)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)

    def one_sequence():
        output = llm.generate([prompt], [params], use_tqdm=False)[0]
        return output.token_ids, output.logprobs

    explored = one_sequence()
    assert tuner.num_steps >= 23 and tuner.num_explored >= 10
    tuner = runner.step_executor.prefetch_tuner = PrefetchTuner(set_prefetch, explore_every=10**9)
    assert one_sequence() == explored
    assert tuner.num_steps >= 23 and tuner.num_explored == 0
    assert len(set(explored[0])) >= 2  # tokens that vary: a real check
