"""A kernel module's one-token prefetch switch (engine/cpu/prefetch_tuner.py steers it), tried both
ways on the same inputs: a prefetch moves no data the kernel computes with, so the outputs match."""

from __future__ import annotations

import torch


def outputs_both_ways(kernels, layer, x: torch.Tensor) -> list[torch.Tensor]:
    """layer(x) with kernels' switch on, then off; the switch checked each time and left on."""
    assert kernels.one_token_prefetch()
    outputs = []
    try:
        for on in (True, False):
            kernels.set_one_token_prefetch(on)
            assert kernels.one_token_prefetch() == on
            outputs.append(layer(x))
    finally:
        kernels.set_one_token_prefetch(True)
    return outputs
