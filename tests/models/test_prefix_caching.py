"""Prefix caching end to end on a tiny random Llama in fp32: greedy tokens must not change.

Every case runs the same prompts through an engine with caching on and one with
it off, and compares token for token. The prompts share prefixes of every
length that matters relative to the block size (4 here): shorter than a block,
exactly one block, one block plus one token, a whole prompt of exactly k blocks,
and the whole prompt.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import ROOT_HASH, hash_block
from tests.helpers.models import make_tiny_model

BLOCK_SIZE = 4
VOCAB_SIZE = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("prefix"), "LlamaForCausalLM")
    return path


def make_llm(model_path, enable_prefix_caching: bool, **kwargs) -> LLM:
    return LLM(
        model_path, skip_tokenizer_init=True, block_size=BLOCK_SIZE, dtype="float32",
        enable_prefix_caching=enable_prefix_caching, **kwargs,
    )  # fmt: skip


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = random_tokens(13, seed=0)  # three full blocks and one token


def variants() -> list[list[int]]:
    """Prompts sharing 3, 4, 5, 12 and 13 tokens with BASE, each with a tail of its own."""
    return [
        BASE[:3] + random_tokens(6, seed=1),  # shorter than a block: nothing to reuse
        BASE[:4] + random_tokens(5, seed=2),  # exactly one block
        BASE[:5] + random_tokens(7, seed=3),  # one block plus one token
        BASE[:12],  # the whole prompt is exactly three blocks: the last one is recomputed
        BASE[:12] + random_tokens(2, seed=4),
        list(BASE),  # the whole prompt again
    ]


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_pool_is_free(llm: LLM) -> None:
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_tokens_match_with_caching_on_and_off(model_path):
    on, off = make_llm(model_path, True), make_llm(model_path, False)
    for llm in (on, off):
        greedy(llm, [BASE])  # warm: BASE's full blocks are cached (when on)
    outputs_on, outputs_off = greedy(on, variants()), greedy(off, variants())
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    # Tokens found cached, per variant: whole blocks only, never the block with the last token.
    assert [o.num_cached_tokens for o in outputs_on] == [0, 4, 4, 8, 12, 12]
    assert [o.num_cached_tokens for o in outputs_off] == [0] * 6
    stats = on.engine.stats()
    assert stats.num_prefix_cache_hits == 40 and stats.num_prefix_cache_queries == 13 + sum(map(len, variants()))
    assert stats.num_cached_blocks > 0
    assert_pool_is_free(on)


def test_parallel_choices_share_the_first_ones_prompt(model_path):
    """n copies of one prompt in one batch: the later ones wait for the first's prefill and reuse it."""
    on, off = make_llm(model_path, True), make_llm(model_path, False)
    prompt = random_tokens(21, seed=5)
    outputs_on, outputs_off = greedy(on, [prompt] * 4), greedy(off, [prompt] * 4)
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    assert [o.num_cached_tokens for o in outputs_on] == [0, 20, 20, 20]
    assert_pool_is_free(on)


def test_chunked_prefill_and_preemption(model_path):
    """A pool too small for the batch preempts; chunks are short; tokens still match."""
    kwargs = dict(num_kv_blocks=14, max_num_batched_tokens=8)
    on, off = make_llm(model_path, True, **kwargs), make_llm(model_path, False, **kwargs)
    prompts = [BASE] + variants() + [BASE[:8] + random_tokens(9, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs_on, outputs_off = greedy(on, prompts, params), greedy(off, prompts, params)
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.stats().num_prefix_cache_hits > 0
    assert_pool_is_free(on)


def test_eviction(model_path):
    """Other prompts push BASE's blocks out of a small pool; its variants are then recomputed, correctly."""
    on, off = make_llm(model_path, True, num_kv_blocks=12), make_llm(model_path, False, num_kv_blocks=12)
    fillers = [random_tokens(17, seed=10 + i) for i in range(3)]
    for llm in (on, off):
        greedy(llm, [BASE])
        for filler in fillers:  # one at a time: each takes blocks from the free list's front
            greedy(llm, [filler])
    manager = on.engine.block_manager
    assert hash_block(ROOT_HASH, BASE[:4]) not in manager.cached_block_ids  # evicted
    assert manager.num_cached_blocks <= manager.num_blocks
    outputs_on, outputs_off = greedy(on, variants()), greedy(off, variants())
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    assert_pool_is_free(on)


def test_static_batching(model_path):
    on, off = make_llm(model_path, True, batching="static"), make_llm(model_path, False, batching="static")
    for llm in (on, off):
        greedy(llm, [BASE])
    outputs_on, outputs_off = greedy(on, variants()), greedy(off, variants())
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    assert [o.num_cached_tokens for o in outputs_on] == [0, 4, 4, 8, 12, 12]
    assert_pool_is_free(on)


def test_reset_prefix_cache(model_path):
    llm = make_llm(model_path, True)
    greedy(llm, [BASE])  # 13 prompt tokens and 6 generated: 18 computed, 4 full blocks (decode ones too)
    assert llm.engine.block_manager.num_cached_blocks == 4
    assert llm.reset_prefix_cache() == 4
    assert llm.engine.block_manager.num_cached_blocks == 0
    assert [o.num_cached_tokens for o in greedy(llm, [BASE])] == [0]
