"""The whole engine on the Triton attention backend gives the torch backend's greedy tokens,
and transformers' for sliding windows (Mistral's, Gemma 3's per layer) and the other families.

Without CUDA the kernels run under Triton's interpreter (numpy on the CPU), which
is slow, so the model, prompts and outputs are tiny. The kernels need block_size
>= 16; head_dim 32 and 48 (padded to 64 inside the kernels) are both exercised.
On a GPU the same test runs the compiled kernels, in float32 (bf16 would tie-break differently).
"""

import os

import torch

# As in test_kernels.py: the interpreter must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot run")

from scripts.lib.greedy_drift import hf_greedy  # noqa: E402
import engine.attention.triton_backend as triton_backend  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels.store_kv import store_kv_kernel  # noqa: E402
from tests.helpers.models import make_tiny_model  # noqa: E402

if not torch.cuda.is_available() and type(store_kv_kernel).__name__ != "InterpretedFunction":
    pytest.skip("engine.kernels was imported before TRITON_INTERPRET=1 was set; "
                "run this file alone or set it in the environment", allow_module_level=True)

NUM_NEW_TOKENS = 10
# With 10 new tokens: one block throughout; one block growing into two; two growing into three.
PROMPT_LENGTHS = (3, 14, 30)

CASES = {
    # prefills (prefill kernel), then decode-only steps (decode kernel)
    "plain": dict(),
    # 16-token chunks: prompts span several steps, decodes ride along in the prefill kernel
    "chunked_prefill": dict(max_num_batched_tokens=16),
    # 4 blocks: all three prefill (1 + 1 + 2), then growing to 1 + 2 + 3 preempts the newest
    "preemption": dict(num_kv_blocks=4),
    # prompts padded to 30: the pad rows' own prefills beside the real ones, KV in the scratch blocks
    "static_padded": dict(batching="static-padded"),
}


def build_tiny_model(tmp_path_factory, head_dim: int):
    # 8 query heads over 2 KV heads: GQA groups of 4
    folder = tmp_path_factory.mktemp(f"triton_d{head_dim}")
    path, hf_model = make_tiny_model(folder, "LlamaForCausalLM", head_dim=head_dim)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    return path, hf_model, prompts


@pytest.fixture(scope="module")
def tiny_model_factory(tmp_path_factory):
    """Build each head_dim's model once per module, on first use."""
    models = {}

    def get(head_dim: int):
        if head_dim not in models:
            models[head_dim] = build_tiny_model(tmp_path_factory, head_dim)
        return models[head_dim]

    return get


@pytest.mark.parametrize(
    "head_dim, case",
    # every scheduling case at head_dim 32; the padded head_dim 48 (-> 64) once
    [(32, "plain"), (32, "chunked_prefill"), (32, "preemption"), (32, "static_padded"), (48, "plain")],
)
def test_triton_backend_matches_torch_backend(head_dim, case, tiny_model_factory, monkeypatch):
    path, hf_model, prompts = tiny_model_factory(head_dim)
    kernel_calls = {"prefill": 0, "decode": 0}

    def counting(kind, kernel):
        def wrapper(*args, **kwargs):
            kernel_calls[kind] += 1
            return kernel(*args, **kwargs)
        return wrapper

    for kind in ("prefill", "decode"):
        name = f"paged_{kind}_attention"
        monkeypatch.setattr(triton_backend, name, counting(kind, getattr(triton_backend, name)))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path, skip_tokenizer_init=True, block_size=16, attention_backend=backend, dtype="float32", **CASES[case]
        )
        assert llm.engine.model_runner.backend.name == backend
        llm.engine.record_step_stats = True
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.token_ids for o in outputs]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks
        if case == "chunked_prefill":  # some step really mixed a prefill chunk with decodes
            assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.step_stats)
        if case == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
        if case == "static_padded":
            assert sum(s.num_padding_tokens for s in llm.engine.step_stats) == 3 * 30 - sum(PROMPT_LENGTHS)
    assert kernel_calls["prefill"] > 0 and kernel_calls["decode"] > 0  # both kernels ran, on the triton pass only
    assert tokens["triton"] == tokens["torch"]
    assert tokens["torch"][0] == hf_greedy(hf_model, prompts[0], NUM_NEW_TOKENS)


def test_triton_backend_with_a_sliding_window(tmp_path):
    """A 16-token window (Mistral's kind, on every layer): the longest prompt and the answers
    run past it, through both Triton kernels, and the tokens equal transformers'."""
    path, hf_model = make_tiny_model(tmp_path, "MistralForCausalLM", head_dim=32, sliding_window=16)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    llm = LLM(path, skip_tokenizer_init=True, block_size=16, attention_backend="triton", dtype="float32",
              max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]


def test_triton_backend_with_gemma3_windows_per_layer(tmp_path, monkeypatch):
    """Gemma 3's layout through both Triton kernels: two sliding layers (a 16-token window,
    local rotary base) and one global layer, each kernel call taking its own layer's window;
    prompts and answers run past the window, and the tokens equal transformers'."""
    from tests.models.test_gemma3 import GEMMA_SMALL

    path, hf_model = make_tiny_model(tmp_path, "Gemma3ForCausalLM", **{**GEMMA_SMALL, "sliding_window": 16})
    windows_seen = set()
    decode = triton_backend.paged_decode_attention

    def recording(*args, window, **kwargs):
        windows_seen.add(window)
        return decode(*args, window=window, **kwargs)

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) >= 3 for tokens in expected)  # answers that vary: a real check
    monkeypatch.setattr(triton_backend, "paged_decode_attention", recording)
    llm = LLM(path, skip_tokenizer_init=True, block_size=16, attention_backend="triton", dtype="float32",
              max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert windows_seen == {16, triton_backend.NO_WINDOW}


@pytest.mark.parametrize("case", ["qwen3", "phi4_mini", "qwen3_moe", "mixtral"])
def test_triton_backend_with_other_families(case, tmp_path):
    """Qwen3's q/k norm and explicit head_dim, Phi-4-mini's partial rotary and the two MoE
    blocks run on the Triton kernels too, and give transformers' greedy tokens."""
    from tests.models.test_model_families import CASES, SMALL

    architecture, overrides = CASES[case]
    path, hf_model = make_tiny_model(tmp_path, architecture, **SMALL | overrides)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) >= 3 for tokens in expected)  # answers that vary: a real check
    llm = LLM(path, skip_tokenizer_init=True, block_size=16, attention_backend="triton", dtype="float32",
              max_num_batched_tokens=16)
    assert llm.engine.model_runner.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
