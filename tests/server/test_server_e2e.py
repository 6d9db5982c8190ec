"""The real two-process server on the default model, through real HTTP.

One frontend (`python -m frontend.api_server`) starts one real engine core
(`python -m engine.loop.core_process`) on SmolLM2; the clients are the ones vLLM
users already have: the seed's `requests.post` script and the `openai` package.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from scripts.lib.fake_engine import FrontendServer
from tests.helpers.server import REAL_ENGINE, metric, wait_for

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--max-num-seqs", "64")


def test_seed_client_unchanged(server):
    # The seed's script: three posts to vLLM's simple api_server, as written for vLLM.
    prompts = ["San Francisco is a", "The future of AI is", "The capital of France is"]
    for prompt, max_tokens in zip(prompts, (30, 150, 50)):
        response = requests.post(f"{server.url}/generate", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert response.status_code == 200
        text = response.json()["text"]
        assert isinstance(text, list) and len(text) == 1
        assert text[0].startswith(prompt) and len(text[0]) > len(prompt)


def test_models_card_reports_the_dtype_the_core_chose(server):
    from engine.config import EngineConfig
    from engine.worker.device_and_dtype import resolve_device_and_dtype

    _, want = resolve_device_and_dtype(EngineConfig())  # the server passes no --dtype: "auto"
    card = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["dtype"] == str(want).removeprefix("torch.")


def test_openai_chat_answers_paris(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == reply.choices[0].message.content


def test_openai_completions_streamed_equals_plain(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    prompt = "Once upon a time, in a small village,"
    plain = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=40)
    assert plain.usage.completion_tokens == 40 or plain.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="smollm2", prompt=prompt, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_100_concurrent_requests_get_their_token_counts(server):
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(i: int):
            reply = await client.completions.create(
                model="smollm2", prompt=f"Request {i}: count to ten.", max_tokens=4 + i % 5,
                temperature=0.8, seed=i, extra_body={"ignore_eos": True},
            )
            return reply.usage.completion_tokens

        counts = await asyncio.gather(*(one(i) for i in range(100)))
        await client.close()
        return counts

    counts = asyncio.run(run())
    assert counts == [4 + i % 5 for i in range(100)]
    assert wait_for(lambda: metric(server.url, "kv_blocks_used") == 0)


def test_client_disconnect_aborts_and_frees_blocks(server):
    aborted_before = metric(server.url, "requests_finished_total", 'finish_reason="abort"')
    with requests.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True},
        stream=True,
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith(b"data: ") for line in received)
        assert metric(server.url, "kv_blocks_used") > 0
    # The connection is closed: the frontend aborts the request and the core frees its blocks.
    assert wait_for(lambda: metric(server.url, "kv_blocks_used") == 0 and metric(server.url, "num_requests_running") == 0)
    assert metric(server.url, "requests_finished_total", 'finish_reason="abort"') > aborted_before


def test_killed_engine_fails_requests_and_reports_503(default_model_path):
    with FrontendServer(Path(default_model_path), "--engine-command", REAL_ENGINE, "--num-kv-blocks", "256") as server:
        (core_pid,) = server.child_pids()
        with requests.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True, "stream": True},
            stream=True,
            timeout=60,
        ) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(core_pid, signal.SIGKILL)
            start = time.monotonic()
            rest = b"\n".join(lines)  # must end, not hang
            assert time.monotonic() - start < 30
        assert b"error" in rest
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 503
        response = requests.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
        assert response.status_code == 503
        assert "error" in response.json()


def test_answers_cut_mid_character_never_end_in_a_replacement_character(server, default_model_path):
    """A Chinese answer cut by max_tokens ends before the half character, served or offline."""
    from engine.llm import LLM
    from ipc.sampling_params import SamplingParams

    prompt, cuts = "介绍一下什么是大语言模型", range(20, 33)
    texts = [requests.post(f"{server.url}/generate", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                           timeout=120).json()["text"][0] for n in cuts]
    # fp32 offline: its answer is known to put a cut inside a character (the server runs the default dtype).
    llm = LLM(default_model_path, num_kv_blocks=64, max_num_seqs=16, dtype="float32")
    offline = llm.generate([prompt] * len(cuts), [SamplingParams(temperature=0, max_tokens=n) for n in cuts],
                           use_tqdm=False)
    full = offline[-1]
    # Guard: some cut really falls inside a character (its plain decode ends in U+FFFD).
    assert any(llm.tokenizer.decode(full.token_ids[:n]).endswith("\ufffd") for n in cuts)
    assert not any(t.endswith("\ufffd") for t in texts + [o.text for o in offline])
