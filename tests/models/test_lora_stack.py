"""LoRA on the CPU decode stack (engine/cpu/decode_stack.py, csrc/lora_rows.h): a decode step with
adapter rows is taken by the stack, not the eager path, and gives the eager path's tokens and
log-probabilities, for rows of the base and of two adapters mixed in one step, on a model whose
checkpoint has separate q/k/v and gate/up (Llama) and one whose checkpoint fuses them (Phi-3); also for
verification steps (ngram proposals), whose tokens the stack takes as one-token rows."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.cpu.host import detect_cpu_features
from tests.helpers.lora import LLAMA_MODULES, PHI3_MODULES, make_peft_adapter
from tests.helpers.models import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)
ENGINE_KWARGS = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, enable_prefix_caching=False,
                     enable_lora=True, max_loras=2, max_lora_rank=16)
CPU = detect_cpu_features()
SETTINGS = {
    "fp32_onednn": dict(dtype="float32"),
    "fp32_plain": dict(dtype="float32", cpu_prepack=False),
    "int8": dict(quantization="int8", kv_cache_dtype="float32"),  # int8 panels: the stack's pooled region
}
NEEDS = {"int8": (CPU.has_avx512_vnni, "int8 needs AVX512_VNNI")}
ARCHITECTURES = {"llama": ("LlamaForCausalLM", LLAMA_MODULES), "phi3_fused": ("Phi3ForCausalLM", PHI3_MODULES)}
# How close the stack's log-probs are to eager's. fp32: rounding, not bits (the stack's LoRA kernel
# folds the scale into the shrink; the suite saw 1.03e-5 on a log-prob of -3.4, so relative to the
# value as well as absolute). int8: the activations are quantized per token, so a last-bit
# difference before it can move one input by a code's step, and a log-prob by a few hundredths
# (0.03 on a Zen 4, where the two paths had agreed to 2.4e-7 for 11 tokens). There a greedy
# choice between two tokens so close may part the texts (TIES_PART): checked as a tie, then the
# steps before it.
CLOSE = {"fp32": dict(rel=1e-5, abs=1e-5), "int8": dict(rel=0, abs=0.05)}
TIES_PART = {"int8"}
# Different lengths: rows leave the batch one by one, so decode steps of many sizes and slot mixes.
LENGTHS = (20, 14, 9, 17, 6, 11)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    # Ids below 250: within every tiny model's vocabulary (the GGUF's tokenizer has about 300).
    return [torch.randint(0, 250, (n,), generator=generator).tolist() for n in (2, 9, 31, 5, 12, 3)]


def make_adapters(tmp_path, hf_model, modules) -> list[LoRARequest]:
    """Rank 8 (alpha 16) and rank 16 under rsLoRA (alpha 8)."""
    made = []
    for i, spec in enumerate([dict(r=8, lora_alpha=16), dict(r=16, lora_alpha=8, use_rslora=True)], start=1):
        path, _ = make_peft_adapter(hf_model, tmp_path / f"adapter{i}", target_modules=modules, seed=i, **spec)
        made.append(LoRARequest(f"adapter{i}", i, path))
    return made


def run(path: str, stack: bool, loras, speculative: bool = False, **settings):
    """Each request's (tokens, log-probs), and how many stack steps had adapter rows."""
    extra = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}) if speculative else {}
    llm = LLM(path, cpu_decode_stack=stack, **ENGINE_KWARGS, **extra, **settings)
    runner = llm.engine.model_runner
    lora_steps = []
    if stack:
        assert runner.decode_stack is not None and runner.decode_stack.has_lora
        forward_rows = runner.decode_stack.forward_rows
        runner.decode_stack.forward_rows = (
            lambda *args: lora_steps.append(len(runner.lora.state.token_groups)) or forward_rows(*args))
    else:
        assert runner.decode_stack is None
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in LENGTHS]
    outputs = llm.generate(prompts(), params, use_tqdm=False, lora_request=loras)
    return [(o.token_ids, o.logprobs) for o in outputs], [n for n in lora_steps if n > 0]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_lora_decode_steps_run_on_the_stack_and_equal_eager(arch, setting, tmp_path):
    possible, why = NEEDS.get(setting, (True, ""))
    if not possible:
        pytest.skip(f"{why}; this CPU has none")
    architecture, modules = ARCHITECTURES[arch]
    path, hf_model = make_tiny_model(tmp_path, architecture, **SMALL)
    first, second = make_adapters(tmp_path, hf_model, modules)
    loras = [None, first, second, first, None, second]  # the base and two adapters in each step
    eager, _ = run(path, stack=False, loras=loras, **SETTINGS[setting])
    stacked, lora_steps = run(path, stack=True, loras=loras, **SETTINGS[setting])
    assert len(lora_steps) >= 15  # the decode steps with adapter rows went through the stack ...
    assert max(lora_steps) == 2  # ... steps with rows of both adapters (and the base) among them
    base_alone = run(path, stack=True, loras=None, **SETTINGS[setting])[0]
    assert [t for t, _ in stacked] != [t for t, _ in base_alone]  # the adapters change the answers: a real check
    close = CLOSE.get(setting, CLOSE["fp32"])
    num_diverged = 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(stacked, eager):
        assert len(tokens) == len(want_tokens)
        same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
        if same < len(tokens):  # int8 alone: a tie within a code's step, after which the greedy texts part
            assert setting in TIES_PART, (same, tokens, want_tokens)
            assert_tie(logprobs[same], want_logprobs[same], close)
            num_diverged += 1
        for got, want in zip(logprobs[:same], want_logprobs[:same], strict=True):
            assert got.token_id == want.token_id
            assert [got.logprob, *got.top_logprobs] == pytest.approx([want.logprob, *want.top_logprobs], **close)
            assert_same_top(got, want, close)
    assert num_diverged <= 1


def assert_tie(got, want, close: dict) -> None:
    """Where the two paths chose different tokens: each chose the other's runner-up, and both
    tokens' log-probs agree across the paths within `close` (a tie, not a wrong row)."""
    got_logprob = dict(zip(got.top_token_ids, got.top_logprobs))
    want_logprob = dict(zip(want.top_token_ids, want.top_logprobs))
    assert want.token_id in got_logprob and got.token_id in want_logprob
    for token_id in (got.token_id, want.token_id):
        assert got_logprob[token_id] == pytest.approx(want_logprob[token_id], **close)


def assert_same_top(got, want, close: dict) -> None:
    """The same top tokens, except that two whose log-probs tie within rounding may trade places,
    or trade the top list's last place (the int8 setting on a Zen 4 ranked 51 and 158 apart by
    rounding alone). Every other token holds its rank."""
    want_logprob = dict(zip(want.top_token_ids, want.top_logprobs))
    got_logprob = dict(zip(got.top_token_ids, got.top_logprobs))
    for rank, (got_id, want_id) in enumerate(zip(got.top_token_ids, want.top_token_ids, strict=True)):
        if got_id == want_id:
            continue
        # a swap: each side's token at this rank ties the other side's within rounding
        assert got.top_logprobs[rank] == pytest.approx(want.top_logprobs[rank], **close)
        assert want_logprob.get(got_id, want.top_logprobs[-1]) == pytest.approx(got.top_logprobs[rank], **close)
        assert got_logprob.get(want_id, got.top_logprobs[-1]) == pytest.approx(want.top_logprobs[rank], **close)


def test_verification_rows_under_adapters_run_on_the_stack(tmp_path):
    """ngram proposals verified under each row's adapter: steps of several tokens per sequence, which
    the stack takes as rows, with the eager path's tokens."""
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    first, second = make_adapters(tmp_path, hf_model, LLAMA_MODULES)
    loras = [first, None, second, second, first, None]
    eager, _ = run(path, stack=False, loras=loras, speculative=True, dtype="float32")
    stacked, lora_steps = run(path, stack=True, loras=loras, speculative=True, dtype="float32")
    assert lora_steps
    assert [t for t, _ in stacked] == [t for t, _ in eager]


def test_adapters_over_gguf_blocks_run_on_the_stacks_work_pool(in_gguf_cache, tmp_path):
    """A GGUF's Q8_0 blocks: every matmul shares out on the decode stack's work pool, and so does the
    adapters' shrink and expand, inside its region; the same tokens as eager. The Q8_0 kernel quantizes
    its activations to 8 bits, so the adapters' fp32 rounding (the stack's kernel against eager's
    matmuls) can move a value across a rounding step: log-probabilities agree to 1e-2, not 1e-5."""
    from transformers import AutoModelForCausalLM

    from engine.loader.gguf_convert import convert_gguf
    from tests.models.test_gguf_direct import write_tiny
    from tests.models.test_gguf_files import write_tiny_llama

    tokenizer_folder, _ = write_tiny_llama(tmp_path / "tokenizer")
    path = write_tiny(tmp_path / "tiny.q8_0.gguf", tokenizer_folder, "Q8_0")
    convert_gguf(path, tmp_path / "fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    first, second = make_adapters(tmp_path, hf_model, LLAMA_MODULES)
    loras = [second, None, first, first, second, None]
    eager, _ = run(str(path), stack=False, loras=loras, dtype="float32")
    stacked, lora_steps = run(str(path), stack=True, loras=loras, dtype="float32")
    assert len(lora_steps) >= 15
    assert [t for t, _ in stacked] == [t for t, _ in eager]
    for (_, logprobs), (_, want_logprobs) in zip(stacked, eager):
        assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in want_logprobs], abs=1e-2)
