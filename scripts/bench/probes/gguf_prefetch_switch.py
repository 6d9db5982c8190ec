"""One-token GGUF calls with the kernels' software prefetch on and off, in alternating pairs, JSON out.

    flock /tmp/bench.lock python -m scripts.bench.probes.gguf_prefetch_switch --seconds 20 \
        --json results/gguf_prefetch_switch.json

The switch (gguf_dot.h's g_one_token_prefetch, `set_one_token_prefetch`) is what
engine/cpu/prefetch_tuner.py steers while decoding; this measures what it is worth on this host,
layer by layer. The host's memory rate moved by a factor of two from minute to minute on the
machines this was written on, so a figure per choice taken minutes apart says little. Here the
calls alternate on and off (which goes first flipping each pair), each on the next of layers
enough to come from memory, on huge pages as the engine places them; each pair gives a ratio
off/on, and the report gives the ratios' median over all pairs and over the pairs whose "on" call
was among the fastest 30% (the host's fast moments). Below 1: the prefetch costs this host time.

Shapes are the Llama-3.2-1B's decode matmuls in a Q4_K_M file (gate_up and most downs Q4_K, the
other downs Q6_K), on bf16 activations as the engine gives them; with `--kernels slabs`, the bf16
slabs' (small_batch_linear.cpp, which has the same switch) on SmolLM2-135M's shapes; with
`--kernels int8` or `int4`, the `--quantization` panels' (quantized/vnni_io.h's switch, one for
both) on the 1B's shapes, from random weights.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from torch import nn

from engine.cpu.extension import load_cpu_kernels
from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import gather_blocks_on_huge_pages
from engine.cpu.int4_linear import Int4Linear
from engine.cpu.int8_linear import Int8Linear, gather_panels_on_huge_pages
from engine.cpu.packing import PackedLinear, SlabPlan, gather_slabs_on_huge_pages
from engine.cpu.quantized_plan import plan_quantization
from scripts.bench.gguf_kernels import MIN_BYTES
from scripts.bench.probes.gguf_builds_ab import SHAPES, random_layers
from scripts.lib.bench_report import machine_info, run_and_report

logger = logging.getLogger(__name__)


def time_pairs(layers: list, x: torch.Tensor, set_prefetch, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each pair's call with the prefetch on and off, [num_pairs] each: pairs for
    `seconds` (at least 10), the layers taken in turn."""
    for layer in layers[:2]:
        layer(x)
    on, off = [], []
    start, i = time.perf_counter(), 0
    try:
        while time.perf_counter() - start < seconds or i < 10:
            for choice in (True, False) if i % 2 == 0 else (False, True):
                set_prefetch(choice)
                layer = layers[(2 * i + (choice != (i % 2 == 0))) % len(layers)]
                begin = time.perf_counter()
                layer(x)
                (on if choice else off).append(time.perf_counter() - begin)
            i += 1
    finally:
        set_prefetch(True)
    return np.array(on), np.array(off)


def summary(on: np.ndarray, off: np.ndarray, weight_bytes: int) -> dict:
    ratios = off / on
    fast = on <= np.percentile(on, 30)
    return {"pairs": len(ratios), "on_us": round(float(np.median(on)) * 1e6, 1),
            "off_us": round(float(np.median(off)) * 1e6, 1),
            "on_gb_s": round(weight_bytes / float(np.median(on)) / 1e9, 2),
            "off_gb_s": round(weight_bytes / float(np.median(off)) / 1e9, 2),
            "off_over_on": round(float(np.median(ratios)), 3),
            "off_over_on_fast": round(float(np.median(ratios[fast])), 3),
            "on_gb_s_fast": round(weight_bytes / float(np.median(on[fast])) / 1e9, 2)}


SLAB_SHAPES = {  # SmolLM2-135M's: name: (out_features, in_features)
    "qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576),
}


def slab_layers(out_features: int, in_features: int) -> list:
    """bf16 slabs of random weights, enough of them to pass MIN_BYTES, on huge pages."""
    kernels = load_cpu_kernels()
    plan = SlabPlan(kernels, None)
    copies = max(2, -(-MIN_BYTES // (2 * out_features * in_features)))
    layers = nn.ModuleList(PackedLinear(torch.randn(out_features, in_features).bfloat16(), None, 1, plan)
                           for _ in range(copies))
    gather_slabs_on_huge_pages(layers)
    return list(layers)


PANEL_SHAPES = {  # Llama-3.2-1B's: name: (out_features, in_features)
    "qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
}


def panel_layers(kind: str, out_features: int, in_features: int) -> tuple[list, int]:
    """int8 or int4 panels of random weights, enough of them to pass MIN_BYTES, on huge pages;
    and one layer's bytes (panels and scales)."""
    plan = plan_quantization("cpu", True, kind)
    linear = Int8Linear if kind == "int8" else Int4Linear
    first = linear(torch.randn(out_features, in_features), None, plan)
    weight_bytes = first.panels.nbytes + first.scales.nbytes
    layers = nn.ModuleList([first] + [linear(torch.randn(out_features, in_features), None, plan)
                                      for _ in range(max(1, -(-MIN_BYTES // weight_bytes) - 1))])
    gather_panels_on_huge_pages(layers)
    return list(layers), weight_bytes


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = {}
    for name in args.shapes.split(","):
        if args.kernels in ("int8", "int4"):
            (out_features, in_features), type_name = PANEL_SHAPES[name], args.kernels
            layers, weight_bytes = panel_layers(args.kernels, out_features, in_features)
            set_prefetch = plan_quantization("cpu", True, args.kernels).kernels.set_one_token_prefetch
        elif args.kernels == "slabs":
            (out_features, in_features), type_name = SLAB_SHAPES[name], "bf16"
            layers, set_prefetch = slab_layers(out_features, in_features), load_cpu_kernels().set_one_token_prefetch
            weight_bytes = 2 * out_features * in_features
        else:
            type_name, out_features, in_features = SHAPES[name]
            layers, set_prefetch = random_layers(type_name, out_features, in_features, rng), \
                load_gguf_kernels().set_one_token_prefetch
            gather_blocks_on_huge_pages(layers)
            weight_bytes = layers[0].num_weight_bytes
        x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
        on, off = time_pairs(layers, x, set_prefetch, args.seconds)
        shapes[name] = {"type": type_name, "out_features": out_features, "in_features": in_features,
                        **summary(on, off, weight_bytes)}
        logger.info("%-10s %s: on %.1f GB/s, off %.1f GB/s, off/on %.3f (%.3f in the fastest 30%% of pairs), "
                    "%d pairs", name, type_name, shapes[name]["on_gb_s"], shapes[name]["off_gb_s"],
                    shapes[name]["off_over_on"], shapes[name]["off_over_on_fast"], shapes[name]["pairs"])
    return {"kernels": args.kernels, "threads": args.threads, "seconds": args.seconds, "shapes": shapes,
            "machine": machine_info()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", choices=("gguf", "slabs", "int8", "int4"), default="gguf")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated, of {', '.join(SHAPES)} (gguf), {', '.join(SLAB_SHAPES)} (slabs) "
                             f"or {', '.join(PANEL_SHAPES)} (int8, int4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="of pairs, per shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.shapes is None:
        args.shapes = ",".join({"slabs": SLAB_SHAPES, "int8": PANEL_SHAPES, "int4": PANEL_SHAPES}.get(args.kernels,
                                                                                                    SHAPES))
    return args


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
