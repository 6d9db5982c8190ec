"""AsyncEngineClient in-process against fake engine cores (scripts/lib/fake_engine.py): no HTTP.

Covers routing, n > 1, stop strings, aborts (the fake core logs them), validation,
per-request and fatal engine errors, and engine death by process exit and by disconnect.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from frontend.engine_client import AsyncEngineClient, EngineClientConfig
from frontend.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from ipc.messages import FinishReason
from ipc.sampling_params import SamplingParams
from scripts.lib.fake_engine import FAKE_ENGINE_ARGV, SCRIPT, free_port, read_event_log, start_fake_engine

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def start_client(model_folder: Path, num_engines: int = 1, *engine_args: str, **config) -> AsyncEngineClient:
    config = EngineClientConfig(model=str(model_folder), num_local_engines=num_engines, engine_args=list(engine_args),
                                engine_command=FAKE_ENGINE_ARGV, ready_timeout_s=20, **config)
    return await AsyncEngineClient.start(config)


async def read_all(stream) -> tuple[dict[int, str], dict[int, FinishReason], int]:
    texts, reasons, num_tokens = {}, {}, 0
    async for delta in stream:
        texts[delta.index] = texts.get(delta.index, "") + delta.text
        num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            reasons[delta.index] = delta.finish_reason
    return texts, reasons, num_tokens


def test_generate_counts_tokens_and_splits_n_by_seed(model_folder):
    async def main():
        client = await start_client(model_folder)
        try:
            texts, reasons, num_tokens = await read_all(
                await client.generate("Hello", SamplingParams(max_tokens=9, seed=0), "a", n=3))
            assert num_tokens == 27 and set(reasons.values()) == {FinishReason.LENGTH}
            # The fake core starts choice j at script offset seed + j: the choices differ.
            assert texts[0].startswith("The quick") and texts[1].startswith(" quick") and texts[2].startswith(" brown")
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()

    run(main())


def test_stop_string_finishes_and_aborts_in_the_core(model_folder, tmp_path):
    event_log = tmp_path / "events"

    async def main():
        client = await start_client(model_folder, 1, "--event-log", str(event_log), "--step-delay", "0.005")
        try:
            texts, reasons, _ = await read_all(await client.generate("Hi", SamplingParams(max_tokens=200, stop=["lazy"]), "s"))
            assert texts[0] == SCRIPT[:SCRIPT.index("lazy")] and reasons[0] == FinishReason.STOP
            await asyncio.sleep(0.3)
            assert read_event_log(event_log, "abort") == ["s"]
        finally:
            await client.shutdown()

    run(main())


def test_closing_the_stream_aborts_the_request(model_folder, tmp_path):
    event_log = tmp_path / "events"

    async def main():
        client = await start_client(model_folder, 1, "--event-log", str(event_log), "--step-delay", "0.01")
        try:
            stream = await client.generate("Hi", SamplingParams(max_tokens=1000), "slow", n=2)
            async for _ in stream:
                break
            await stream.aclose()
            never_read = await client.generate("Hi", SamplingParams(max_tokens=1000), "unread")
            never_read.close()
            await asyncio.sleep(0.3)
            assert sorted(read_event_log(event_log, "abort")) == ["slow-0", "slow-1", "unread"]
            assert client.num_in_flight == 0 and client.metrics.num_finished[FinishReason.ABORT] == 3
        finally:
            await client.shutdown()

    run(main())


def test_cancelling_the_consumer_aborts(model_folder, tmp_path):
    event_log = tmp_path / "events"

    async def main():
        client = await start_client(model_folder, 1, "--event-log", str(event_log), "--step-delay", "0.01")
        try:
            task = asyncio.create_task(read_all(await client.generate("Hi", SamplingParams(max_tokens=1000), "c")))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.sleep(0.3)
            assert read_event_log(event_log, "abort") == ["c"]
        finally:
            await client.shutdown()

    run(main())


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "non-empty"),
    ("Hi", SamplingParams(temperature=-1), "temperature"),
    ("Hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("Hi", SamplingParams(max_tokens=5000), "maximum context length"),
    ("Hi " * 1100, SamplingParams(max_tokens=1), "maximum context length"),
])
def test_bad_requests_raise_before_streaming(model_folder, prompt, params, message):
    async def main():
        client = await start_client(model_folder)
        try:
            with pytest.raises(InvalidRequestError, match=message):
                await client.generate(prompt, params, "bad")
            with pytest.raises(InvalidRequestError, match=r"token ids"):
                await client.generate(None, SamplingParams(), "ids", prompt_token_ids=[10**6])
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()

    run(main())


def test_max_tokens_none_fills_the_context(model_folder):
    async def main():
        client = await start_client(model_folder, 1, "--max-model-len", "40")
        try:
            prompt_ids = [5] * 30
            _, reasons, num_tokens = await read_all(
                await client.generate(None, SamplingParams(max_tokens=None), "fill", prompt_token_ids=prompt_ids))
            assert num_tokens == 10 and reasons[0] == FinishReason.LENGTH
        finally:
            await client.shutdown()

    run(main())


def test_least_loaded_routing_uses_both_engines(model_folder):
    async def main():
        client = await start_client(model_folder, 2, "--step-delay", "0.005")
        try:
            streams = [await client.generate("Hi", SamplingParams(max_tokens=20), f"r{i}") for i in range(6)]
            assert [e.num_in_flight for e in client.engines] == [3, 3]
            results = await asyncio.gather(*(read_all(s) for s in streams))
            assert all(num_tokens == 20 for _, _, num_tokens in results)
        finally:
            await client.shutdown()

    run(main())


def test_engine_error_fails_only_that_request(model_folder):
    async def main():
        client = await start_client(model_folder, 1, "--fail-max-tokens", "13")
        try:
            with pytest.raises(RequestFailedError, match="fake failure"):
                await read_all(await client.generate("Hi", SamplingParams(max_tokens=13), "f"))
            _, _, num_tokens = await read_all(await client.generate("Hi", SamplingParams(max_tokens=4), "ok"))
            assert num_tokens == 4 and client.is_healthy
        finally:
            await client.shutdown()

    run(main())


def test_fatal_engine_error_kills_the_client(model_folder):
    async def main():
        client = await start_client(model_folder, 1, "--crash-max-tokens", "13", "--step-delay", "0.01")
        try:
            slow = await client.generate("Hi", SamplingParams(max_tokens=1000), "slow")
            with pytest.raises(EngineDeadError, match="fake crash"):
                await read_all(await client.generate("Hi", SamplingParams(max_tokens=13), "boom"))
            with pytest.raises(EngineDeadError):
                await read_all(slow)
            assert not client.is_healthy
            with pytest.raises(EngineDeadError):
                await client.generate("Hi", SamplingParams(), "after")
        finally:
            await client.shutdown()

    run(main())


def test_killed_local_engine_fails_in_flight_requests(model_folder):
    async def main():
        client = await start_client(model_folder, 2, "--step-delay", "0.01")
        try:
            streams = [await client.generate("Hi", SamplingParams(max_tokens=100), f"k{i}") for i in range(4)]
            os.kill(client.engines[0].process.pid, signal.SIGKILL)
            outcomes = await asyncio.gather(*(read_all(s) for s in streams), return_exceptions=True)
            dead = [o for o in outcomes if isinstance(o, EngineDeadError)]
            assert len(dead) == 2 and "exited with code -9" in str(dead[0])
            assert not client.is_healthy
        finally:
            await client.shutdown()  # still aborts the survivors on engine 1 and stops it

    run(main())


def test_remote_engine_death_is_seen_as_a_disconnect(model_folder):
    port = free_port()
    engine = start_fake_engine(model_folder, f"tcp://127.0.0.1:{port}", "--step-delay", "0.01")

    async def main():
        client = await start_client(model_folder, engine_addresses=[f"tcp://127.0.0.1:{port}"])
        try:
            stream = await client.generate("Hi", SamplingParams(max_tokens=1000), "remote")
            await stream.__anext__()
            engine.kill()
            with pytest.raises(EngineDeadError, match="disconnected"):
                await read_all(stream)
            assert not client.is_healthy
        finally:
            await client.shutdown()

    try:
        run(main())
    finally:
        engine.kill()
        engine.wait()


def test_engine_that_never_gets_ready_fails_start(model_folder):
    async def main():
        config = EngineClientConfig(model=str(model_folder), engine_command=(sys.executable, "-c", "import sys; sys.exit(3)"))
        with pytest.raises(Exception, match="exited with code 3 before it was ready"):
            await AsyncEngineClient.start(config)

    run(main())
