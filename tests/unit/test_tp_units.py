"""Tensor parallelism's small parts: the worker records, checkpoint sharding, the flags."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.executor import messages
from engine.lora.parallel_lora import LoRASlot
from engine.parallel.parallel_layers import shard_checkpoint_tensor, vocab_rows_per_rank
from engine.parallel.parallel_state import TensorParallelGroup
from engine.models.config import ModelConfig
from frontend import cli
from frontend.server_args import engine_client_config, make_parser


def test_worker_records_round_trip():
    step = messages.StepInputs([5, 6, 7], [0, 1, 2], [16, 17, 18], [0, 3], [3], [3], [[1, 0]], [2])
    pooling_step = messages.StepInputs([5, 6], [0, 1], [16, 17], [0, 2], [2], [2], [[1]], [], pooling_rows=[0, 1])
    lora_step = messages.StepInputs([5, 6], [0, 1], [16, 17], [0, 1, 2], [1, 1], [1, 1], [[1], [2]], [0, 1],
                                    lora_slots=[-1, 0], lora_adapters=[LoRASlot(0, "sql", 7, "/adapters/sql")])
    for record in (step, pooling_step, lora_step, messages.WorkerHello(1, 123), messages.WorkerReady(2), messages.StopWorker("bye")):
        assert messages.decode(messages.encode(record)) == record
    assert messages.encode(step)[:2] == bytes([0x9c, int(messages.WorkerMessageType.STEP_INPUTS)])  # [type, 11 fields]
    with pytest.raises(ValueError):
        messages.decode(messages.encode(messages.WorkerHello(1, 1))[:-1])


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(path="", architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8,
                  num_layers=1, num_heads=4, num_kv_heads=1, head_dim=1, rms_norm_eps=1e-5, rope_theta=1e4,
                  rope_scaling=None, max_position_embeddings=16, tie_word_embeddings=True, attention_bias=False)
    return ModelConfig(**fields | overrides)


def test_sharding_splits_heads_replicates_kv_and_pads_the_vocabulary():
    config = tiny_config()
    weight = torch.arange(4 * 4.0).view(4, 4)  # [out, in]: q_proj rows are heads of one
    ranks = [TensorParallelGroup(rank, 2) for rank in range(2)]
    assert [shard_checkpoint_tensor("model.layers.0.self_attn.q_proj.weight", weight, config, tp)[:, 0].tolist()
            for tp in ranks] == [[0.0, 4.0], [8.0, 12.0]]
    k = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # one KV head: both ranks keep it
    assert all(torch.equal(shard_checkpoint_tensor("layers.0.self_attn.k_proj.weight", k, config, tp), k)
               for tp in ranks)
    o = shard_checkpoint_tensor("layers.0.self_attn.o_proj.weight", weight, config, ranks[1])  # input columns
    assert o.tolist() == weight[:, 2:].tolist()
    embed = torch.arange(10.0).view(10, 1).expand(10, 4)
    assert vocab_rows_per_rank(10, 3) == 4
    last = shard_checkpoint_tensor("model.embed_tokens.weight", embed, config, TensorParallelGroup(2, 3))
    assert last[:, 0].tolist() == [8.0, 9.0, 0.0, 0.0]  # rows 8, 9 and two zero rows of padding


def test_serve_passes_tensor_parallel_flags_to_its_cores():
    args = make_parser().parse_args(["--model", "m", "--tensor-parallel-size", "2"])
    assert "--tensor-parallel-size" in engine_client_config(args).engine_args
    with pytest.raises(ValueError, match="master-port"):
        engine_client_config(make_parser().parse_args(["--data-parallel", "2", "--master-port", "29500"]))


def test_engine_on_a_later_node_execs_workers_only(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: calls.append(argv))
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29500"]
    cli.main(["engine", "--model", "m", "--node-rank", "1", *flags])
    assert calls == [[sys.executable, "-m", "engine.executor.worker_process", "--model", "m", "--node-rank", "1", *flags]]
    with pytest.raises(SystemExit):
        cli.main(["engine", "--model", "m", *flags])  # node 0 needs --listen


def test_ray_bundles_take_a_whole_cpu_where_there_is_room_else_the_largest_fraction_that_fits():
    from engine.executor.ray_executor import bundle_num_cpus

    three_nodes = {"head": 1.0, "b": 1.0, "c": 1.0}  # CI's cluster
    assert bundle_num_cpus(3, three_nodes, "head") == 1.0  # TP=3: one rank a node
    assert bundle_num_cpus(4, three_nodes, "head") == 0.5  # TP=2 x PP=2: two nodes of two ranks
    assert bundle_num_cpus(7, three_nodes, "head") == 0.3333  # 3 + 3 + 1, in Ray's 1/10,000ths
    assert bundle_num_cpus(2, {"head": 0.0, "b": 2.0}, "head") is None  # rank 0's node is full: nothing fits
    assert bundle_num_cpus(4, {"head": 1.0, "b": 1.0, "c": 0.0}, "head") == 0.5  # a node still busy: 2 + 2
    assert bundle_num_cpus(4, {"head": 0.5, "b": 0.7, "c": 0.7}, "head") == 0.3333  # 1 + 2 + 2 (at 1/2: 1 + 1 + 1)
    assert bundle_num_cpus(2, {"head": 16.0}, "head") == 1.0


def test_ray_bundles_wait_for_the_cpus_a_shut_down_engine_gives_back(monkeypatch):
    """Its actors free their CPUs a moment after the engine goes: asked too early, rank 0's node
    looks full and whole CPUs would be asked of a cluster that cannot hold them."""
    import engine.executor.ray_executor as ray_executor

    views = iter([{"head": 0.0, "b": 1.0, "c": 1.0}] * 3 + [{"head": 1.0, "b": 1.0, "c": 1.0}])
    monkeypatch.setattr(ray_executor, "free_cpus_by_node", lambda: next(views))
    monkeypatch.setattr(ray_executor, "CHECK_INTERVAL_S", 0.0)
    assert ray_executor.settle_bundle_num_cpus(4, "head", timeout_s=5.0) == 0.5
    monkeypatch.setattr(ray_executor, "free_cpus_by_node", lambda: {"head": 0.0, "b": 2.0})
    assert ray_executor.settle_bundle_num_cpus(2, "head", timeout_s=0.0) == 1.0  # still full: placement says so


def test_ray_cpus_per_worker_is_a_flag_and_must_be_positive():
    from ipc.engine_config import EngineConfig

    args = make_parser().parse_args(["--model", "m", "--distributed-executor-backend", "ray",
                                     "--ray-num-cpus-per-worker", "0.25"])
    engine_args = engine_client_config(args).engine_args
    assert engine_args[engine_args.index("--ray-num-cpus-per-worker") + 1] == "0.25"  # the cores get it
    with pytest.raises(ValueError, match="ray_num_cpus_per_worker"):
        EngineConfig(ray_num_cpus_per_worker=0.0)
