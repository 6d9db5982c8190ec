"""The `tokenloom` command line: serve's flags reach the engine client; engine execs the core."""

from __future__ import annotations

import os
import sys

import pytest

from frontend import cli
from frontend.engine_connection import DEFAULT_ENGINE_COMMAND
from frontend.server_args import engine_client_config, make_parser


def test_serve_flags_build_the_engine_client_config():
    args = make_parser().parse_args(["--model", "smollm2", "--data-parallel", "2", "--max-num-seqs", "8",
                                     "--batching", "static", "--allow-remote", "--served-model-name", "m"])
    config = engine_client_config(args)
    assert (config.model, config.served_model_name, config.num_local_engines) == ("smollm2", "m", 2)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))  # two cores share this host's CPUs
    assert config.engine_args == ["--max-num-seqs", "8", "--batching", "static", "--allow-remote",
                                  "--log-level", "info", "--num-threads", share]
    assert config.engine_command == DEFAULT_ENGINE_COMMAND and config.engine_addresses == []
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_data_parallel_tensor_parallel_cores_share_the_cpus_unless_told():
    def engine_args(*flags):
        return engine_client_config(make_parser().parse_args(["--model", "smollm2", *flags])).engine_args

    share = str(max(1, len(os.sched_getaffinity(0)) // 4))
    assert engine_args("--data-parallel", "2", "--tensor-parallel-size", "2")[-2:] == ["--num-threads", share]
    assert "--num-threads" not in engine_args()  # one core: torch's default, or the TP ranks' own share
    assert engine_args("--data-parallel", "2", "--num-threads", "3").count("--num-threads") == 1


def test_engine_addresses_and_hidden_engine_command():
    args = make_parser().parse_args(["--engine", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "--engine", "ipc:///x",
                                     "--engine-command", "python fake.py --step-delay 1"])
    config = engine_client_config(args)
    assert config.engine_addresses == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "ipc:///x"]
    assert config.engine_command == ("python", "fake.py", "--step-delay", "1")
    with pytest.raises(ValueError, match="--data-parallel"):
        engine_client_config(make_parser().parse_args(["--engine", "tcp://127.0.0.1:1", "--data-parallel", "2"]))


def test_serve_runs_the_api_server(monkeypatch):
    import frontend.api_server

    seen = []
    monkeypatch.setattr(frontend.api_server, "serve", seen.append)
    cli.main(["serve", "--model", "m", "--port", "9", "--api-key", "k"])
    assert (seen[0].model, seen[0].port, seen[0].api_key) == ("m", 9, "k")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--no-such-flag"])


def test_engine_execs_the_core_with_pass_through_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: calls.append((path, argv)))
    cli.main(["engine", "--listen", "tcp://127.0.0.1:5555", "--model", "smollm2", "--max-num-seqs", "4"])
    path, argv = calls[0]
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "engine.core_process", "--model", "smollm2", "--address",
                    "tcp://127.0.0.1:5555", "--engine-id", "0", "--max-num-seqs", "4"]


def test_every_engine_flag_reaches_the_core_as_given():
    """serve declares no engine flag of its own: each EngineConfig field is a flag (--seed,
    --device and --load-format included), and what serve passes on parses in the core to
    the same config; --log-level reaches the cores too."""
    from engine.core_process import parse_args
    from ipc.engine_config import EngineConfig, engine_config_from_args

    given = ["--seed", "7", "--device", "cpu", "--load-format", "dummy", "--num-threads", "2", "--compile",
             "--no-cpu-prepack", "--kv-cache-memory", "1000", "--dtype", "float32", "--attention-backend", "torch",
             "--log-level", "debug"]
    config = engine_client_config(make_parser().parse_args(["--model", "m", *given]))
    core_args = parse_args(["--model", "m", "--address", "ipc:///tmp/x", *config.engine_args])
    assert core_args.log_level == "debug"
    assert engine_config_from_args(core_args) == EngineConfig(
        model="m", seed=7, device="cpu", load_format="dummy", num_threads=2, compile=True, cpu_prepack=False,
        kv_cache_memory_bytes=1000, dtype="float32", attention_backend="torch")
    # Nothing given: the core keeps every default of EngineConfig.
    unset = engine_client_config(make_parser().parse_args([]))
    assert engine_config_from_args(parse_args(["--address", "ipc:///tmp/x", *unset.engine_args])) == EngineConfig()
