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
    assert argv == [sys.executable, "-m", "engine.loop.core_process", "--model", "smollm2", "--address",
                    "tcp://127.0.0.1:5555", "--engine-id", "0", "--max-num-seqs", "4"]


def test_every_engine_flag_reaches_the_core_as_given():
    """serve declares no engine flag of its own: each EngineConfig field is a flag (--seed,
    --device and --load-format included), and what serve passes on parses in the core to
    the same config; --log-level reaches the cores too."""
    from engine.loop.core_process import parse_args
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


@pytest.mark.parametrize("value, match", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens"),
    ('{"method": "medusa", "num_speculative_tokens": 4}', "speculative_config.method"),
    ('{"method": "draft", "num_speculative_tokens": 4}', "speculative_config.model"),
    ("ngram", "must be a JSON object"),
])
def test_a_bad_speculative_config_stops_serve_and_engine_before_any_core_starts(monkeypatch, capsys, value, match):
    import subprocess

    monkeypatch.setattr(cli.os, "execv", lambda path, argv: pytest.fail("the core was started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["engine", "--listen", "tcp://127.0.0.1:5555", "--speculative-config", value])
    assert exit_info.value.code == 2 and "--speculative-config: " in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"--speculative-config: .*{match}"):
        engine_client_config(make_parser().parse_args(["--speculative-config", value]))
    # The whole command: one line naming the field, no traceback, exit 1, before any core starts.
    done = subprocess.run([sys.executable, "-m", "frontend.cli", "serve", "--speculative-config", value, "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and match in done.stderr and "Traceback" not in done.stderr
    assert "starting engine core" not in done.stderr


def test_a_good_speculative_config_reaches_the_core():
    value = '{"method": "ngram", "num_speculative_tokens": 4}'
    config = engine_client_config(make_parser().parse_args(["--speculative-config", value]))
    assert config.engine_args[:2] == ["--speculative-config", value]
