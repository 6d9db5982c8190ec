"""Tensor parallelism on the CPU: TP = 2 vs TP = 1, and the time each step spends in all-reduce.

    python -m scripts.bench.tp --json results/bench_tp.json

The model is SmolLM2-135M's shape with 8 heads (2 KV heads) of 64 instead of 9 and 3
(SmolLM2's own 9 heads do not split two ways), random weights (`load_format="dummy"`).
Runs, each on the same workload (--num-requests prompts of --prompt-len random tokens,
--output-len tokens each, greedy, all at once), driving the engine step by step:

  tp1_1thread   one process, one thread
  tp2_1thread   two ranks, one thread each (gloo all-reduce over loopback)
  tp1_2threads  one process, two threads: the same two cores used without TP
  tp2_1thread_ray  tp2_1thread with --distributed-executor-backend ray (a local Ray instance
                places the worker; the steps take the same channel as mp's)

Per run: wall time, output tokens/s, mean prefill and decode step times, and on rank 0
the all-reduces per step and their time per step (which includes waiting for the other
rank). Separately, the all-reduce's own latency between two processes for a decode-sized
and a prefill-sized tensor, with nothing else running: the communication cost per step
that a GPU cost model would price (2 per layer + 1 for the embedding). And what a step's
hand-off to one worker would cost as a Ray actor call (`ray.get(actor.method.remote(inputs))`)
against our ZeroMQ send of the same `StepInputs`: why the ray executor keeps our channel.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from scripts.lib.bench_report import write_report
from scripts.lib.make_model_config import model_config


logger = logging.getLogger("bench_tp")

# (ranks, threads per rank, executor backend)
RUNS = {"tp1_1thread": (1, 1, "mp"), "tp2_1thread": (2, 1, "mp"), "tp1_2threads": (1, 2, "mp"),
        "tp2_1thread_ray": (2, 1, "ray")}


def write_even_smollm2(folder: Path) -> str:
    config = model_config("smollm2") | {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def run_engine(model: str, tensor_parallel_size: int, num_threads: int, backend: str, args) -> dict:
    from engine.loop.engine_core import EngineCore
    from ipc.engine_config import EngineConfig
    from ipc.sampling_params import SamplingParams

    config = EngineConfig(model=model, load_format="dummy", dtype=args.dtype, tensor_parallel_size=tensor_parallel_size,
                          num_threads=num_threads, num_kv_blocks=512, max_num_seqs=args.num_requests,
                          distributed_executor_backend=backend)
    engine = EngineCore(config)
    engine.record_step_stats = True
    group = engine.model_runner.tp
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    try:
        for warm_up in (True, False):
            num_requests = 2 if warm_up else args.num_requests
            for i in range(num_requests):
                prompt = torch.randint(0, 49152, (args.prompt_len,), generator=generator).tolist()
                engine.add_request(f"{warm_up}-{i}", prompt, params)
            steps = []
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                step_start = time.perf_counter()
                reduce_before = group.all_reduce_seconds if group else 0.0
                count_before = group.num_all_reduces if group else 0
                engine.step()
                steps.append({
                    "seconds": time.perf_counter() - step_start,
                    "all_reduce_seconds": (group.all_reduce_seconds - reduce_before) if group else 0.0,
                    "num_all_reduces": (group.num_all_reduces - count_before) if group else 0,
                    "is_prefill": engine.step_stats[-1].num_prefill_tokens > 0,
                })
            wall_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    prefill = [s for s in steps if s["is_prefill"]]
    decode = [s for s in steps if not s["is_prefill"]]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else 0.0

    return {
        "tensor_parallel_size": tensor_parallel_size,
        "threads_per_rank": num_threads,
        "executor_backend": backend,
        "wall_s": wall_s,
        "output_tokens_per_s": args.num_requests * args.output_len / wall_s,
        "num_steps": len(steps),
        "decode_step_ms": 1e3 * mean(decode, "seconds"),
        "decode_all_reduce_ms_per_step": 1e3 * mean(decode, "all_reduce_seconds"),
        "prefill_step_ms": 1e3 * mean(prefill, "seconds"),
        "prefill_all_reduce_ms_per_step": 1e3 * mean(prefill, "all_reduce_seconds"),
        "all_reduces_per_step": mean(steps, "num_all_reduces"),
    }


def _all_reduce_latency_rank(rank: int, port: int, shapes: list[tuple[int, int]], repeats: int, out: str) -> None:
    from engine.parallel.parallel_state import create_group, create_store

    torch.set_num_threads(1)
    store = create_store("127.0.0.1", port, 2, is_master=rank == 0)
    group = create_group(store, rank, 2, torch.device("cpu"))  # two TP ranks, one stage
    result = {}
    for shape in shapes:
        x = torch.randn(shape)
        for _ in range(10):
            group.all_reduce(x)
        start = time.perf_counter()
        for _ in range(repeats):
            group.all_reduce(x)
        result[f"{shape[0]}x{shape[1]}"] = 1e6 * (time.perf_counter() - start) / repeats
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def all_reduce_latency_us(hidden_size: int, num_tokens: list[int], repeats: int = 200) -> dict:
    """Microseconds per fp32 all-reduce of [num_tokens, hidden_size] between two processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    shapes = [(n, hidden_size) for n in num_tokens]
    mp.spawn(_all_reduce_latency_rank, args=(port, shapes, repeats, out), nprocs=2)
    return json.loads(Path(out).read_text())


class _Echo:
    """A Ray actor that takes a step's record and answers, as a per-step Ray call would."""

    def step(self, payload: bytes) -> int:
        return len(payload)


def step_handoff_us(num_requests: int, repeats: int = 300) -> dict:
    """Microseconds to hand one decode step's `StepInputs` to a worker: a Ray actor call (sent
    and answered) against a ZeroMQ send and receive over loopback TCP (our channel)."""
    import ray
    import zmq

    from engine.executor import messages

    inputs = messages.StepInputs(list(range(num_requests)), [128] * num_requests, list(range(num_requests)),
                                 list(range(num_requests + 1)), [129] * num_requests, [1] * num_requests,
                                 [list(range(9))] * num_requests, list(range(num_requests)))
    payload = messages.encode(inputs)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    actor = ray.remote(num_cpus=0)(_Echo).remote()
    ray.get(actor.step.remote(payload))
    start = time.perf_counter()
    for _ in range(repeats):
        ray.get(actor.step.remote(payload))
    ray_us = 1e6 * (time.perf_counter() - start) / repeats
    ray.kill(actor)
    if started:
        ray.shutdown()
    ctx = zmq.Context()
    receiver, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    sender.connect(f"tcp://127.0.0.1:{port}")
    sender.send(payload)
    receiver.recv()
    start = time.perf_counter()
    for _ in range(repeats):
        sender.send(messages.encode(inputs))
        messages.decode(receiver.recv())
    zmq_us = 1e6 * (time.perf_counter() - start) / repeats
    ctx.destroy(linger=0)
    return {"ray_actor_call_us": ray_us, "zmq_send_us": zmq_us, "step_inputs_bytes": len(payload)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)}")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    model = write_even_smollm2(Path(tempfile.mkdtemp()) / "smollm2-even")
    report = {"machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                          "torch": torch.__version__, "load_average_before": os.getloadavg()},
              "config": vars(args), "runs": {}}
    for name in args.runs.split(","):
        ranks, threads, backend = RUNS[name]
        report["runs"][name] = result = run_engine(model, ranks, threads, backend, args)
        rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
        logger.info("%s: %s", name, json.dumps(rounded))
    report["all_reduce_latency_us"] = all_reduce_latency_us(512, [args.num_requests, args.num_requests * args.prompt_len])
    logger.info("all-reduce latency (us, fp32 [tokens x 512], 2 processes): %s", report["all_reduce_latency_us"])
    runs = report["runs"]
    if "tp2_1thread" in runs and "tp2_1thread_ray" in runs:
        mp, ray = runs["tp2_1thread"], runs["tp2_1thread_ray"]
        report["ray_over_mp_decode_step"] = ray["decode_step_ms"] / mp["decode_step_ms"]
        report["ray_over_mp_prefill_step"] = ray["prefill_step_ms"] / mp["prefill_step_ms"]
        logger.info("ray / mp per step: decode %.3fx, prefill %.3fx", report["ray_over_mp_decode_step"],
                    report["ray_over_mp_prefill_step"])
    report["step_handoff_us"] = step_handoff_us(args.num_requests)
    logger.info("one step's hand-off to a worker (us): %s", report["step_handoff_us"])
    report["machine"]["load_average_after"] = os.getloadavg()
    write_report(args.json, report, logger=logger)
    return report


if __name__ == "__main__":
    main()
