"""The CPU decode attention kernel alone: time per call and the K/V bytes it reads a second.

    python -m scripts.bench.probes.decode_attention --num-seqs 64 --context 256 --json results/decode_attention.json

One call is one layer of a decode step: --num-seqs sequences of --context cached tokens each,
SmolLM2's heads by default (9 query heads on 3 KV heads of 64), the blocks of every sequence
scattered through the pool in random order as a long-running engine leaves them. The K/V read
is num_seqs x context x KV heads x head_dim x 2 (K and V) x the element size; GB/s is that
over the median call time, GFLOP/s the two products' multiply-adds (q.k and p.v) over it.
At the defaults one layer's K and V (12.6 MB in bf16) fit in a large L3, so the figure is then
the kernel's own rate, not the memory's; `--num-layers 30` cycles through that many distinct
caches, as a decode step's layers do.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cpu.extension import load_cpu_kernels
from scripts.lib.bench_report import write_report

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="cached tokens a sequence")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1, help="distinct caches cycled through, one per call")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--calls", type=int, default=300, help="calls a repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    kernels = load_cpu_kernels()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.num_seqs * blocks_per_seq
    shape = (num_blocks, args.num_kv_heads, args.block_size, args.head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.num_layers)]
    block_tables = torch.randperm(num_blocks).int().view(args.num_seqs, blocks_per_seq).contiguous()
    seq_lens = torch.full((args.num_seqs,), args.context, dtype=torch.int32)
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim).to(dtype)
    scale = args.head_dim ** -0.5

    def run(num_calls: int) -> float:
        start = time.perf_counter()
        for i in range(num_calls):
            k_cache, v_cache = caches[i % len(caches)]
            kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, 0)
        return (time.perf_counter() - start) / num_calls

    run(max(10, args.calls // 10))  # warm-up
    call_s = statistics.median(run(args.calls) for _ in range(args.repeats))
    element_size = dtype.itemsize
    kv_bytes = args.num_seqs * args.context * args.num_kv_heads * args.head_dim * 2 * element_size
    flops = 2 * 2 * args.num_seqs * args.context * args.num_heads * args.head_dim
    result = {"call_ms": call_s * 1e3, "kv_gb_s": kv_bytes / call_s / 1e9, "gflop_s": flops / call_s / 1e9,
              "kv_bytes_per_call": kv_bytes, "threads": torch.get_num_threads()}
    print(f"{args.dtype}: {args.num_seqs} seqs x {args.context} tokens: {result['call_ms']:.3f} ms a call, "
          f"K/V read {result['kv_gb_s']:.1f} GB/s, {result['gflop_s']:.0f} GFLOP/s", flush=True)
    write_report(args.json, {"config": vars(args), "results": result})


if __name__ == "__main__":
    main()
