"""scripts/bench/probes/gguf_prefetch_switch: calls alternate the switch pair by pair on the real
kernels, the switch ends on, and the summary's ratios are the pairs' own."""

from __future__ import annotations

import numpy as np
import torch

from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import GgufLinear
from scripts.bench.probes.gguf_prefetch_switch import (PANEL_SHAPES, SHAPES, SLAB_SHAPES, parse_args, summary,
                                                       time_pairs)
from tests.kernels.test_gguf_linear import make_blocks


def test_pairs_alternate_the_switch_and_leave_it_on():
    kernels = load_gguf_kernels()
    layers = [GgufLinear([("Q4_K", make_blocks("Q4_K", 64, 512, seed=i))], 512) for i in range(3)]
    seen = []

    def set_prefetch(on: bool) -> None:
        seen.append(on)
        kernels.set_one_token_prefetch(on)

    on, off = time_pairs(layers, torch.randn(1, 512).bfloat16(), set_prefetch, 0.05)
    assert len(on) == len(off) >= 10 and (on > 0).all() and (off > 0).all()
    pairs = [tuple(seen[k:k + 2]) for k in range(0, 2 * len(on), 2)]
    assert pairs[:4] == [(True, False), (False, True), (True, False), (False, True)]
    assert seen[-1] is True and kernels.one_token_prefetch()


def test_the_summary_gives_the_pairs_median_ratio():
    on = np.array([1.0, 2.0, 4.0, 1.0, 1.0])
    off = np.array([0.5, 2.0, 2.0, 0.9, 1.1])
    report = summary(on, off, 10**9)
    assert report["pairs"] == 5 and report["off_over_on"] == 0.9  # ratios 0.5, 1, 0.5, 0.9, 1.1
    assert report["off_over_on_fast"] == 0.9  # the pairs whose "on" was among the fastest 30%: 0.5, 0.9, 1.1
    assert report["on_gb_s"] == 1.0


def test_defaults_are_the_1b_decodes_shapes_or_smollm2s_for_the_slabs():
    args = parse_args([])
    assert args.kernels == "gguf" and args.shapes.split(",") == list(SHAPES) and args.threads == 2
    args = parse_args(["--kernels", "slabs"])
    assert args.shapes.split(",") == list(SLAB_SHAPES) and SLAB_SHAPES["gate_up"] == (3072, 576)
    for kind in ("int8", "int4"):  # the --quantization panels, on the 1B's shapes
        args = parse_args(["--kernels", kind])
        assert args.shapes.split(",") == list(PANEL_SHAPES) and PANEL_SHAPES["down"] == (2048, 8192)
