"""Time of one model forward on the CPU, a decode step and a prefill step, as JSON.

    TOKENLOOM_CACHE=... python -m scripts.bench.probes.fused --dtype bfloat16 --repeats 10

Measures what the fused element-wise ops (engine/cpu/fused.py) change: the model's
forward alone (no scheduling, sampling or logits), on the engine's own ModelRunner set-up
(prepacked matmuls, the default CPU attention backend, fused ops where the runner picks
them). Decode: --decode-seqs sequences of one new token each, --decode-context tokens of
context. Prefill: one sequence of --prefill-len tokens. The best of --repeats runs is
reported (the host is shared; the best is the least disturbed), with the median beside it.
Runs on older trees too (before the fused ops), for an A/B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.loader.model_files import resolve_model
from engine.worker.model_runner import ModelRunner
from engine.models.config import ModelConfig


def step_inputs(query_lens: list[int], seq_lens: list[int], block_size: int):
    """input ids, positions and metadata for sequences laid out in consecutive blocks."""
    slot_mapping, positions, tables = [], [], []
    next_block = 0
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    for query_len, seq_len in zip(query_lens, seq_lens):
        num_blocks = -(-seq_len // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        tables.append(blocks + [0] * (max_blocks - num_blocks))
        for p in range(seq_len - query_len, seq_len):
            positions.append(p)
            slot_mapping.append(blocks[p // block_size] * block_size + p % block_size)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    input_ids = torch.randint(0, 1000, (len(positions),))
    return input_ids, torch.tensor(positions), metadata, next_block


def time_forward(runner: ModelRunner, inputs, repeats: int) -> list[float]:
    input_ids, positions, metadata, _ = inputs
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms oneDNN's primitive cache
            start = time.perf_counter()
            runner.backend.prepare(metadata)  # once per step, as the model runner does
            runner.model(input_ids, positions, runner.kv_caches, runner.backend)
            times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    path = resolve_model(args.model)
    model_config = ModelConfig.from_folder(path)
    decode = step_inputs([1] * args.decode_seqs, [args.decode_context] * args.decode_seqs, args.block_size)
    prefill = step_inputs([args.prefill_len], [args.prefill_len], args.block_size)
    num_blocks = max(decode[3], prefill[3])
    config = EngineConfig(model=path, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.decode_seqs)
    runner = ModelRunner(config, model_config, num_blocks, max(args.decode_context, args.prefill_len))
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(),
              "fused": getattr(runner.model.layers[0].mlp, "fused", None) is not None}
    for name, inputs in (("decode", decode), ("prefill", prefill)):
        times = time_forward(runner, inputs, args.repeats)
        result[name] = {"num_tokens": int(inputs[0].shape[0]), "best_ms": round(min(times) * 1e3, 2),
                        "median_ms": round(statistics.median(times) * 1e3, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
