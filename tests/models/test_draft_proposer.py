"""The draft model's proposer (engine/spec_decode/draft_proposer.py), driven directly: requests
with blocks from a BlockManager, as the scheduler hands them over. Its proposals must be the int4
model's own greedy continuation (an offline LLM with --quantization int4 on the whole sequence,
paged from scratch), in batches of requests at different lengths, across rounds where some
proposals were accepted and others not, across block boundaries (blocks of 4 tokens), and after
a preemption moved a request's blocks."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager, num_blocks_for
from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.core.request import Request
from engine.spec_decode.draft_proposer import DraftModelProposer
from ipc.speculative_config import SpeculativeConfig
from tests.helpers.models import make_tiny_model, quantization_runs

pytestmark = pytest.mark.skipif(not quantization_runs("int4"), reason="int4 needs AVX512_VNNI or AVX2")

BLOCK_SIZE = 4
NUM_BLOCKS = 128
K = 5
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)
ENGINE_KWARGS = dict(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("draft"), "LlamaForCausalLM", **SMALL)
    return path


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The int4 model's greedy continuation of a whole sequence, computed from nothing."""
    llm = LLM(tiny_llama, skip_tokenizer_init=True, quantization="int4", **ENGINE_KWARGS)

    def continuation(token_ids: list[int], num_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        return llm.generate([token_ids], params, use_tqdm=False)[0].token_ids

    return continuation


def make_proposer(path: str, num_speculative_tokens: int = K, **overrides) -> DraftModelProposer:
    config = EngineConfig(model=path, **ENGINE_KWARGS | overrides)
    spec = SpeculativeConfig.parse({"method": "draft", "model": "self-int4",
                                    "num_speculative_tokens": num_speculative_tokens})
    return DraftModelProposer(config, spec, ModelConfig.from_folder(path), NUM_BLOCKS, max_model_len=256)


def make_request(request_id: str, prompt: list[int], blocks: BlockManager) -> Request:
    """A request whose prompt is computed up to its last token, as after its prefill step."""
    request = Request(request_id, prompt, SamplingParams(temperature=0.0), max_tokens=64)
    request.block_ids = blocks.allocate(num_blocks_for(len(prompt) - 1, BLOCK_SIZE))
    request.num_computed_tokens = len(prompt) - 1
    return request


def accept(request: Request, blocks: BlockManager, token_ids: list[int]) -> None:
    """A verification's outcome: `token_ids` appended, every token but the last computed."""
    request.all_token_ids.extend(token_ids)
    request.num_computed_tokens = request.num_tokens - 1
    needed = num_blocks_for(request.num_computed_tokens, BLOCK_SIZE) - len(request.block_ids)
    request.block_ids += blocks.allocate(max(0, needed))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 8, 13, 30)]


def test_proposals_are_the_int4_models_greedy_continuation(tiny_llama, reference):
    proposer = make_proposer(tiny_llama)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    requests = [make_request(f"r{i}", prompt, blocks) for i, prompt in enumerate(prompts())]
    proposals = proposer.propose(requests, [K] * len(requests))
    for request, proposal in zip(requests, proposals):
        assert proposal == reference(request.all_token_ids, K)
    assert len({tuple(p) for p in proposals}) == len(proposals)  # answers that differ: a real check
    # The next rounds: request i accepts i of its proposals and then a token of the target's own
    # (here one the draft did not propose), so the catch-up starts at different places.
    for round_index in range(3):
        for i, (request, proposal) in enumerate(zip(requests, proposals)):
            num_accepted = min((i + round_index) % (K + 1), len(proposal))
            emitted = (proposal[num_accepted] + 1) % 512 if num_accepted < len(proposal) else 7
            accept(request, blocks, proposal[:num_accepted] + [emitted])
        num_tokens = [K, 2, 0, 1]  # fewer, and none for one request
        proposals = proposer.propose(requests, num_tokens)
        for request, proposal, num in zip(requests, proposals, num_tokens):
            assert proposal == (reference(request.all_token_ids, num) if num else [])


def test_draft_kv_is_reused_not_recomputed(tiny_llama, reference):
    """After a round whose proposals were all accepted, only the new tokens are computed:
    the catch-up is one decode-sized row, not the whole sequence again."""
    proposer = make_proposer(tiny_llama)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    request = make_request("r", prompts()[3], blocks)
    proposal = proposer.propose([request], [K])[0]
    accept(request, blocks, proposal[:2] + [(proposal[2] + 1) % 512])
    kv = proposer.kv["r"]
    # The prompt and the two accepted proposals stand; the emitted token is new.
    assert kv.num_valid_tokens(request, BLOCK_SIZE) == request.num_tokens - 1
    assert proposer.propose([request], [K])[0] == reference(request.all_token_ids, K)


def test_preemption_recomputes_the_draft_kv(tiny_llama, reference):
    """A preempted request comes back in other blocks, which another request's draft wrote:
    the draft starts over instead of reading them."""
    proposer = make_proposer(tiny_llama)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    first, second = (make_request(f"r{i}", prompt, blocks) for i, prompt in enumerate(prompts()[2:]))
    proposer.propose([first, second], [K, K])
    # Preempt `first`, give it `second`'s blocks (their draft KV holds another sequence), recompute.
    blocks.free(first.block_ids)
    first.block_ids, first.num_preemptions = list(second.block_ids[: len(first.block_ids)]), 1
    assert proposer.kv["r0"].num_valid_tokens(first, BLOCK_SIZE) == 0
    proposer.release("r1")
    assert proposer.propose([first], [K])[0] == reference(first.all_token_ids, K)


def test_scratch_blocks_and_the_model_length(tiny_llama, reference):
    """A request holding no block yet for its last token gets its proposals all the same (their KV
    goes to scratch blocks); proposals never run past max_model_len; one that needs more scratch
    than there is (a request mid-prompt) gets none this time."""
    proposer = make_proposer(tiny_llama)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    request = make_request("r", prompts()[1] + [9], blocks)  # 8 computed: blocks for positions 0..7
    assert len(request.block_ids) * BLOCK_SIZE == request.num_tokens - 1
    assert proposer.propose([request], [K])[0] == reference(request.all_token_ids, K)
    long = make_request("long", list(range(1, 255)), blocks)  # 254 tokens of max_model_len 256
    assert len(proposer.propose([long], [K])[0]) == 2
    behind = make_request("behind", list(range(1, 8)), blocks)
    behind.all_token_ids.extend(range(100, 200))  # 100 tokens past its blocks
    assert proposer.propose([behind, request], [K, 0]) == [[], []]
    proposer.release("r")
    assert "r" not in proposer.kv


def test_catch_up_is_chunked(tiny_llama, reference):
    """A prompt longer than max_num_batched_tokens is caught up in several passes, with the same result."""
    proposer = make_proposer(tiny_llama, max_num_batched_tokens=8)
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    requests = [make_request(f"r{i}", prompt, blocks) for i, prompt in enumerate(prompts())]
    proposals = proposer.propose(requests, [3] * len(requests))
    assert proposer.num_forward_steps >= 54 // 8 + 2
    assert proposals == [reference(r.all_token_ids, 3) for r in requests]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, tiny_llama):
    other, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL | dict(vocab_size=640))
    config = EngineConfig(model=tiny_llama, **ENGINE_KWARGS)
    spec = SpeculativeConfig.parse({"method": "draft", "model": other, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config.model .* vocabulary of 640 tokens.* 512"):
        DraftModelProposer(config, spec, ModelConfig.from_folder(tiny_llama), NUM_BLOCKS, max_model_len=256)


def test_a_draft_folder_of_the_same_vocabulary_runs(tmp_path, tiny_llama):
    """PATH: another model with the target's vocabulary drafts as it is (here in fp32), greedily."""
    other, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **SMALL | dict(num_hidden_layers=1))
    config = EngineConfig(model=tiny_llama, dtype="float32", **ENGINE_KWARGS)
    spec = SpeculativeConfig.parse({"method": "draft", "model": other, "num_speculative_tokens": 3})
    proposer = DraftModelProposer(config, spec, ModelConfig.from_folder(tiny_llama), NUM_BLOCKS, max_model_len=256)
    assert proposer.runner.model_config.num_layers == 1
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    request = make_request("r", prompts()[1], blocks)
    llm = LLM(other, skip_tokenizer_init=True, dtype="float32", **ENGINE_KWARGS)
    expected = llm.generate([request.all_token_ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    assert proposer.propose([request], [3])[0] == expected


@pytest.mark.parametrize("num_kv_blocks", [NUM_BLOCKS, 16])  # 16 blocks of 4: the four requests preempt each other
def test_engine_greedy_with_self_int4_equals_speculation_off(tiny_llama, num_kv_blocks):
    """Through the engine (the scheduler's proposals, verification, rollback): the fp32 target's
    greedy tokens are the same with the int4 draft as without, and the draft's tokens were used."""
    kwargs = ENGINE_KWARGS | dict(num_kv_blocks=num_kv_blocks, dtype="float32")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 17, 30, 9)]
    off = LLM(tiny_llama, skip_tokenizer_init=True, **kwargs)
    expected = [o.token_ids for o in off.generate(prompts(), params, use_tqdm=False)]
    spec = {"method": "draft", "model": "self-int4", "num_speculative_tokens": 4}
    llm = LLM(tiny_llama, skip_tokenizer_init=True, speculative_config=spec, **kwargs)
    assert [o.token_ids for o in llm.generate(prompts(), params, use_tqdm=False)] == expected
    assert llm.engine.proposer.draft.num_proposed_tokens > 0
    if num_kv_blocks == 16:
        assert llm.engine.scheduler.num_preemptions > 0
