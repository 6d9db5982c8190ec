"""The GGUF block kernels' weight read rate (engine/cpu/gguf_linear.py), JSON out (issue #59).

First the machine's stream rate: the run's threads (two by default) reading a 2 GB buffer with
the kernels' own threads and hand-out, a whole pass (best of 3) and 8 MB slices each timed alone
(median, fast decile); it is measured again at the end, since the load may change. Then each
type's matmul on Llama-3.2-1B's shapes (2048x2048, 8192x2048, 2048x8192, 128256x2048) at 1,
4 and 8 rows: weight bytes over the call's time, in GB/s and as a share of the stream rate (the slices'
figure with the same statistic: `share_of_stream_p10`, `share_of_stream`); the log ends with a
table of them, one line per type and shape.
Each shape is held in enough copies (random valid blocks) to pass 256 MB, cycled as a model's
layers are, so the weights come from memory rather than the L3. Each call is timed alone: the
median, and the fastest tenth (`_p10`), which on a machine shared with other work is the
kernel's own speed (a call whose thread lost its core for a while takes many times as long).
`overhead_us` is one call on a single output row: the fixed cost (quantizing the activations,
the threads' hand-out), fast decile.
The int4 (Q4_1 panels) kernel runs too where the CPU has AVX512_VNNI; there `--builds
native,avx2` times each shape on the AVX2-only build of the GGUF kernels as well (`shapes_avx2`).

    flock /tmp/bench.lock python -m scripts.bench.gguf_kernels --json results/gguf_kernels.json
"""

from __future__ import annotations

import argparse
import logging
import time

import gguf
import numpy as np
import torch

from engine.cpu.gguf_extension import load_gguf_kernels, load_gguf_kernels_avx2
from engine.cpu.gguf_linear import KERNEL_TYPE_NAMES, GgufLinear, gather_blocks_on_huge_pages, kernel_types
from scripts.lib.bench_report import machine_info, run_and_report
from scripts.lib.weight_stream import StreamProbe

logger = logging.getLogger(__name__)

SHAPES = {"qkv_o": (2048, 2048), "gate_up": (8192, 2048), "down": (2048, 8192), "lm_head": (128256, 2048)}
MIN_BYTES = 256 << 20  # per shape and type: well past the L3


def stream_rate(num_bytes: int = 2 << 30, threads: int = 2, trials: int = 3, slice_bytes: int = 8 << 20,
                min_s: float = 1.5) -> dict:
    """`threads` threads reading a `num_bytes` buffer on the matmuls' own threads and hand-out
    (the kernels' stream_read): the best whole pass of `trials`, and the buffer read a slice of
    `slice_bytes` at a time, each slice timed alone as the layers' calls are (median and fast
    decile, the figure the layers' fast deciles are held to)."""
    probe = StreamProbe(num_bytes, threads)
    whole_gb_s = probe.measure(trials)
    kernels = load_gguf_kernels()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    buffer = probe.buffer
    slices = buffer.view(-1, slice_bytes)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < len(slices):
        piece = slices[len(times) % len(slices)]
        begin = time.perf_counter()
        kernels.stream_read(piece)
        times.append(time.perf_counter() - begin)
    torch.set_num_threads(previous)
    times.sort()
    return {"threads": threads, "whole_gb_s": round(whole_gb_s, 2),
            "slice_bytes": slice_bytes, "slice_gb_s": round(slice_bytes / times[len(times) // 2] / 1e9, 2),
            "slice_gb_s_p10": round(slice_bytes / times[len(times) // 10] / 1e9, 2)}


def random_blocks(type_name: str, rows: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, bytes per row]: random codes and scales, fp16 d (and dmin) small and finite."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, in_features // block_inputs, block_bytes), dtype=np.uint8)
    d = np.full((rows, in_features // block_inputs, 1), 0.01, np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2] = d
        if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            blocks[..., 2:4] = d
    return torch.from_numpy(blocks.reshape(rows, -1))


def time_calls(layers: list, x: torch.Tensor, min_s: float) -> tuple[float, float]:
    """Seconds per call, cycling through `layers` for `min_s`: (median, tenth percentile). Each call
    is timed alone: on a shared machine a call whose thread lost its core takes many times its
    time, and the fast decile is the kernel's own speed."""
    for layer in layers[:2]:
        layer(x)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < max(len(layers), 20):
        layer = layers[len(times) % len(layers)]
        begin = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - begin)
    times.sort()
    return times[len(times) // 2], times[len(times) // 10]


class OnBuild:
    """A GgufLinear's call on another build of the kernels: the AVX2-only one (gguf_extension.py's
    load_gguf_kernels_avx2, on a CPU with AVX512-VNNI the path the native build replaced), or an
    older commit's (probes/gguf_builds_ab.py)."""

    def __init__(self, linear: GgufLinear, kernels):
        self.linear, self.kernels = linear, kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        return self.kernels.gguf_linear(x, linear.blocks, linear.layout, linear.bias, linear.out_features, False)


def measure(make_layer, num_bytes: int, in_features: int, rows_list: list[int], stream: float,
            min_s: float, huge_pages: bool = False, build: str = "native") -> dict:
    copies = max(1, -(-MIN_BYTES // num_bytes))
    layers = [make_layer(i) for i in range(copies)]
    moved = gather_blocks_on_huge_pages(layers) if huge_pages else 0  # as the engine places them
    if build == "avx2":
        layers = [OnBuild(layer, load_gguf_kernels_avx2()) for layer in layers]
    result = {"weight_bytes": num_bytes, "copies": copies, "huge_pages": moved > 0}
    for rows in rows_list:
        x = torch.randn(rows, in_features)
        median, fast = time_calls(layers, x, min_s)
        result[f"rows_{rows}"] = {"us": round(median * 1e6, 1), "gb_s": round(num_bytes / median / 1e9, 2),
                                  "us_p10": round(fast * 1e6, 1), "gb_s_p10": round(num_bytes / fast / 1e9, 2),
                                  "share_of_stream_p10": round(num_bytes / fast / 1e9 / stream["slice_gb_s_p10"], 3),
                                  "share_of_stream": round(num_bytes / median / 1e9 / stream["slice_gb_s"], 3)}
    return result


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    if not kernel_types():
        raise SystemExit("the gguf kernels do not run on this CPU (need AVX2, FMA, F16C)")
    stream = stream_rate(threads=args.threads)  # what this run's threads read at most
    logger.info("stream rate, %d threads: %s", args.threads, stream)
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    report: dict = {"stream": stream, "threads": args.threads, "rows": rows_list, "pages": args.pages, "types": {}}
    builds = args.builds.split(",")
    report["builds"] = {"native": load_gguf_kernels().dot_isa(), **({"avx2": "avx2"} if "avx2" in builds else {})}
    for type_name in args.types.split(","):
        entry: dict = {}
        for build in builds:  # side by side per shape, so both see the same minute's memory rate
            entry["shapes" if build == "native" else f"shapes_{build}"] = {}
        for shape_name in args.shapes.split(","):
            out_features, in_features = SHAPES[shape_name]
            base = random_blocks(type_name, out_features, in_features, rng)
            for build in builds:
                # copies of one random matrix: the same bytes, in separate memory
                result = measure(lambda i: GgufLinear([(type_name, base.clone())], in_features), base.numel(),
                                 in_features, rows_list, stream, args.seconds, args.pages == "huge", build)
                entry["shapes" if build == "native" else f"shapes_{build}"][shape_name] = result
                logger.info("%s %s (%s): %s", type_name, shape_name, build, result)
            del base
        one_row = GgufLinear([(type_name, random_blocks(type_name, 1, 2048, rng))], 2048)
        entry["overhead_us"] = {f"rows_{r}": round(time_calls([one_row], torch.randn(r, 2048), 0.2)[1] * 1e6, 1)
                                for r in rows_list}
        report["types"][type_name] = entry
    report["int4_q4_1"] = run_int4(rows_list, stream, args)
    report["stream_after"] = stream_rate(threads=args.threads)  # the load may have changed meanwhile
    report["machine"] = machine_info()
    log_table(report)
    return report


def log_table(report: dict) -> None:
    """Each layer's weight GB/s (fast decile) and its share of the stream rate, one line a shape."""
    logger.info("stream (slices, fast decile): %.1f GB/s before, %.1f after", report["stream"]["slice_gb_s_p10"],
                report["stream_after"]["slice_gb_s_p10"])
    layers = [(name if key == "shapes" else f"{name} {key[len('shapes_'):]}", shapes)
              for name, entry in report["types"].items() for key, shapes in entry.items() if key.startswith("shapes")]
    if "skipped" not in report["int4_q4_1"]:
        layers.append(("int4", report["int4_q4_1"]))
    for name, shapes in layers:
        for shape_name, result in shapes.items():
            cells = [f"{r} rows {result[f'rows_{r}']['gb_s_p10']:5.1f} GB/s {result[f'rows_{r}']['share_of_stream_p10']:4.0%}"
                     for r in report["rows"]]
            logger.info("%-10s %-8s %s", name, shape_name, " | ".join(cells))


def run_int4(rows_list: list[int], stream: float, args: argparse.Namespace) -> dict:
    """Our --quantization int4 kernel (Q4_1 panels) on the same shapes, where it runs (AVX512_VNNI)."""
    from engine.cpu.host import detect_cpu_features

    if not detect_cpu_features().has_avx512_vnni:
        return {"skipped": "this CPU has no AVX512_VNNI, which the int4 kernel needs"}
    from engine.cpu.int4_linear import Int4Linear
    from engine.cpu.quantized_plan import plan_quantization

    plan = plan_quantization("cpu", True, "int4")
    result = {}
    for shape_name in args.shapes.split(","):
        out_features, in_features = SHAPES[shape_name]
        weight = torch.randn(out_features, in_features)
        layer = Int4Linear(weight, None, plan)
        num_bytes = layer.panels.numel() * 4 + layer.scales.numel() * 2
        result[shape_name] = measure(lambda i: Int4Linear(weight, None, plan), num_bytes, in_features, rows_list,
                                     stream, args.seconds)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(KERNEL_TYPE_NAMES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,4,8", help="tokens per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--builds", default="native", choices=("native", "native,avx2"),
                        help="native,avx2: each shape on the AVX2-only build too (a CPU with AVX512-VNNI)")
    parser.add_argument("--seconds", type=float, default=0.6, help="timed per (type, shape, rows)")
    parser.add_argument("--pages", choices=("huge", "4k"), default="huge",
                        help="the blocks on huge pages, as the engine places them, or on 4 KB pages")
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
