"""The CPU decode attention kernel alone: time per call and the K/V bytes it reads a second.

    python -m scripts.bench.probes.decode_attention --num-seqs 64 --context 256 --json results/decode_attention.json
    python -m scripts.bench.probes.decode_attention --num-seqs 1 --num-heads 32 --num-kv-heads 8 \
        --context 256 1024 2048 --dtype float32 --evict-mb 64 --json OUT    # the 1B GGUF's decode

One call is one layer of a decode step: --num-seqs sequences of --context cached tokens each,
SmolLM2's heads by default (9 query heads on 3 KV heads of 64), the blocks of every sequence
scattered through the pool in random order as a long-running engine leaves them. The K/V read
is num_seqs x context x KV heads x head_dim x 2 (K and V) x the element size; GB/s is that
over the median call time, GFLOP/s the two products' multiply-adds (q.k and p.v) over it.
At the defaults one layer's K and V (12.6 MB in bf16) fit in a large L3, so the figure is then
the kernel's own rate, not the memory's; `--num-layers 30` cycles through that many distinct
caches, as a decode step's layers do. `--evict-mb N` reads an N MB buffer before every call
(outside the timed part), so each call reads its K and V from memory, as in a decode step
where the layer's weights have just gone through the cache. The caches lie on transparent huge
pages as the engine's KV pool does (`--pages 4k`: not). Several --context values run one
after the other in one process, each a row of the report.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cpu.extension import load_cpu_kernels
from engine.cpu.huge_pages import empty_on_huge_pages
from scripts.lib.bench_report import write_report

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
POOL_BYTES = 16 << 20  # each cache at least this large, so its blocks lie on several huge pages


def on_pages(t: torch.Tensor, pages: str) -> torch.Tensor:
    """t itself (4 KB pages), or a copy on transparent huge pages, as the engine's KV pool lies."""
    if pages == "4k":
        return t
    out = empty_on_huge_pages(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def measure(kernels, args: argparse.Namespace, context: int) -> dict:
    """One context's row: the median over repeats of the mean call time."""
    dtype = DTYPES[args.dtype]
    blocks_per_seq = -(-context // args.block_size)
    num_used = args.num_seqs * blocks_per_seq
    block_bytes = args.num_kv_heads * args.block_size * args.head_dim * dtype.itemsize
    num_blocks = max(num_used, POOL_BYTES // block_bytes)  # the used blocks spread over a pool of huge pages
    shape = (num_blocks, args.num_kv_heads, args.block_size, args.head_dim)
    caches = [(on_pages(torch.randn(shape).to(dtype), args.pages), on_pages(torch.randn(shape).to(dtype), args.pages))
              for _ in range(args.num_layers)]
    block_tables = torch.randperm(num_blocks)[:num_used].int().view(args.num_seqs, blocks_per_seq).contiguous()
    seq_lens = torch.full((args.num_seqs,), context, dtype=torch.int32)
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim).to(dtype)
    scale = args.head_dim ** -0.5
    evict = torch.ones(args.evict_mb * 2**18, dtype=torch.float32) if args.evict_mb else None  # touched: real pages

    def run(num_calls: int) -> float:
        total = 0.0
        for i in range(num_calls):
            k_cache, v_cache = caches[i % len(caches)]
            if evict is not None:
                evict.sum()  # read, as a step's weights are: clean lines, no write-backs during the call
            start = time.perf_counter()
            kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, 0)
            total += time.perf_counter() - start
        return total / num_calls

    calls = args.calls if evict is None else max(20, args.calls // 10)
    run(max(10, calls // 10))  # warm-up
    call_s = statistics.median(run(calls) for _ in range(args.repeats))
    kv_bytes = args.num_seqs * context * args.num_kv_heads * args.head_dim * 2 * dtype.itemsize
    flops = 2 * 2 * args.num_seqs * context * args.num_heads * args.head_dim
    result = {"context": context, "call_us": call_s * 1e6, "kv_gb_s": kv_bytes / call_s / 1e9,
              "gflop_s": flops / call_s / 1e9, "kv_bytes_per_call": kv_bytes}
    print(f"{args.dtype}: {args.num_seqs} seqs x {context} tokens{' (evicted)' if evict is not None else ''}: "
          f"{result['call_us']:.1f} us a call, K/V read {result['kv_gb_s']:.1f} GB/s, "
          f"{result['gflop_s']:.0f} GFLOP/s", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", type=int, nargs="+", default=[256], help="cached tokens a sequence (one row each)")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1, help="distinct caches cycled through, one per call")
    p.add_argument("--evict-mb", type=int, default=0, help="MB read before each call (0: none, the KV stays cached)")
    p.add_argument("--pages", choices=["huge", "4k"], default="huge",
                   help="the caches on transparent huge pages where Linux gives them (the engine's pool), or not")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--calls", type=int, default=300, help="calls a repeat (a tenth of them with --evict-mb)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    kernels = load_cpu_kernels()
    torch.manual_seed(0)
    rows = [measure(kernels, args, context) for context in args.context]
    write_report(args.json, {"config": vars(args), "threads": torch.get_num_threads(), "results": rows})


if __name__ == "__main__":
    main()
