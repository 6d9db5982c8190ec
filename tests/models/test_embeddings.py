"""Embeddings (engine.worker.pooler) end to end on a tiny random Llama in fp32, against transformers.

The reference is transformers' own forward: `model.model(ids).last_hidden_state`, the
final hidden states after the final norm, pooled the same way (the last token's, or the
mean over every position) and L2-normalized. Ours runs through the real engine: the
scheduler, paged prefill in chunks, the prefix cache, and steps that mix embedding
requests with generation.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, EngineConfig, EngineCore, PoolingParams, SamplingParams
from engine.worker.pooler import check_pooling_request
from ipc.pooling_params import POOLING_SAMPLING_PARAMS, PoolingType
from tests.helpers.models import make_tiny_model

VOCAB_SIZE = 512
MEAN = PoolingParams(PoolingType.MEAN)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("embed"), "LlamaForCausalLM")


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_tokens(n, seed=n) for n in (1, 5, 16, 37, 90)]


def reference(hf_model, token_ids: list[int], pooling: PoolingType, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0].float()  # [num_tokens, hidden_size]
    vector = hidden[-1] if pooling == PoolingType.LAST else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0).item()


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, **kwargs)


@pytest.mark.parametrize("pooling", [PoolingType.LAST, PoolingType.MEAN])
@pytest.mark.parametrize("max_num_batched_tokens", [1024, 8])  # whole prompts, or chunks of 8 across steps
def test_embeddings_equal_transformers(tiny, pooling, max_num_batched_tokens):
    path, hf_model = tiny
    llm = make_llm(path, max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.embed(PROMPTS, PoolingParams(pooling))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # input order
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.embedding) == hf_model.config.hidden_size
        assert abs(torch.tensor(output.embedding).norm().item() - 1.0) < 1e-5
        assert cosine(output.embedding, reference(hf_model, prompt, pooling)) > 1 - 1e-4
    assert llm.engine.block_manager.num_used_blocks == 0  # no KV kept after a prompt's step


def test_unnormalized_mean_equals_the_mean_itself(tiny):
    path, hf_model = tiny
    [output] = make_llm(path, max_num_batched_tokens=8).embed(PROMPTS[3], PoolingParams(PoolingType.MEAN, False))
    torch.testing.assert_close(torch.tensor(output.embedding), reference(hf_model, PROMPTS[3], PoolingType.MEAN, False),
                               atol=1e-4, rtol=1e-4)


def test_prefix_cache_hits_keep_embeddings_exact(tiny):
    """A prompt embedded twice: the second time its full blocks come from the cache (the last
    token is recomputed, so last-token pooling is exact), and mean pooling skips the cache."""
    path, hf_model = tiny
    llm = make_llm(path, enable_prefix_caching=True)
    prompt = PROMPTS[4]
    first, second = llm.embed([prompt]), llm.embed([prompt])
    assert llm.engine.scheduler.num_prefix_cache_hits > 0
    assert cosine(second[0].embedding, first[0].embedding) > 1 - 1e-6
    hits = llm.engine.scheduler.num_prefix_cache_hits
    [mean] = llm.embed([prompt], MEAN)
    assert llm.engine.scheduler.num_prefix_cache_hits == hits
    assert cosine(mean.embedding, reference(hf_model, prompt, PoolingType.MEAN)) > 1 - 1e-4


def test_an_embedding_is_the_same_alone_and_in_a_step_with_generation(tiny):
    path, hf_model = tiny
    engine = EngineCore(EngineConfig(model=path, dtype="float32", block_size=4))
    prompt = PROMPTS[3]
    alone = make_llm(path).embed([prompt])[0].embedding
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("gen-0", PROMPTS[2], greedy)
    engine.add_request("gen-1", PROMPTS[4], greedy)
    first_outputs = engine.step().outputs  # both prompts prefilled: decodes from the next step
    assert {o.request_id for o in first_outputs} == {"gen-0", "gen-1"}
    engine.add_request("emb", prompt, POOLING_SAMPLING_PARAMS, None, PoolingParams())
    scheduled = engine.scheduler.schedule  # record what the next step holds
    seen = []
    engine.scheduler.schedule = lambda: seen.append(out := scheduled()) or out
    outputs = {o.request_id: o for o in engine.step().outputs}
    # One step: the embedding's whole prompt beside two generation decodes.
    assert sorted(s.num_new_tokens for s in seen[0].scheduled) == [1, 1, len(prompt)]
    assert outputs["emb"].new_token_ids == [] and outputs["emb"].finish_reason is not None
    assert len(outputs["gen-0"].new_token_ids) == 1 and len(outputs["gen-1"].new_token_ids) == 1
    torch.testing.assert_close(torch.tensor(outputs["emb"].embedding), torch.tensor(alone), atol=1e-5, rtol=0)
    assert cosine(outputs["emb"].embedding, reference(hf_model, prompt, PoolingType.LAST)) > 1 - 1e-4
    # Its blocks went back in that same step: only the two generation requests hold any.
    held = sum(len(r.block_ids) for r in engine.scheduler.running)
    assert engine.block_manager.num_used_blocks == held and "emb" not in engine.scheduler.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_generation_is_unchanged_by_embeddings_beside_it(tiny):
    path, _ = tiny
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in make_llm(path).generate(PROMPTS[2:], greedy, use_tqdm=False)]
    engine = EngineCore(EngineConfig(model=path, dtype="float32", block_size=4))
    for i, prompt in enumerate(PROMPTS[2:]):
        engine.add_request(f"gen-{i}", prompt, greedy)
        engine.add_request(f"emb-{i}", prompt, POOLING_SAMPLING_PARAMS, None, MEAN)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert [tokens[f"gen-{i}"] for i in range(len(expected))] == expected
    assert all(tokens[f"emb-{i}"] == [] for i in range(len(expected)))


def test_pooling_runner_serves_embeddings_only_with_a_small_pool(tiny):
    path, hf_model = tiny
    generate = make_llm(path)
    pooling = make_llm(path, runner="pooling", max_num_batched_tokens=64, max_num_seqs=8)
    # One step's prefills (64 tokens in blocks of 4, a partial block per sequence) or one longest prompt.
    assert pooling.engine.num_kv_blocks == 1024 // 4 + 8 < generate.engine.num_kv_blocks
    assert pooling.engine.max_model_len == hf_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
    [output] = pooling.embed([PROMPTS[4]])
    assert cosine(output.embedding, reference(hf_model, PROMPTS[4], PoolingType.LAST)) > 1 - 1e-4


def test_bad_embedding_requests_fail_alone(tiny):
    path, _ = tiny
    llm = make_llm(path)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([[1] * 2000])
    with pytest.raises(ValueError, match="pooling_type"):
        llm.embed([[1, 2]], PoolingParams(pooling_type=7))
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()
    assert len(llm.embed([[1, 2]])) == 1


@pytest.mark.parametrize("runner", ["generate", "pooling"])
def test_an_input_as_long_as_the_context_is_embedded(tiny, runner):
    # No token is sampled, so the prompt may fill the context (vLLM's pooling models take it);
    # one token more is still refused. With --runner pooling the pool is just big enough.
    path, hf_model = tiny
    llm = make_llm(path, runner=runner, max_num_batched_tokens=256)
    max_model_len = llm.engine.max_model_len
    prompt = random_tokens(max_model_len, seed=7)
    [output] = llm.embed([prompt])
    assert cosine(output.embedding, reference(hf_model, prompt, PoolingType.LAST)) > 1 - 1e-4
    with pytest.raises(ValueError, match=f"the input is {max_model_len + 1} tokens"):
        llm.embed([prompt + [1]])
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("config", [
    {"architectures": ["BertModel"], "model_type": "bert"},
    {"architectures": ["Qwen3ForEmbedding"], "model_type": "qwen3"},
    {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta"},
], ids=lambda c: c["architectures"][0])
def test_an_embedding_architecture_is_refused_with_a_reason(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps({
        **config, "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64,
        "vocab_size": 100, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="embedding .*architecture.*--runner pooling"):
        EngineCore(EngineConfig(model=str(tmp_path), dtype="float32"))


def test_a_decoder_without_its_lm_head_is_refused_with_a_reason(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", num_hidden_layers=1)
    weights = load_file(f"{path}/model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="no LM head"):
        EngineCore(EngineConfig(model=path, dtype="float32"))


@pytest.mark.parametrize("pooling", [PoolingType.LAST, PoolingType.MEAN])
def test_tensor_parallel_embeddings_equal_one_process(tiny, pooling):
    """Under TP every rank must pick the same pooled rows out of the last layer (they travel in
    StepInputs), or the ranks' all-reduces would not meet."""
    path, hf_model = tiny
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16, num_kv_blocks=256, device="cpu")
    try:
        outputs = llm.embed(PROMPTS, PoolingParams(pooling))
    finally:
        llm.shutdown()
    for prompt, output in zip(PROMPTS, outputs):
        assert cosine(output.embedding, reference(hf_model, prompt, pooling)) > 1 - 1e-4


def test_embeddings_under_pipeline_parallelism_are_refused_not_fatal():
    """Under PP a failed step is fatal to the core, so an embedding request must be refused at the door."""
    config = EngineConfig(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline"):
        check_pooling_request(config, PoolingParams(), SamplingParams())
    with pytest.raises(ValueError, match="pipeline"):
        EngineConfig(runner="pooling", pipeline_parallel_size=2)
