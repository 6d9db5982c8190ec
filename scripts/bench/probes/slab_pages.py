"""The bf16 slab matmuls (engine/cpu/csrc/small_batch_linear.cpp) on 4 KB pages and on huge pages.

    python -m scripts.bench.probes.slab_pages --json results/bench_slab_pages.json

Builds the default model's linear shapes (30 layers of q|k|v, o, gate|up and down, random
weights: the slabs' speed does not depend on the values) twice in one process, once as
torch allocates them and once gathered into one tensor on transparent huge pages as
engine.cpu.packing.gather_slabs_on_huge_pages does, and times a pass over all 30
layers at each step size, alternating the two layouts so that the host's drift hits both
alike. Prints GFLOP/s per layout and step size (the median of the repeats) as JSON.
Needs a CPU with AVX512_BF16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.cpu.huge_pages import huge_pages_on_request
from engine.cpu.packing import PackedLinear, SlabPlan, gather_slabs_on_huge_pages
from scripts.lib.bench_report import write_report


# SmolLM2-135M's linears as [out_features, in_features]: q|k|v merged, o, gate|up merged, down.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30


def build_layers(kernels, seed: int) -> torch.nn.ModuleList:
    generator = torch.Generator().manual_seed(seed)
    plan = SlabPlan(kernels, None)
    return torch.nn.ModuleList(
        torch.nn.ModuleDict({
            name: PackedLinear(torch.randn(n, k, generator=generator).bfloat16(), None, 64, plan)
            for name, (n, k) in SHAPES.items()
        })
        for _ in range(NUM_LAYERS)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 48, 128, 384])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    from engine.cpu.extension import load_cpu_kernels

    kernels = load_cpu_kernels()
    if not kernels.has_small_batch_linear():
        sys.exit("this CPU has no AVX512_BF16: no slabs to time")
    layouts = {"4k_pages": build_layers(kernels, 0), "huge_pages": build_layers(kernels, 0)}
    moved = gather_slabs_on_huge_pages(layouts["huge_pages"])
    result = {
        "threads": torch.get_num_threads(),
        "huge_pages_on_request": huge_pages_on_request(),
        "bytes_on_huge_pages": moved,
        "gflops": {name: {} for name in layouts},
    }
    for num_tokens in args.tokens:
        inputs = {name: torch.randn(num_tokens, k).bfloat16() for name, (_, k) in SHAPES.items()}
        flops = NUM_LAYERS * sum(2 * num_tokens * n * k for n, k in SHAPES.values())
        times = {name: [] for name in layouts}
        for _ in range(args.repeats):
            for name, layers in layouts.items():
                start = time.perf_counter()
                for layer in layers:
                    for shape_name, linear in layer.items():
                        linear(inputs[shape_name])
                times[name].append(time.perf_counter() - start)
        for name in layouts:
            result["gflops"][name][str(num_tokens)] = round(flops / statistics.median(times[name]) / 1e9, 1)
    print(json.dumps(result, indent=2))
    write_report(args.json, result, indent=2)


if __name__ == "__main__":
    main()
