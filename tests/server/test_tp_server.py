"""Tensor parallelism behind the real server: the multi-host path (two `tokenloom engine`
commands on loopback, one per node, serving one frontend), and a worker killed mid-step
(a 503 at once; with --restart-engine the group comes back and /health recovers).

The model is a tiny random Llama (4 heads, 2 KV heads) carrying SmolLM2's tokenizer, so the
frontend can tokenize while each step stays fast.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from frontend.client import TokenloomClient
from scripts.lib.fake_engine import REPO_ROOT, FrontendServer, free_port, subprocess_env
from tests.helpers.models import cached_default_model
from tests.helpers.models import make_tiny_model
from tests.helpers.server import health, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ENGINE_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "512", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(tmp_path_factory) -> str:
    tokenizer_folder = cached_default_model()
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny-tp"), "LlamaForCausalLM", vocab_size=49152,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=4096)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, Path(path) / name)
    return path


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def start_node(model: str, node_rank: int, master_port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "frontend.cli", "engine", "--model", model, "--tensor-parallel-size", "2",
               "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), *ENGINE_FLAGS, *extra]
    return subprocess.Popen(command, env=subprocess_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def test_two_nodes_started_apart_serve_one_frontend(tiny_model_with_tokenizer):
    model = tiny_model_with_tokenizer
    engine_port, master_port = free_port(), free_port()
    nodes = [start_node(model, 0, master_port, "--listen", f"tcp://127.0.0.1:{engine_port}"),
             start_node(model, 1, master_port)]
    try:
        with FrontendServer(model, "--engine", f"tcp://127.0.0.1:{engine_port}") as server:

            async def ask() -> list:
                client = TokenloomClient(server.url)
                try:
                    return [await client.complete("The capital of France is", max_tokens=12, temperature=0,
                                                  ignore_eos=True) for _ in range(2)]
                finally:
                    await client.close()

            first, second = asyncio.run(ask())
            assert first.finish_reason == "length" and first.text
            assert first.text == second.text  # greedy: the same on every call
            # And the seed's client: a plain requests.post to /generate, greedy, the same text.
            response = requests.post(f"{server.url}/generate", json={
                "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}, timeout=60)
            assert response.status_code == 200
            assert response.json() == {"text": ["The capital of France is" + first.text]}
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(20)


def test_killed_worker_fails_requests_with_503_and_the_group_restarts(tiny_model_with_tokenizer):
    args = ("--engine-command", f"{sys.executable} -m engine.loop.core_process", "--tensor-parallel-size", "2",
            "--restart-engine", *ENGINE_FLAGS)
    with FrontendServer(tiny_model_with_tokenizer, *args) as server:
        (core_pid,) = server.child_pids()
        (worker_pid,) = children(core_pid)
        results = []

        def long_request() -> None:
            body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True}
            results.append(requests.post(f"{server.url}/v1/completions", json=body, timeout=60))

        thread = threading.Thread(target=long_request, daemon=True)
        thread.start()
        time.sleep(1.0)  # mid-generation
        assert thread.is_alive(), results[0].text
        killed_at = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        thread.join(10)
        failed_after_s = time.monotonic() - killed_at
        (response,) = results
        assert response.status_code == 503, response.text
        assert "tensor-parallel" in response.json()["error"]["message"]
        print(f"503 {failed_after_s:.2f} s after the worker was killed: {response.json()['error']['message']}")
        assert failed_after_s < 2.5
        # --restart-engine: a fresh core with a fresh worker; /health recovers.
        assert wait_for(lambda: health(server.url) == 200, timeout_s=60)
        assert children(server.child_pids()[0]) != [worker_pid]
        ok = requests.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200
