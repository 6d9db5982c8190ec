"""Sampling: the Sampler on hand-made logits, then the whole engine on a tiny
random-weight Llama against transformers (seeds, greedy equivalences, min/max
tokens, stop tokens, log-probs)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import Sampler, SamplingBatch
from scripts.lib.greedy_drift import hf_greedy
from tests.helpers.models import make_tiny_model

# ---- Sampler on hand-made logits, through the torch ops and through the CPU kernel ----


def load_kernels():
    from engine.cpu.extension import load_cpu_kernels

    try:
        return load_cpu_kernels()
    except Exception as exc:  # no compiler here; under CI the build is part of `make test`
        if os.environ.get("CI"):
            pytest.fail(f"CPU kernels unavailable: {exc}")
        pytest.skip(f"CPU kernels unavailable: {exc}")


@pytest.fixture(params=["torch ops", "cpu kernel"])
def kernels(request):
    """None: the torch ops sample; else engine/cpu/csrc/sample_rows.cpp does, for the rows
    without top-k, top-p or min-p (those rows stay on the torch ops either way)."""
    return None if request.param == "torch ops" else load_kernels()

PROBS = [0.5, 0.3, 0.15, 0.05]  # tokens 0..3, most likely first
NUM_DRAWS = 4000


def make_sampling_batch(
    num_rows: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generators: list | None = None,
    banned: list[list[int]] | None = None,
    num_logprobs: int | None = None,
) -> SamplingBatch:
    """Every row alike, as the model runner would build it for identical requests."""
    top_k = top_k if top_k > 0 else vocab_size
    return SamplingBatch(
        temperatures=torch.full((num_rows,), float(temperature)),
        top_ks=torch.full((num_rows,), top_k),
        top_ps=torch.full((num_rows,), float(top_p)),
        min_ps=torch.full((num_rows,), float(min_p)),
        generators=generators or [None] * num_rows,
        banned_token_ids=banned or [[] for _ in range(num_rows)],
        num_logprobs=[num_logprobs] * num_rows,
        is_all_greedy=temperature == 0.0,
        needs_top_k=top_k < vocab_size,
        needs_top_p=top_p < 1.0,
        needs_min_p=min_p > 0.0,
    )


def draw(probs: list[float], num_draws: int = NUM_DRAWS, seed: int = 0, kernels=None, **batch_kwargs) -> torch.Tensor:
    """Token counts over num_draws rows of the same logits, in one sampler call."""
    logits = torch.tensor(probs).log().expand(num_draws, -1).clone()
    sampler = Sampler(torch.Generator().manual_seed(seed), kernels)
    tokens = sampler.sample(logits, make_sampling_batch(num_draws, len(probs), **batch_kwargs))
    return torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=len(probs))


def test_plain_sampling_follows_the_distribution(kernels):
    counts = draw(PROBS, kernels=kernels)
    frequencies = counts / NUM_DRAWS
    assert torch.allclose(frequencies, torch.tensor(PROBS), atol=0.03), frequencies


def test_temperature_flattens_and_sharpens(kernels):
    hot = draw(PROBS, temperature=100.0, kernels=kernels) / NUM_DRAWS
    assert torch.allclose(hot, torch.full((4,), 0.25), atol=0.03), hot
    cold = draw(PROBS, temperature=0.05, kernels=kernels)
    assert cold[0] == NUM_DRAWS


def test_top_k_never_samples_outside_the_top_k():
    counts = draw(PROBS, top_k=2)
    assert counts[2:].sum() == 0
    assert counts[1] > 0.3 * NUM_DRAWS  # renormalised: 0.3 / 0.8 of the mass
    assert draw(PROBS, top_k=1)[0] == NUM_DRAWS


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    counts = draw(PROBS, top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0
    assert draw(PROBS, top_p=0.85)[3] == 0  # 0.95 before token 3
    assert draw(PROBS, top_p=1e-6)[0] == NUM_DRAWS  # the first token always stays


def test_top_p_of_one_drops_nothing_even_beside_a_top_p_row():
    # A vocabulary-sized, long-tailed row: float32 cumsum reaches 1.0 well before its tail ends,
    # so a bare `mass_before >= 1.0` would cut thousands of tokens from a row that asked for none.
    vocab_size = 49152
    logits = (torch.randn(vocab_size, generator=torch.Generator().manual_seed(0)) * 3).expand(2, -1).clone()
    batch = make_sampling_batch(2, vocab_size)
    batch.top_ps = torch.tensor([1.0, 0.5])
    batch.needs_top_p = True
    filtered = Sampler._apply_top_k_top_p(logits, batch)
    assert torch.isfinite(filtered[0]).all()
    assert torch.isinf(filtered[1]).sum() > vocab_size // 2


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    counts = draw(PROBS, min_p=0.5)  # threshold 0.25: tokens 0 and 1
    assert counts[2:].sum() == 0 and counts[1] > 0
    assert draw(PROBS, min_p=0.2)[3] == 0  # threshold 0.1 drops only token 3
    assert draw(PROBS, min_p=1.0)[0] == NUM_DRAWS


def test_top_k_top_p_min_p_per_row_in_one_batch():
    vocab_size, num_draws = 6, 300
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0]).expand(3 * num_draws, -1).clone()
    batch = make_sampling_batch(3 * num_draws, vocab_size)
    # rows cycle through three requests: top-k 2, top-p 0.5, min-p 0.9
    batch.top_ks = torch.tensor([2, vocab_size, vocab_size]).repeat(num_draws)
    batch.top_ps = torch.tensor([1.0, 0.5, 1.0]).repeat(num_draws)
    batch.min_ps = torch.tensor([0.0, 0.0, 0.9]).repeat(num_draws)
    batch.needs_top_k = batch.needs_top_p = batch.needs_min_p = True
    tokens = Sampler(torch.Generator().manual_seed(0)).sample(logits, batch)
    seen = [{t.token_id for t in tokens[row::3]} for row in range(3)]
    assert seen[0] == {0, 1}  # top-k 2
    assert seen[1] == {0, 1}  # softmax: p0 ~ 0.44 < 0.5, so token 1 joins
    assert seen[2] == {0}  # min-p 0.9 of the top keeps only the top


def test_greedy_rows_and_banned_tokens(kernels):
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [3.0, 2.0, 1.0, 0.0]])
    batch = make_sampling_batch(3, 4, temperature=0.0, banned=[[], [1], [0, 1, 2]])
    tokens = Sampler(torch.Generator().manual_seed(0), kernels).sample(logits.clone(), batch)
    assert [t.token_id for t in tokens] == [1, 2, 3]
    # a greedy row inside a sampled batch is still the argmax (of what is not banned)
    batch = make_sampling_batch(3, 4, banned=[[], [1], [0, 1, 2]])
    batch.temperatures = torch.tensor([0.0, 0.0, 1.0])
    tokens = Sampler(torch.Generator().manual_seed(0), kernels).sample(logits.clone(), batch)
    assert [t.token_id for t in tokens] == [1, 2, 3]
    counts = draw(PROBS, banned=[[0]] * NUM_DRAWS, kernels=kernels)
    assert counts[0] == 0 and counts[1] > counts[2] > counts[3]


def test_sample_greedy_takes_the_same_tokens_as_a_greedy_batch(kernels):
    """The plain-greedy step's path (no SamplingBatch) gives sample()'s tokens: ties to the first,
    a -inf stretch, bf16 logits, one row and several."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 40, (7, 1001), generator=generator).float()  # [7, 1001], ties everywhere
    logits[:, :300] = float("-inf")
    sampler = Sampler(torch.Generator().manual_seed(0), kernels)
    for rows in (logits[:1], logits, logits.bfloat16()):
        expected = sampler.sample(rows.clone(), make_sampling_batch(rows.shape[0], rows.shape[1], temperature=0.0))
        tokens = sampler.sample_greedy(rows.clone())
        assert [t.token_id for t in tokens] == [t.token_id for t in expected]
        assert [t.token_id for t in tokens] == rows.float().argmax(dim=-1).tolist()
        assert all(t.logprobs is None for t in tokens)


def test_only_plain_greedy_requests_skip_the_sampling_batch():
    """is_plain_greedy: greedy and nothing else; log-probs, a bias, a pending min_tokens or a
    temperature send the step through the SamplingBatch."""
    from engine.core.request import Request
    from engine.worker.step_inputs import is_plain_greedy

    def request(**params):
        sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params})
        return Request("r", [1, 2, 3], sampling, sampling.max_tokens)

    assert is_plain_greedy(request())
    assert is_plain_greedy(request(ignore_eos=True, stop=["x"]))  # stop strings are the frontend's
    assert not is_plain_greedy(request(temperature=0.7))
    assert not is_plain_greedy(request(logprobs=2))
    assert not is_plain_greedy(request(logit_bias={5: 1.0}))
    assert not is_plain_greedy(request(repetition_penalty=1.2))
    pending = request(min_tokens=2)
    assert not is_plain_greedy(pending)  # EOS is banned until two tokens are out
    pending.append_token(7)
    assert not is_plain_greedy(pending)
    pending.append_token(8)
    assert is_plain_greedy(pending)


def test_a_seeded_row_draws_the_same_in_any_batch(kernels):
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(3)), 0).tolist()
    logits = torch.tensor(probs).log()

    def sample_seeded_row(num_rows: int, row: int, shared_seed: int) -> list[int]:
        generators = [None] * num_rows
        generators[row] = torch.Generator().manual_seed(1234)
        sampler = Sampler(torch.Generator().manual_seed(shared_seed), kernels)
        batch = make_sampling_batch(num_rows, 50, generators=generators)
        return [sampler.sample(logits.expand(num_rows, -1).clone(), batch)[row].token_id for _ in range(20)]

    alone = sample_seeded_row(1, 0, shared_seed=0)
    assert sample_seeded_row(5, 3, shared_seed=7) == alone
    assert sample_seeded_row(2, 0, shared_seed=9) == alone
    assert len(set(alone)) > 1


def test_the_kernel_takes_torchs_argmax_and_draws_by_inverse_cdf_over_a_whole_vocabulary():
    kernels = load_kernels()
    vocab_size, num_rows = 49152, 64
    generator = torch.Generator().manual_seed(0)
    # Greedy: quantised logits tie often, and torch.argmax takes the first of the ties;
    # a banned (-inf) stretch and a vocabulary that is not a whole number of vectors too.
    ties = torch.randint(0, 50, (num_rows, vocab_size), generator=generator).float()
    ties[:, :1000] = float("-inf")
    for logits in (ties, ties[:, : vocab_size - 5].contiguous()):
        ids = kernels.sample_rows(logits, torch.zeros(num_rows), torch.rand(num_rows, generator=generator))
        assert torch.equal(ids, logits.argmax(dim=-1))
    # Draws: mass spread over every chunk of the scan. Each token must be where the row's
    # cumulative mass (float64 here) crosses (1 - u) of the total, to within float32 rounding.
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 2
    logits[:, 7::11] = float("-inf")  # banned tokens: never drawn
    temperatures = torch.linspace(0.3, 2.0, num_rows)
    uniforms = torch.rand(num_rows, generator=generator)
    uniforms[:2] = torch.tensor([0.0, 1.0 - 2**-24])  # the target at the whole mass, at almost none
    ids = kernels.sample_rows(logits, temperatures, uniforms)
    probs = torch.softmax(logits.double() / temperatures.double().unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    for row, token in enumerate(ids.tolist()):
        assert probs[row, token] > 0
        target = (1 - float(uniforms[row])) * float(cdf[row, -1])
        before = float(cdf[row, token - 1]) if token > 0 else 0.0
        assert before - 1e-5 <= target <= float(cdf[row, token]) + 1e-5, (row, token)


def test_logprobs_are_of_the_raw_distribution_sorted_and_of_length_n(kernels):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    expected = torch.log_softmax(logits[0], 0)
    for temperature in (0.0, 0.5):
        batch = make_sampling_batch(1, 5, temperature=temperature, banned=[[1]], num_logprobs=3)
        (token,) = Sampler(torch.Generator().manual_seed(0), kernels).sample(logits.clone(), batch)
        assert token.logprobs.token_id == token.token_id
        assert token.logprobs.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-6)
        # the banned token still shows in the model's own top-N
        assert token.logprobs.top_token_ids == [1, 2, 0]
        assert token.logprobs.top_logprobs == pytest.approx(expected[[1, 2, 0]].tolist(), abs=1e-6)
    batch = make_sampling_batch(1, 5, temperature=0.0, num_logprobs=0)
    (token,) = Sampler(torch.Generator().manual_seed(0), kernels).sample(logits.clone(), batch)
    assert token.logprobs.top_token_ids == [] and token.logprobs.logprob == pytest.approx(float(expected[1]))


# ---- the engine on a tiny random Llama ----

VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, hf_model = make_tiny_model(tmp_path_factory.mktemp("sampling"), "LlamaForCausalLM")
    return path, hf_model


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # fp32 like the transformers reference: tokens and logprobs are compared exactly.
    return LLM(tiny_llama[0], skip_tokenizer_init=True, block_size=4, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (3, 9, 20, 33, 6, 14)]


def hf_reference(model, prompt: list[int], num_new_tokens: int, stop_ids=(), min_tokens: int = 0) -> list[int]:
    """Greedy with transformers: stop ids banned while fewer than min_tokens are out, then stopping."""
    token_ids = list(prompt)
    output = []
    with torch.inference_mode():
        while len(output) < num_new_tokens:
            logits = model(input_ids=torch.tensor([token_ids])).logits[0, -1]
            if len(output) < min_tokens:
                logits[list(stop_ids)] = float("-inf")
            token_id = int(logits.argmax())
            output.append(token_id)
            token_ids.append(token_id)
            if token_id in stop_ids:
                break
    return output


def seeded(seed: int, max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(tiny_llama, llm, prompts):
    params = seeded(1234)
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0].token_ids
    assert len(alone) == 12 and len(set(alone)) > 1
    assert llm.generate(prompts[1], params, use_tqdm=False)[0].token_ids == alone

    # chunked prefills beside decodes, and a pool small enough to preempt
    busy = LLM(tiny_llama[0], skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, num_kv_blocks=24,
               dtype="float32")
    batch = [
        (prompts[3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        (prompts[0], SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)),
        (prompts[1], params),
        (prompts[2], seeded(99, max_tokens=5, top_k=50)),
        (prompts[4], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)),
        (prompts[1], params),
        (prompts[5], seeded(1234, max_tokens=10)),  # same seed, other prompt
    ]
    outputs = busy.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    assert busy.engine.scheduler.num_preemptions > 0
    assert outputs[2].token_ids == alone and outputs[5].token_ids == alone
    assert [len(o.token_ids) for o in outputs] == [8, 15, 12, 5, 20, 12, 10]
    assert busy.engine.block_manager.num_free_blocks == busy.engine.num_kv_blocks


def test_different_seeds_differ(llm, prompts):
    outputs = llm.generate([prompts[2]] * 3, [seeded(1), seeded(2), seeded(3)], use_tqdm=False)
    token_ids = [tuple(o.token_ids) for o in outputs]
    assert len(set(token_ids)) == 3


def test_greedy_equivalents_match_transformers(tiny_llama, llm, prompts):
    _, hf_model = tiny_llama
    num_new_tokens = 10
    expected = [hf_greedy(hf_model, p, num_new_tokens) for p in prompts[:3]]
    common = dict(max_tokens=num_new_tokens, ignore_eos=True)
    variants = {
        "temperature 0": SamplingParams(temperature=0.0, **common),
        "top_k 1": SamplingParams(temperature=1.0, top_k=1, **common),
        "tiny top_p": SamplingParams(temperature=1.0, top_p=1e-6, **common),
        "min_p 1": SamplingParams(temperature=1.0, min_p=1.0, **common),
        "greedy with a seed": SamplingParams(temperature=0.0, seed=5, **common),
    }
    # each variant alone (temperature 0 takes the all-greedy path) ...
    for name, params in variants.items():
        outputs = llm.generate(prompts[:3], params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, name
    # ... and all of them in one batch with a random request beside them
    batch_prompts = [p for p in prompts[:3] for _ in variants] + [prompts[3]]
    batch_params = [v for _ in prompts[:3] for v in variants.values()] + [SamplingParams(temperature=1.5, **common)]
    outputs = llm.generate(batch_prompts, batch_params, use_tqdm=False)
    for i, name in enumerate(list(variants) * 3):
        assert outputs[i].token_ids == expected[i // len(variants)], name


def test_max_tokens_is_respected(llm, prompts):
    max_tokens = [1, 2, 7, 13, 4, 20]
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == max_tokens
    assert all(o.finish_reason == "length" for o in outputs)


def test_stop_token_ids_and_min_tokens(tiny_llama, llm, prompts):
    _, hf_model = tiny_llama
    prompt = prompts[5]  # its greedy continuation comes back to its first token
    (first,) = hf_greedy(hf_model, prompt, 1)
    base = dict(temperature=0.0, max_tokens=30, stop_token_ids=[first])

    output = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0]
    assert output.token_ids == [first] and output.finish_reason == "stop" and output.stop_token_id == first

    for min_tokens in (1, 4):
        output = llm.generate(prompt, SamplingParams(min_tokens=min_tokens, **base), use_tqdm=False)[0]
        assert first not in output.token_ids[:min_tokens]
        assert output.token_ids == hf_reference(hf_model, prompt, 30, [first], min_tokens)
        # the deferred stop token does come back, and then it stops
        assert output.finish_reason == "stop" and output.stop_token_id == first, output.token_ids
        assert output.token_ids[-1] == first and len(output.token_ids) > min_tokens


@pytest.fixture(scope="module")
def eos_llama(tiny_llama, prompts, tmp_path_factory):
    """The same weights with EOS set to the greedy first token of prompts[5]."""
    path, hf_model = tiny_llama
    (eos,) = hf_greedy(hf_model, prompts[5], 1)
    eos_path = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(path, eos_path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((eos_path / name).read_text())
        config["eos_token_id"] = eos
        (eos_path / name).write_text(json.dumps(config))
    return LLM(str(eos_path), skip_tokenizer_init=True, block_size=4, dtype="float32"), eos


def test_eos_stops_unless_ignored_or_deferred(tiny_llama, eos_llama, prompts):
    _, hf_model = tiny_llama
    eos_llm, eos = eos_llama
    prompt = prompts[5]
    output = eos_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    assert output.token_ids == [eos] and output.finish_reason == "stop" and output.stop_token_id == eos

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    output = eos_llm.generate(prompt, params, use_tqdm=False)[0]
    assert output.token_ids == hf_greedy(hf_model, prompt, 12) and output.finish_reason == "length"

    output = eos_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=4), use_tqdm=False)[0]
    assert output.token_ids == hf_reference(hf_model, prompt, 30, [eos], min_tokens=4)
    assert eos not in output.token_ids[:4]
    assert output.finish_reason == "stop" and output.token_ids[-1] == eos and len(output.token_ids) > 4

    # sampled requests too: top-k 2 makes EOS a coin flip at the first token...
    params = [SamplingParams(temperature=1.0, top_k=2, seed=s, max_tokens=8) for s in range(8)]
    outputs = eos_llm.generate([prompt] * 8, params, use_tqdm=False)
    assert any(o.token_ids[0] == eos and o.finish_reason == "stop" for o in outputs)
    # ...which min_tokens takes off the table
    for p in params:
        p.min_tokens = 8
    for output in eos_llm.generate([prompt] * 8, params, use_tqdm=False):
        assert len(output.token_ids) == 8 and eos not in output.token_ids


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: transformers' log-softmax at each position that produced an output token."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)


def test_logprobs_match_transformers(tiny_llama, llm, prompts):
    _, hf_model = tiny_llama
    num_logprobs = 5
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=num_logprobs),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=num_logprobs),
        SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=num_logprobs),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    outputs = llm.generate(prompts[:5], params, use_tqdm=False)
    for prompt, params_i, output in zip(prompts[:5], params, outputs):
        if params_i.logprobs is None:
            assert output.logprobs == []
            continue
        assert len(output.logprobs) == len(output.token_ids) == 8
        reference = hf_logprobs(hf_model, prompt, output.token_ids)
        for i, (token_id, logprobs) in enumerate(zip(output.token_ids, output.logprobs)):
            assert logprobs.token_id == token_id
            assert abs(logprobs.logprob - float(reference[i, token_id])) < 1e-4
            assert len(logprobs.top_token_ids) == len(logprobs.top_logprobs) == params_i.logprobs
            assert logprobs.top_logprobs == sorted(logprobs.top_logprobs, reverse=True)
            for top_id, top_logprob in zip(logprobs.top_token_ids, logprobs.top_logprobs):
                assert abs(top_logprob - float(reference[i, top_id])) < 1e-4
            if params_i.is_greedy and params_i.logprobs:
                assert logprobs.top_token_ids[0] == token_id
                assert logprobs.top_logprobs[0] == pytest.approx(logprobs.logprob)
        if params_i.is_greedy:
            assert output.token_ids == hf_greedy(hf_model, prompt, 8)


def test_generate_with_a_bad_prompt_adds_nothing(tiny_llama):
    llm = LLM(tiny_llama[0], skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], []], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 2
