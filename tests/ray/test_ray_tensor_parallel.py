"""Tensor and pipeline parallelism over Ray (`distributed_executor_backend="ray"`) on a real
three-node Ray cluster on this machine: fp32 greedy tokens equal one process's (tiny Qwen3 and
Mixtral at TP = 2, SmolLM2 at TP = 3: 9 heads and 3 KV heads, one rank per node; a tiny Llama
at PP = 2, and at TP = 2 x PP = 2: four ranks in bundles of half a CPU), a worker actor killed
with ray.kill fails the engine at once with a clear error (even while its process lingers), and
no actor or KV block is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.models import make_tiny_model
from tests.helpers.ray_cluster import alive_actors, local_cluster
from tests.models.test_pp_equivalence import generate_smollm2, smollm2_pp1_reference
from tests.models.test_tp_equivalence import assert_same_greedy_tokens

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
ENGINE_KWARGS = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=256, device="cpu",
                     max_num_batched_tokens=16)  # chunked prefill and mixed batches
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(num_nodes=3) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def no_actor_left(ray_cluster):
    yield
    deadline = time.monotonic() + 10  # ray.kill is asynchronous
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_actors() == []


def generate(path: str, prompts, params: SamplingParams, tensor_parallel_size: int, backend: str, **kwargs):
    llm = LLM(path, tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=backend,
              **ENGINE_KWARGS | kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.block_manager.num_used_blocks == 0  # every finished request freed its blocks
        return outputs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("architecture, overrides", [
    ("Qwen3ForCausalLM", {}),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_tiny_models_tp2_over_ray_match_tp1(architecture, overrides, tmp_path):
    path, _ = make_tiny_model(tmp_path, architecture, **TINY | overrides)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    reference = generate(path, prompts, params, 1, "mp")
    outputs = generate(path, prompts, params, 2, "ray")
    max_diff = assert_same_greedy_tokens(reference, outputs)
    print(f"{architecture}: TP=2 over Ray equals TP=1; max |logprob difference| {max_diff:.2e}")
    assert max_diff < 1e-3


def test_pp2_over_ray_matches_one_process(tmp_path):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **TINY | dict(num_hidden_layers=3))
    prompts = [[5, 6, 7], list(range(40, 70))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    reference = generate(path, prompts, params, 1, "mp")
    outputs = generate(path, prompts, params, 1, "ray", pipeline_parallel_size=2)
    assert assert_same_greedy_tokens(reference, outputs) == 0.0  # the stages hand on exact activations


@pytest.mark.slow
def test_tp2_x_pp2_over_ray_matches_one_process(tmp_path):
    # Four ranks on three one-CPU nodes: bundles of a fraction of a CPU (ray_executor.bundle_num_cpus).
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **TINY | dict(num_hidden_layers=4))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1, 7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    reference = generate(path, prompts, params, 1, "mp")
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
              **ENGINE_KWARGS)
    try:
        workers = llm.engine.executor.workers
        node_ids = [workers.ray.get_runtime_context().get_node_id()]
        node_ids += [node_id for node_id, _, _ in workers.places]  # by rank
        print(f"bundles of {workers.bundle}; ranks 0-3 on nodes {[n[:8] for n in node_ids]}")
        assert workers.bundle["CPU"] < 1.0
        assert node_ids == sorted(node_ids, key=node_ids.index)  # a node's ranks are neighbours
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    max_diff = assert_same_greedy_tokens(reference, outputs)
    print(f"TP=2 x PP=2 over Ray equals TP=1, PP=1; max |logprob difference| {max_diff:.2e}")
    assert max_diff < 1e-3


@pytest.mark.slow
def test_smollm2_tp3_over_ray_matches_tp1(default_model_path):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    kwargs = dict(skip_tokenizer_init=False, block_size=16, max_num_batched_tokens=1024)
    reference = generate(default_model_path, prompts, params, 1, "mp", **kwargs)
    outputs = generate(default_model_path, prompts, params, 3, "ray", **kwargs)
    max_diff = assert_same_greedy_tokens(reference, outputs)
    print(f"smollm2: TP=3 over Ray (one rank per node) equals TP=1; max |logprob difference| {max_diff:.2e}")


@pytest.mark.slow
def test_smollm2_pp2_over_ray_on_long_prompts_matches_pp1(default_model_path):
    # Issue #54's repro: steps of over a second on a small CPU, which rank 0 once took for a lost stage.
    reference = smollm2_pp1_reference(default_model_path)
    outputs = generate_smollm2(default_model_path, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert assert_same_greedy_tokens(reference, outputs) == 0.0


def process_state(pid: int) -> str:
    """The state letter in /proc (R, S, T: stopped, Z: zombie), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_worker_actor_killed_mid_run_fails_the_engine_with_a_clear_error(tmp_path):
    """Even while its process lingers: Ray reports an actor dead at ray.kill, and its process may
    exit seconds later (its raylet's force-kill), its sockets open until then. Rank 0, waiting in
    an all-reduce, must take Ray's word (engine.parallel.peer_wait) rather than wait for them:
    the worker is stopped first (SIGSTOP), so it is still there, stopped, when the engine fails.
    Its stopped state tells rank 0 the same (process_checks.WatchedProcess): whichever rank 0's
    check, once a second, sees first names the rank."""
    import ray

    from engine.executor.executor import WorkerDeadError
    from engine.executor.ray_executor import ACTOR_NAMESPACE

    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **TINY)
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    (worker,) = [a for a in alive_actors() if a.class_name == "RayWorker"]
    try:
        errors = []

        def long_generation() -> None:
            try:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=100_000, ignore_eos=True), use_tqdm=False)
            except Exception as e:
                errors.append((e, process_state(worker.pid)))

        thread = threading.Thread(target=long_generation, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), errors
        os.kill(worker.pid, signal.SIGSTOP)  # rank 0 now waits in a collective for it
        ray.kill(ray.get_actor(worker.name, namespace=ACTOR_NAMESPACE))
        killed_at = time.monotonic()
        thread.join(30)
        ((error, worker_state),) = errors
        assert isinstance(error, WorkerDeadError), repr(error)
        print(f"{time.monotonic() - killed_at:.2f} s after ray.kill: {error}")
        assert "tensor-parallel worker rank 1" in str(error)
        assert "died (ActorDiedError" in str(error) or "is stopped (SIGSTOP)" in str(error)  # Ray's word, or /proc's
        assert worker_state == "T", f"the worker's process was {worker_state}, not stopped, when the engine failed"
    finally:
        if process_state(worker.pid) not in ("gone", "Z"):
            os.kill(worker.pid, signal.SIGKILL)
        llm.shutdown()


def test_without_ray_the_ray_backend_says_what_to_install(tmp_path, monkeypatch):
    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM", **TINY)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: `import ray` raises
    with pytest.raises(RuntimeError, match=r"pip install tokenloom\[ray\]"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
