"""Multi-LoRA serving (engine/lora/): greedy fp32 tokens under peft-made adapters (rank 8 and 16,
every projection, B random, alpha != r, one rsLoRA) equal transformers + peft's on a tiny Llama and
a tiny Phi-3 (q/k/v and gate/up fused in its checkpoint); a batch mixing the base and several
adapters gives each request the tokens it gets alone, across chunked prefill, preemption and the
decode stack's steps; the prefix cache keeps adapters apart."""

from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.core.request import is_compiling
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.lora import LLAMA_MODULES, PHI3_MODULES, make_peft_adapter
from tests.helpers.models import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
ENGINE_KWARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_num_batched_tokens=16,
                     num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 23, 41)]


def adapters(tmp_path, hf_model, modules, count: int = 3):
    """Rank 8 (alpha 16), rank 16 (alpha 8), rank 8 under rsLoRA (alpha 4); `count` 4 adds rank 16 (alpha 32)."""
    specs = [dict(r=8, lora_alpha=16), dict(r=16, lora_alpha=8), dict(r=8, lora_alpha=4, use_rslora=True),
             dict(r=16, lora_alpha=32)][:count]
    made = []
    for i, spec in enumerate(specs, start=1):
        path, peft_model = make_peft_adapter(hf_model, tmp_path / f"adapter{i}", target_modules=modules, seed=i, **spec)
        made.append((LoRARequest(f"adapter{i}", i, path), peft_model))
    return made


def check_each_then_mixed(llm, hf_model, made, check_base: bool = False) -> tuple[list, list, list]:
    """Each prompt under each adapter alone equals transformers + peft; then all of them at once (the base
    and the adapters over the engine's slots, chunked prefill and decodes mixed) give the same tokens.
    Returns the batch (prompts, lora requests, expected tokens)."""
    batch_prompts, batch_loras, expected = [], [], []
    for prompt in prompts():
        base = hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
        if check_base:
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == base
        batch_prompts.append(prompt), batch_loras.append(None), expected.append(base)
        for lora_request, peft_model in made:
            want = hf_greedy(peft_model, prompt, NUM_NEW_TOKENS)
            assert want != base  # the adapter changes the answer: the test can fail
            got = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora_request)[0].token_ids
            assert got == want, (lora_request.lora_name, len(prompt))
            batch_prompts.append(prompt), batch_loras.append(lora_request), expected.append(want)
    outputs = llm.generate(batch_prompts, GREEDY, use_tqdm=False, lora_request=batch_loras)
    assert [o.token_ids for o in outputs] == expected
    return batch_prompts, batch_loras, expected


@pytest.mark.parametrize("architecture, modules", [("LlamaForCausalLM", LLAMA_MODULES),
                                                   ("Phi3ForCausalLM", PHI3_MODULES)])
def test_greedy_tokens_equal_peft_for_each_adapter_and_mixed(tmp_path, architecture, modules):
    path, hf_model = make_tiny_model(tmp_path, architecture, **SMALL)
    made = adapters(tmp_path, hf_model, modules)
    llm = LLM(path, **ENGINE_KWARGS)
    batch_prompts, batch_loras, expected = check_each_then_mixed(llm, hf_model, made)
    # ngram speculative decoding verifies under each row's adapter: the same tokens.
    speculative = LLM(path, **ENGINE_KWARGS, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outputs = speculative.generate(batch_prompts, GREEDY, use_tqdm=False, lora_request=batch_loras)
    assert [o.token_ids for o in outputs] == expected
    assert sum(s.num_drafts for s in speculative.engine.stats().spec_decode) > 0  # proposals were verified


def test_a_mixed_batch_under_preemption_gives_each_request_its_own_tokens(tmp_path):
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    made = adapters(tmp_path, hf_model, LLAMA_MODULES, count=4)
    generator = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, 512, (int(n),), generator=generator).tolist()
             for n in torch.randint(5, 30, (48,), generator=generator)]
    loras = [None if i % 5 == 0 else made[i % 5 - 1][0] for i in range(len(batch))]  # the base and 4 adapters
    alone = LLM(path, **ENGINE_KWARGS)
    expected = [alone.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0].token_ids
                for p, lora in zip(batch, loras)]
    # A pool of 24 blocks of 4 tokens cannot hold 48 sequences of up to 45 tokens: preemptions; 2 slots for 4 adapters.
    tight = LLM(path, **{**ENGINE_KWARGS, "num_kv_blocks": 24, "max_num_batched_tokens": 32})
    outputs = tight.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.token_ids for o in outputs] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(tmp_path):
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    (first, _), (second, _), _ = adapters(tmp_path, hf_model, LLAMA_MODULES)
    llm = LLM(path, **ENGINE_KWARGS)
    prompt = prompts()[2]  # 41 tokens: 10 full blocks to share
    scheduler = llm.engine.scheduler

    def run(lora):
        hits = scheduler.num_prefix_cache_hits
        tokens = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].token_ids
        return tokens, scheduler.num_prefix_cache_hits - hits

    under_first, hits = run(first)
    assert hits == 0
    under_second, hits = run(second)
    assert hits == 0 and under_second != under_first  # another adapter: no block of the first's
    base, hits = run(None)
    assert hits == 0 and base not in (under_first, under_second)
    again, hits = run(first)
    assert hits == 40 and again == under_first  # the same adapter again: its own blocks, all ten


def test_the_scheduler_holds_at_most_max_loras_adapters_first_come_first_served(tmp_path):
    path, hf_model = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL)
    made = adapters(tmp_path, hf_model, LLAMA_MODULES)
    llm = LLM(path, **{**ENGINE_KWARGS, "max_loras": 1})
    engine = llm.engine
    for i, (lora, _) in enumerate([made[0], made[1], made[0]]):
        engine.add_request(str(i), prompts()[1], GREEDY, lora_request=lora)
    # Adapters are read off the step, and a request whose read is still going is passed over in
    # its place: if adapter 2's read ended after adapter 1's (a busy host), request 2 passed
    # request 1. Both read first, so admission alone decides the order asserted below.
    deadline = time.monotonic() + 300
    while any(map(is_compiling, engine.scheduler.waiting)):
        assert time.monotonic() < deadline, "the adapters were not read in 300 s"
        time.sleep(0.01)
    seen = []
    while engine.has_unfinished_requests():
        running = {r.lora_request.lora_int_id for r in engine.scheduler.running}
        assert len(running) <= 1
        engine.step()
        seen.append(sorted(r.request_id for r in engine.scheduler.running))
    # Request 2 (adapter 1 again) does not pass request 1 (adapter 2), which came first.
    assert ["0"] in seen and ["1"] in seen and ["0", "2"] not in seen


@pytest.mark.slow
def test_the_default_model_under_an_adapter_equals_peft(tmp_path):
    import transformers

    from tests.helpers.models import cached_default_model

    folder = str(cached_default_model())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path, peft_model = make_peft_adapter(hf_model, tmp_path / "smol", r=16, lora_alpha=8, use_rslora=True, std=0.03)
    lora_request = LoRARequest("smol", 1, path)
    llm = LLM(folder, dtype="float32", enable_lora=True)
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = llm.tokenizer.encode(text)
        want = hf_greedy(peft_model, prompt, NUM_NEW_TOKENS)
        assert want != hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
        assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora_request)[0].token_ids == want
    conversation = [{"role": "user", "content": "Name a color."}]
    chat = llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=lora_request)[0]
    prompt = llm.apply_chat_template(conversation)
    assert chat.token_ids == hf_greedy(peft_model, prompt, NUM_NEW_TOKENS)
