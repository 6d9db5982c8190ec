"""The opt-in compiled forward (engine.worker.compilation): same greedy tokens as eager in fp32,
one graph for every step size, and its cache kept per CPU under tokenloom's cache."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker import compilation
from engine.worker.compilation import INDUCTOR_CACHE_ENV, inductor_cache_dir
from engine.cpu.host import cpu_key
from tests.helpers.models import make_tiny_model


def test_inductor_cache_is_per_cpu_under_tokenloom_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(compilation, "_user_cache_dir", None)
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/tmp/torchinductor_root")  # torch's own default, filled in later
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    assert inductor_cache_dir() == str(tmp_path / "inductor" / cpu_key())
    monkeypatch.setattr(compilation, "_user_cache_dir", "/somewhere/else")  # set before start-up: the user's choice
    assert inductor_cache_dir() == "/somewhere/else"


def test_enforce_eager_keeps_the_plain_path(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")
    runner = LLM(path, skip_tokenizer_init=True, device="cpu", compile=True, enforce_eager=True).engine.model_runner
    assert not runner.is_compiled and runner.compiled_forward is None
    assert not LLM(path, skip_tokenizer_init=True, device="cpu").engine.model_runner.is_compiled  # off by default


@pytest.mark.slow
def test_compiled_fp32_matches_eager_without_recompiles(tmp_path):
    from torch._dynamo.utils import counters

    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 5, 17, 40, 133, 9, 64)]
    # Staggered lengths and a small token budget: steps of many sizes, chunked prefills beside decodes.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 3, 24, 11, 40, 7, 18)]
    common = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=48)
    eager = LLM(path, **common).generate(prompts, params, use_tqdm=False)

    llm = LLM(path, compile=True, **common)
    assert llm.engine.model_runner.is_compiled
    num_graphs = counters["stats"]["unique_graphs"]
    assert num_graphs >= 2  # the warm-up compiled (or loaded) the single- and multi-token graphs
    llm.engine.record_step_stats = True
    compiled = llm.generate(prompts, params, use_tqdm=False)
    assert len({s.num_tokens for s in llm.engine.step_stats}) >= 8  # the sizes it ran without recompiling
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert counters["stats"]["unique_graphs"] == num_graphs  # no recompiles across step sizes
