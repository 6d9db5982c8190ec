"""Matmul rates of one model's linears: bf16 slabs against int8 and int4 panels, per step size.

The linears of --num-layers layers of the default model's shape (qkv, o, gate/up, down), random
weights, run back to back as a step runs them; each size's figure is the median of --repeats
timed passes after one warm-up, in GFLOP/s (GOP/s for the quantized kernels: two per
multiply-add either way). Needs AVX512_BF16 for the slabs and AVX512_VNNI for the panels.

    python -m scripts.bench.probes.matmul_rates --tokens 1,8,64,256,1024 --json results/matmul_rates.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cpu.extension import load_cpu_kernels
from engine.cpu.packing import pack_slabs
from engine.cpu.int4_linear import Int4Linear
from engine.cpu.int8_linear import Int8Linear
from engine.cpu.quantized_plan import plan_quantization
from scripts.lib.bench_report import machine_info, write_report

# SmolLM2-135M's linears: (out_features, in_features) of qkv, o, gate/up, down.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def time_passes(run, repeats: int) -> float:
    run()  # warm-up: first touch of the weights, oneDNN-free paths alike
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,8,64,256,1024", help="comma-separated step sizes")
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kernels = load_cpu_kernels()
    int8, int4 = plan_quantization("cpu", True, "int8"), plan_quantization("cpu", True, "int4")
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * args.num_layers
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    slabs = [pack_slabs(w.bfloat16()) for w in weights]
    int8_linears = [Int8Linear(w, None, int8) for w in weights]
    int4_linears = [Int4Linear(w, None, int4) for w in weights]
    no_bias = torch.empty(0, dtype=torch.bfloat16)
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x_bf16 = {k: torch.randn(num_tokens, k).bfloat16() for k in {k for _, k in LAYER_SHAPES}}
        x_fp32 = {k: x.float() for k, x in x_bf16.items()}  # the quantized layers' activations (dtype auto)
        runs = {
            "bf16": lambda: [kernels.small_batch_linear(x_bf16[k], s, no_bias, False) for (_, k), s in zip(shapes, slabs)],
            "int8": lambda: [m(x_fp32[k]) for (_, k), m in zip(shapes, int8_linears)],
            "int4": lambda: [m(x_fp32[k]) for (_, k), m in zip(shapes, int4_linears)],
        }
        ops = 2 * num_tokens * sum(n * k for n, k in shapes)
        row = {"num_tokens": num_tokens}
        for name, run in runs.items():
            row[f"{name}_gops"] = ops / time_passes(run, args.repeats) / 1e9
        rows.append(row)
        print(f"{num_tokens:5d} tokens: " + "  ".join(f"{n} {row[f'{n}_gops']:6.0f}" for n in runs), flush=True)
    write_report(args.json, {"layer_shapes": LAYER_SHAPES, "num_layers": args.num_layers, "repeats": args.repeats,
                             "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
