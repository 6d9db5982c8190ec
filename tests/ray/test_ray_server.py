"""The server on a real two-node Ray cluster on this machine (one CPU per node).

Data-parallel cores as Ray actors (`serve --data-parallel 2 --distributed-executor-backend ray`),
one core per node: 48 concurrent requests all answered by both (real) cores; a core's actor killed
with ray.kill fails its own in-flight requests (503) while the other core keeps serving, and Ray
restarts it, and the frontend reconnects (fake cores there, scripts/lib/fake_engine.py: the real
protocol, no model, so the fault's timing is the frontend's and Ray's alone).

The real cores run a tiny random Llama (4 heads, 2 KV heads) carrying SmolLM2's tokenizer.

Tensor parallelism over Ray behind the server (a real core, a tiny model): a worker actor killed
with ray.kill mid-request fails the request with a 503 at once, /health says 503 until
--restart-engine's fresh core (and fresh actors) is up, and a request after that succeeds.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from scripts.lib.fake_engine import FrontendServer
from tests.helpers.ray_cluster import alive_actors, local_cluster
from tests.helpers.server import fake_core, health, wait_for
from tests.server.test_tp_server import tiny_model_with_tokenizer  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(180)]
SERVER_ARGS = ("--data-parallel", "2", "--distributed-executor-backend", "ray")


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(num_nodes=2) as cluster:
        yield cluster


def engine_feed(url: str, seconds: float = 0.0) -> list[dict]:
    """The dashboard feed's events for `seconds` (at least one): per core, whether it is alive,
    and the tokens it generated meanwhile (summed over its step columns)."""
    engines, deadline = None, time.monotonic() + seconds
    with requests.get(f"{url}/dashboard/events", stream=True, timeout=10) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])["engines"]
            for engine in event:
                engine["num_tokens"] = sum(p + d for p, d in engine["steps"])
                if engines is not None:
                    engine["num_tokens"] += engines[engine["index"]]["num_tokens"]
            engines = event
            if time.monotonic() >= deadline:
                return engines
    raise AssertionError("the dashboard feed sent no event")


def core_actors() -> list:
    return [a for a in alive_actors() if a.class_name == "EngineCoreActor"]


def complete(url: str, max_tokens: int) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens,
                                                       "ignore_eos": True}, timeout=60)


REAL_CORE_ARGS = ("--engine-command", f"{sys.executable} -m engine.loop.core_process", "--dtype", "float32",
                  "--num-kv-blocks", "512", "--max-num-seqs", "16")


def test_two_ray_cores_answer_48_concurrent_requests(ray_cluster, tiny_model_with_tokenizer):
    with FrontendServer(tiny_model_with_tokenizer, *SERVER_ARGS, *REAL_CORE_ARGS) as server:
        actors = core_actors()
        assert len(actors) == 2 and len({a.node_id for a in actors}) == 2  # Ray put one on each node
        with ThreadPoolExecutor(49) as pool:
            feed = pool.submit(engine_feed, server.url, 5.0)  # watches the cores while the requests run
            time.sleep(0.5)
            responses = list(pool.map(lambda _: complete(server.url, 8), range(48)))
            engines = feed.result()
        assert [r.status_code for r in responses] == [200] * 48
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
        assert [e["is_alive"] for e in engines] == [True, True]
        print(f"tokens generated per core: {[e['num_tokens'] for e in engines]}")
        assert all(e["num_tokens"] > 0 for e in engines), "a core was never used"
    assert wait_for(lambda: not core_actors(), timeout_s=20), "a core's actor outlived the server"


def test_a_killed_ray_core_fails_its_requests_the_other_serves_and_ray_restarts_it(ray_cluster, model_folder):
    import ray

    from frontend.ray_engines import ACTOR_NAMESPACE

    with FrontendServer(model_folder, *SERVER_ARGS, *fake_core("--step-delay", "0.02")) as server:
        results = []

        def long_request() -> None:
            results.append(complete(server.url, 300))  # 6 s at 0.02 s a step

        threads = [threading.Thread(target=long_request, daemon=True) for _ in range(2)]  # one on each core
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        name = sorted(a.name for a in core_actors())[0]
        ray.kill(ray.get_actor(name, namespace=ACTOR_NAMESPACE), no_restart=False)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(30)
        # The killed core's request fails; the other core's runs to its end.
        assert sorted(r.status_code for r in results) == [200, 503], [r.text for r in results]
        print(f"the killed core's request failed: {[r.json() for r in results if r.status_code != 200]}")
        ok = complete(server.url, 4)  # the other core serves while Ray restarts the lost one
        assert ok.status_code == 200, ok.text
        assert wait_for(lambda: health(server.url) == 200, timeout_s=60), "the restarted core never reconnected"
        print(f"core back {time.monotonic() - killed_at:.1f} s after ray.kill")
        assert [e["is_alive"] for e in engine_feed(server.url)] == [True, True]
        with ThreadPoolExecutor(8) as pool:
            assert [r.status_code for r in pool.map(lambda _: complete(server.url, 4), range(8))] == [200] * 8
    assert wait_for(lambda: not core_actors(), timeout_s=20), "a core's actor outlived the server"


def test_a_killed_tp_worker_actor_gives_503_until_the_group_is_restarted(ray_cluster, tiny_model_with_tokenizer):
    import ray

    from engine.executor.ray_executor import ACTOR_NAMESPACE

    args = (*REAL_CORE_ARGS, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--restart-engine", "--engine-timeout", "30")
    with FrontendServer(tiny_model_with_tokenizer, *args) as server:
        (worker,) = [a for a in alive_actors() if a.class_name == "RayWorker"]
        results = []
        thread = threading.Thread(target=lambda: results.append(complete(server.url, 3000)), daemon=True)
        thread.start()
        time.sleep(1.0)  # mid-generation
        assert thread.is_alive(), results[0].text
        ray.kill(ray.get_actor(worker.name, namespace=ACTOR_NAMESPACE))
        killed_at = time.monotonic()
        thread.join(60)  # a bound: the 503 comes within a second or so (engine.parallel.peer_wait)
        (response,) = results
        failed_after_s = time.monotonic() - killed_at
        assert response.status_code == 503, response.text
        assert "tensor-parallel" in response.json()["error"]["message"]
        print(f"503 {failed_after_s:.2f} s after ray.kill: {response.json()['error']['message']}")
        # Down until the fresh core is up (it takes seconds: torch, Ray placement, the model).
        assert health(server.url) == 503
        assert complete(server.url, 2).status_code == 503
        assert wait_for(lambda: health(server.url) == 200, timeout_s=90), "the group never came back"
        print(f"healthy again {time.monotonic() - killed_at:.1f} s after ray.kill")
        ok = complete(server.url, 4)
        assert ok.status_code == 200, ok.text
        assert [a.name for a in alive_actors() if a.class_name == "RayWorker"] != [worker.name]  # fresh actors
    assert wait_for(lambda: not alive_actors(), timeout_s=30), "an actor outlived the server"
