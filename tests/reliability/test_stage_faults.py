"""A rank made slow on purpose, killed mid-step, or stopped (SIGSTOP) mid-step, behind the real
server: PP = 2 (the slow rank is the last stage: rank 0 waits on point-to-point ops) and TP = 2
(rank 0 waits in all-reduces), over the mp and the Ray executor.

Rank 1 sleeps DELAY_S in every step (engine.executor.worker_process's TOKENLOOM_TEST_STAGE_DELAY
hook), three times rank 0's one-second liveness check (engine.parallel.peer_wait), so the
tests do not depend on how fast this machine is: a slow step must give the single-process greedy
text; a killed or stopped rank a 503 naming it within a few seconds, then --restart-engine
brings a fresh group that serves again. One server per layout and executor runs all three.

The model is a tiny random Llama (2 layers, 4 heads, 2 KV heads) carrying SmolLM2's tokenizer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import requests

from engine import LLM, SamplingParams
from engine.executor.worker_process import STAGE_DELAY_ENV
from scripts.lib.fake_engine import FrontendServer
from tests.helpers.ray_cluster import alive_actors, local_cluster
from tests.helpers.server import health, is_gone, wait_for
from tests.server.test_tp_server import children, tiny_model_with_tokenizer  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DELAY_S = 3.0
PROMPT = "The capital of France is"
NUM_TOKENS = 3  # three steps of rank 1's delay each
LAYOUTS = {"pp2": ("--pipeline-parallel-size", "2"), "tp2": ("--tensor-parallel-size", "2")}
ENGINE_ARGS = ("--engine-command", f"{sys.executable} -m engine.loop.core_process", "--dtype", "float32",
               "--num-kv-blocks", "512", "--max-num-seqs", "8", "--restart-engine")
FAULT_REPORTED_S = 3.5  # one check a second, then the core's report and the frontend's answer


@pytest.fixture(scope="module")
def reference_text(tiny_model_with_tokenizer) -> str:
    llm = LLM(tiny_model_with_tokenizer, dtype="float32", num_kv_blocks=512)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].text
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(num_nodes=2) as cluster:
        yield cluster


def worker_pid(server, backend: str) -> int:
    """Rank 1's process: the core's child under mp, the one RayWorker actor under Ray."""
    if backend == "mp":
        (pid,) = wait_for(lambda: children(server.child_pids()[0]), 30, what="the worker process")
        return pid
    (actor,) = [a for a in alive_actors() if a.class_name == "RayWorker"]
    return actor.pid


def complete(url: str, max_tokens: int, timeout_s: float = 120) -> requests.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def fault_mid_step(server, pid: int, fault: signal.Signals) -> tuple[requests.Response, float]:
    """Send `fault` to rank 1 while it sleeps in a step of a long request; (the reply, seconds after)."""
    replies = []
    thread = threading.Thread(target=lambda: replies.append(complete(server.url, 1000)), daemon=True)
    thread.start()
    time.sleep(DELAY_S / 2)  # the request's first step: rank 0 waits for rank 1, asleep
    assert thread.is_alive(), replies[0].text
    os.kill(pid, fault)
    faulted_at = time.monotonic()
    thread.join(60)
    (reply,) = replies
    return reply, time.monotonic() - faulted_at


@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=pytest.mark.ray)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_slow_stage_serves_a_killed_or_stopped_one_gives_503_then_recovers(
        backend, layout, request, monkeypatch, tiny_model_with_tokenizer, reference_text):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    monkeypatch.setenv(STAGE_DELAY_ENV, f"rank=1,seconds={DELAY_S}")  # the core's workers inherit it
    args = (*ENGINE_ARGS, *LAYOUTS[layout], "--distributed-executor-backend", backend)
    with FrontendServer(tiny_model_with_tokenizer, *args) as server:
        # (a) Slow: every step waits DELAY_S for rank 1, and the text is one process's.
        started = time.monotonic()
        reply = complete(server.url, NUM_TOKENS)
        elapsed_s = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == reference_text
        assert elapsed_s >= NUM_TOKENS * DELAY_S  # the hook ran in every step
        print(f"{layout} over {backend}: {NUM_TOKENS} steps of a {DELAY_S:.0f} s stage in {elapsed_s:.1f} s, "
              "the single-process text")
        # (b) killed and (c) stopped mid-step: a 503 naming rank 1, then a fresh group serves.
        for fault in (signal.SIGKILL, signal.SIGSTOP):
            pid = worker_pid(server, backend)
            try:
                reply, failed_after_s = fault_mid_step(server, pid, fault)
                message = reply.json()["error"]["message"] if reply.status_code != 200 else reply.text
                print(f"{fault.name}: {reply.status_code} {failed_after_s:.2f} s after: {message}")
                assert reply.status_code == 503, reply.text
                assert "tensor-parallel worker rank 1" in message
                assert ("stopped" if fault == signal.SIGSTOP else "exited") in message or backend == "ray"
                assert failed_after_s < FAULT_REPORTED_S
                assert wait_for(lambda: health(server.url) == 200, 120), "the group never came back"
                reply = complete(server.url, 1)  # one step through both ranks of the fresh group
                assert reply.status_code == 200, reply.text
                assert worker_pid(server, backend) != pid  # a fresh group
                # The old core's shutdown kills its workers, a stopped one too: none is left behind.
                assert wait_for(lambda: is_gone(pid), 30), f"{fault.name}: rank 1 (pid {pid}) outlived its core"
            finally:
                if not is_gone(pid):
                    os.kill(pid, signal.SIGKILL)
    if backend == "ray":
        assert wait_for(lambda: not alive_actors(), 30), "an actor outlived the server"
