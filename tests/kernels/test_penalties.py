"""Penalties and logit_bias: the kernel against the torch ops, and greedy tokens against a
transformers reference loop that applies vLLM's formulas to the model's own logits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.penalties import PenaltyState

VOCAB_SIZE = 1000
NUM_NEW_TOKENS = 40


def _filled_state(kernels) -> tuple[PenaltyState, torch.Tensor]:
    state = PenaltyState(VOCAB_SIZE, torch.device("cpu"), kernels)
    slots = [state.slot_for(f"r{i}", list(range(i, i + 30)), [7] * i + list(range(900, 905))) for i in range(12)]
    return state, torch.tensor(slots)


@pytest.mark.parametrize("repetition", [1.0, 1.3, 0.7])
def test_kernel_gives_the_torch_ops_bits(repetition):
    from engine.cpu.extension import load_cpu_kernels

    torch.manual_seed(0)
    logits = torch.randn(16, VOCAB_SIZE) * 5
    logits[3, 11] = float("-inf")
    rows = torch.tensor([0, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 15])
    results = []
    for kernels in (None, load_cpu_kernels()):
        state, slots = _filled_state(kernels)
        out = logits.clone()
        n = len(rows)
        state.apply(out, rows, slots, torch.full((n,), repetition), torch.linspace(-2, 2, n), torch.linspace(2, -2, n),
                    has_repetition=repetition != 1.0)
        results.append(out)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], logits)
    untouched = [r for r in range(16) if r not in rows.tolist()]
    assert torch.equal(results[0][untouched], logits[untouched])


def test_counts_follow_recorded_tokens_and_slots_are_reused():
    state = PenaltyState(VOCAB_SIZE, torch.device("cpu"))
    slots = torch.tensor([state.slot_for(f"r{i}", [1, 2], [5, 5, 6]) for i in range(10)])  # grows past 8
    assert state.output_counts.shape[0] == 16
    assert state.output_counts[slots[0], 5] == 2 and state.prompt_mask[slots[0], 1]
    state.record(slots, torch.full((10,), 6))
    assert state.output_counts[slots[3], 6] == 2
    state.release("r3")
    reused = state.slot_for("new", [9], [])
    assert reused == int(slots[3])
    assert state.output_counts[reused].sum() == 0 and state.prompt_mask[reused].sum() == 1


def reference_penalised_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with transformers' forward, the penalties applied as vLLM does."""
    bias = dict(params.logit_bias)
    input_ids = torch.tensor([prompt])
    output: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float().clone()  # [vocab_size]
            for token_id, value in bias.items():
                logits[token_id] += max(-100.0, min(100.0, value))
            counts = torch.zeros_like(logits)
            for token_id in output:
                counts[token_id] += 1
            if params.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(prompt)] = True
                penalised = torch.where(logits > 0, logits / params.repetition_penalty,
                                        logits * params.repetition_penalty)
                logits = torch.where(seen, penalised, logits)
            logits = logits - counts * params.frequency_penalty
            logits = logits - (counts > 0).float() * params.presence_penalty
            next_id = int(logits.argmax())
            output.append(next_id)
            input_ids = torch.tensor([[next_id]])
    return output


REPEATING_PROMPT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,"

CASES = {
    "repetition": dict(repetition_penalty=1.3),
    "frequency_and_presence": dict(frequency_penalty=0.8, presence_penalty=0.6),
    "negative_frequency": dict(frequency_penalty=-0.5),
    # positive, negative and -100 entries; the test adds -100 on each prompt's first greedy token
    "logit_bias": dict(logit_bias={28: 5.0, 260: -3.0, 2114: 150.0}),
}


@pytest.fixture(scope="module")
def penalised_setup(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    llm = LLM(default_model_path, dtype="float32", block_size=8)
    prompts = [tokenizer.encode(REPEATING_PROMPT), tokenizer.encode("one two three one two three one two three")]
    return model, llm, prompts


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_penalised_greedy_matches_the_reference(case, penalised_setup):
    model, llm, prompts = penalised_setup
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    unpenalised = llm.generate(prompts, plain, use_tqdm=False)
    params_list = []
    for baseline in unpenalised:
        fields = dict(CASES[case])
        if "logit_bias" in fields:
            fields["logit_bias"] = {**fields["logit_bias"], baseline.token_ids[0]: -100.0}
            fields["logit_bias"].pop(2114) if baseline is unpenalised[0] else None  # one prompt without the +150
        params_list.append(SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **fields))
    outputs = llm.generate(prompts, params_list, use_tqdm=False)
    for prompt, params, output in zip(prompts, params_list, outputs):
        assert output.token_ids == reference_penalised_greedy(model, prompt, params)
    # The prompts repeat themselves: the penalty changes the answers.
    assert any(o.token_ids != b.token_ids for o, b in zip(outputs, unpenalised))


@pytest.mark.slow
def test_penalised_seeded_requests_give_the_same_tokens_alone_in_a_batch_and_across_preemption(default_model_path):
    penalised = [SamplingParams(temperature=0.8, seed=seed, max_tokens=24, ignore_eos=True, repetition_penalty=1.2,
                                frequency_penalty=0.4, presence_penalty=0.3, logit_bias={28: 2.0})
                 for seed in (7, 8)]
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5], [9, 8, 7, 9, 8, 7]]
    llm = LLM(default_model_path, dtype="float32", block_size=8)
    alone = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p, params in zip(prompts, penalised)]
    # 48 mixed requests: plain greedy, plain sampled, other penalties, and the two under test.
    mixed_params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                    SamplingParams(temperature=0.5, top_p=0.9, max_tokens=20, ignore_eos=True, presence_penalty=1.0)]
    batch_prompts = [[10 + i, 20 + i, 30 + i] for i in range(46)] + prompts
    batch_params = [mixed_params[i % 3] for i in range(46)] + penalised
    in_batch = [o.token_ids for o in llm.generate(batch_prompts, batch_params, use_tqdm=False)[-2:]]
    assert in_batch == alone
    tight = LLM(default_model_path, dtype="float32", block_size=8, num_kv_blocks=20)
    preempted = [o.token_ids for o in tight.generate(batch_prompts[-8:], batch_params[-8:], use_tqdm=False)[-2:]]
    assert tight.engine.scheduler.num_preemptions > 0
    assert preempted == alone
