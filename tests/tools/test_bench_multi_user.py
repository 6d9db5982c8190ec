"""scripts/bench/multi_user.py without a model: its flags, llama-server's slots, and one round
against a small streaming server on loopback (the users' requests really in flight together)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from scripts.bench import multi_user, single_user
from scripts.lib.local_server import Server, free_port

NUM_TOKENS = 5
TOKEN_DELAY_S = 0.02


def test_flags_and_llama_servers_slots(tmp_path: Path):
    gguf = tmp_path / "f.gguf"
    gguf.write_bytes(b"GGUF")
    args = multi_user.parse_args(["--users", "4", "--servers", "ours-bf16", "--llama-gguf", str(gguf)])
    assert args.users == 4 and args.servers == ["ours-bf16", "llama-file"] and args.json == "results/multi_user.json"
    command = multi_user.make_server("llama-file", args, 1234).command
    assert command[command.index("-np") + 1] == "4"
    assert single_user.make_server("llama-file", args, 1234).command[command.index("-np") + 1] == "1"
    assert "-np" not in multi_user.make_server("ours-bf16", args, 1234).command


async def _round_against_a_streaming_server(num_users: int) -> tuple[dict, int]:
    in_flight, most = 0, 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, most
        body = await request.json()
        in_flight += 1
        most = max(most, in_flight)
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(TOKEN_DELAY_S)
            await response.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": len(body["prompt"])}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        in_flight -= 1
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        server = Server("fake", [], {}, f"http://127.0.0.1:{port}")
        server.process = SimpleNamespace(pid=os.getpid())  # its CPU share is read from /proc
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            prompts = [[100 + u, 200 + u] for u in range(num_users)]
            result = await multi_user.one_round(session, server, prompts, NUM_TOKENS)
    finally:
        await runner.cleanup()
    return result, most


def test_one_round_sends_the_users_together_and_counts_every_token():
    result, most_in_flight = asyncio.run(_round_against_a_streaming_server(4))
    assert most_in_flight == 4
    assert len(result["users"]) == 4 and all(u["num_completion_tokens"] == NUM_TOKENS for u in result["users"])
    # Together, the round takes about one user's time: 4 users' tokens over it, not over 4 times it.
    assert result["wall_s"] < 2.5 * NUM_TOKENS * TOKEN_DELAY_S + 0.5
    assert abs(result["output_tok_s"] - 4 * NUM_TOKENS / result["wall_s"]) < 1e-6
    assert result["output_tok_s"] > 4 * NUM_TOKENS / (4 * NUM_TOKENS * TOKEN_DELAY_S)  # faster than one at a time
