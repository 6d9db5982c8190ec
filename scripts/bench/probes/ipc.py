"""Benchmark the frontend <-> engine-core message path with a fake core that answers at once.

Two layers, both over real ZeroMQ sockets to `scripts/lib/fake_engine.py` in its own process:

- raw:    this process is the frontend's DEALER; each request is AddRequest(max_tokens=1)
          answered by one EngineOutputs. Measures the codec + sockets alone.
- client: `AsyncEngineClient.generate` on uvloop, as the API server uses it: tokenizer-free
          token-id prompts, routing, the output pump, per-request queues, detokenizer.

Round-trip latency is measured one request at a time (p50/p99); throughput with
`--concurrency` requests in flight. messages/s counts messages both ways.

    python -m scripts.bench.probes.ipc [--num-requests 2000] [--concurrency 64] [--transport ipc|tcp] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import uvloop
import zmq

from frontend.engine_client import AsyncEngineClient, EngineClientConfig
from ipc.messages import AddRequest, EngineOutputs, EngineReady, Hello, Shutdown
from ipc.sampling_params import SamplingParams
from ipc.sockets import connect_dealer, new_ipc_address, recv_message, send_message
from scripts.lib.bench_report import write_report
from scripts.lib.fake_engine import FAKE_ENGINE_ARGV, free_port, start_fake_engine, write_fake_model


PROMPT_TOKEN_IDS = list(range(10, 42))  # 32 tokens: a short chat turn
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
RECV_TIMEOUT_MS = 10_000


def percentiles_us(samples_s: list[float]) -> dict:
    cuts = statistics.quantiles(samples_s, n=100, method="inclusive")
    return {"round_trip_p50_us": round(cuts[49] * 1e6, 1), "round_trip_p99_us": round(cuts[98] * 1e6, 1)}


def recv(sock: zmq.Socket):
    if not sock.poll(RECV_TIMEOUT_MS):
        raise TimeoutError("the fake engine stopped answering")
    return recv_message(sock)


def bench_raw(address: str, num_requests: int, concurrency: int) -> dict:
    ctx = zmq.Context()
    sock = connect_dealer(ctx, address)
    try:
        send_message(sock, Hello("bench"))
        assert isinstance(recv(sock), EngineReady)
        latencies = []
        for i in range(min(num_requests, 1000)):
            start = time.perf_counter()
            send_message(sock, AddRequest(f"lat-{i}", PROMPT_TOKEN_IDS, PARAMS, time.time()))
            while not _num_finished(recv(sock)):
                pass
            latencies.append(time.perf_counter() - start)
        num_sent = num_finished = num_messages = 0
        start = time.perf_counter()
        while num_finished < num_requests:
            while num_sent < num_requests and num_sent - num_finished < concurrency:
                send_message(sock, AddRequest(f"tput-{num_sent}", PROMPT_TOKEN_IDS, PARAMS, time.time()))
                num_sent += 1
                num_messages += 1
            num_finished += _num_finished(recv(sock))
            num_messages += 1
        elapsed = time.perf_counter() - start
        send_message(sock, Shutdown("benchmark done"))
    finally:
        sock.close(linger=200)
        ctx.term()
    return {"num_requests": num_requests, "concurrency": concurrency, **percentiles_us(latencies),
            "requests_per_s": round(num_requests / elapsed), "messages_per_s": round(num_messages / elapsed)}


def _num_finished(msg) -> int:
    return sum(o.finish_reason is not None for o in msg.outputs) if isinstance(msg, EngineOutputs) else 0


async def bench_client(model_folder: Path, num_requests: int, concurrency: int) -> dict:
    config = EngineClientConfig(model=str(model_folder), engine_command=FAKE_ENGINE_ARGV)
    client = await AsyncEngineClient.start(config)
    try:
        async def one(request_id: str) -> None:
            async for _ in await client.generate(None, PARAMS, request_id, prompt_token_ids=PROMPT_TOKEN_IDS):
                pass

        latencies = []
        for i in range(min(num_requests, 1000)):
            start = time.perf_counter()
            await one(f"lat-{i}")
            latencies.append(time.perf_counter() - start)
        slots = asyncio.Semaphore(concurrency)

        async def limited(request_id: str) -> None:
            async with slots:
                await one(request_id)

        start = time.perf_counter()
        await asyncio.gather(*(limited(f"tput-{i}") for i in range(num_requests)))
        elapsed = time.perf_counter() - start
    finally:
        await client.shutdown()
    # Each request is one AddRequest out and at least one EngineOutputs back.
    return {"num_requests": num_requests, "concurrency": concurrency, **percentiles_us(latencies),
            "requests_per_s": round(num_requests / elapsed), "messages_per_s": round(2 * num_requests / elapsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc", help="for the raw layer")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON (to stdout without PATH)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as tmp:
        model_folder = write_fake_model(Path(tmp) / "model")
        if args.transport == "tcp":
            address = f"tcp://127.0.0.1:{free_port()}"
        else:
            address = new_ipc_address("bench")
        engine = start_fake_engine(model_folder, address)
        try:
            raw = bench_raw(address, args.num_requests, args.concurrency)
        finally:
            engine.wait(10)
        client = uvloop.run(bench_client(model_folder, args.num_requests, args.concurrency))
    report = {"transport": args.transport, "raw": raw, "client": client}
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        write_report(args.json, report, indent=2)
    if args.json != "-":
        for layer in ("raw", "client"):
            r = report[layer]
            print(f"{layer:>6}: p50 {r['round_trip_p50_us']:8.1f} us  p99 {r['round_trip_p99_us']:8.1f} us  "
                  f"{r['requests_per_s']:7d} req/s  {r['messages_per_s']:7d} msg/s  ({args.transport})")


if __name__ == "__main__":
    main()
