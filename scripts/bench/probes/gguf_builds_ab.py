"""The checkout's GGUF kernels against another commit's, call by call on the same layers, JSON out.

    flock /tmp/bench.lock python -m scripts.bench.probes.gguf_builds_ab --rev 305a76c --tokens 512 \
        --json results/gguf_builds_ab.json

A kernel change of a few percent is lost in a whole forward's drift on a shared host (the same
build's 512-token prefill ran 1.88 and 2.08 s minutes apart). Here both builds load in one process
(each as a side build, TL_GGUF_SIDE_BUILD: no torch op registered) and take turns on the same
layers and activations: --rounds rounds, the builds' order flipped each round, each round's figure
the median call over the layers (enough of them that the weights come from memory), and per
build the fastest round. Each shape's outputs are compared too: a change meant to keep the bits
says `same_bits`.

Shapes are the Llama-3.2-1B's prefill matmuls in a Q4_K_M file (gate_up and most downs Q4_K, the
other downs Q6_K), on bf16 activations as the engine gives them.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import numpy as np
import torch

from engine.cpu.extension import CSRC, extension_loader
from engine.cpu.gguf_extension import HEADERS, SOURCES
from engine.cpu.gguf_linear import GgufLinear, gather_blocks_on_huge_pages
from scripts.bench.gguf_kernels import MIN_BYTES, OnBuild, random_blocks, time_calls
from scripts.lib.bench_report import machine_info, run_and_report

logger = logging.getLogger(__name__)

SHAPES = {  # name: (type, out_features, in_features)
    "gate_up": ("Q4_K", 16384, 2048),
    "down_q6_k": ("Q6_K", 2048, 8192),
    "down_q4_k": ("Q4_K", 2048, 8192),
    "qkv": ("Q4_K", 3072, 2048),
    "o_proj": ("Q4_K", 2048, 2048),
}


def sources_at(rev: str, into: Path) -> Path:
    """engine/cpu/csrc as of `rev`, written under `into`; returns that csrc folder."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    archive = subprocess.run(["git", "archive", rev, str(CSRC.relative_to(root))], cwd=root, capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / CSRC.relative_to(root)


def random_layers(type_name: str, out_features: int, in_features: int, rng: np.random.Generator) -> list[GgufLinear]:
    """Layers of random valid blocks, enough of them to pass MIN_BYTES (gguf_kernels.py's: past the L3)."""
    def make() -> GgufLinear:
        return GgufLinear([(type_name, random_blocks(type_name, out_features, in_features, rng))], in_features)

    layers = [make()]
    while len(layers) * layers[0].num_weight_bytes < MIN_BYTES:
        layers.append(make())
    return layers


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", args.rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_csrc = sources_at(args.rev, Path(tmp))
        old_sources = [old_csrc / path.relative_to(CSRC) for path in SOURCES]
        # The checkout's headers that the commit had (a header added since is not its).
        old_headers = [old for old in (old_csrc / path.relative_to(CSRC) for path in HEADERS) if old.exists()]
        # Named by commit, so the cache keeps one build per baseline.
        base = extension_loader(f"tl_gguf_ab_{commit}", old_sources, old_headers, ("-DTL_GGUF_SIDE_BUILD",))()
    head = extension_loader("tl_gguf_ab_checkout", SOURCES, HEADERS, ("-DTL_GGUF_SIDE_BUILD",))()
    rng = np.random.default_rng(0)
    shapes = {}
    for name in args.shapes.split(","):
        type_name, out_features, in_features = SHAPES[name]
        layers = random_layers(type_name, out_features, in_features, rng)
        gather_blocks_on_huge_pages(layers)  # as the engine places them (a one-token call's read depends on it)
        on = {"base": [OnBuild(layer, base) for layer in layers], "checkout": [OnBuild(layer, head) for layer in layers]}
        x = torch.randn(args.tokens, in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
        rounds = {"base": [], "checkout": []}
        for r in range(args.rounds):
            for key in ("base", "checkout") if r % 2 == 0 else ("checkout", "base"):
                rounds[key].append(time_calls(on[key], x, 0.0)[0])  # the median call
        outputs = [on[key][0](x) for key in ("base", "checkout")]
        best = {key: min(times) for key, times in rounds.items()}
        shapes[name] = {"type": type_name, "out_features": out_features, "in_features": in_features,
                        "base_ms": round(best["base"] * 1e3, 3), "checkout_ms": round(best["checkout"] * 1e3, 3),
                        "checkout_over_base": round(best["checkout"] / best["base"], 3),
                        "rounds_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in rounds.items()},
                        "same_bits": bool(torch.equal(*outputs))}
        logger.info("%-10s %s: base %.3f ms, checkout %.3f ms (%.3f), same bits %s", name, type_name,
                    best["base"] * 1e3, best["checkout"] * 1e3, shapes[name]["checkout_over_base"],
                    shapes[name]["same_bits"])
    return {"base_rev": commit, "tokens": args.tokens, "threads": args.threads, "rounds": args.rounds,
            "shapes": shapes, "machine": machine_info()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the baseline commit (its engine/cpu/csrc)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
