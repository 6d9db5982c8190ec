"""What one decode step reads of a GGUF's weights, and the host's stream rate to hold it to (issue #59).

Issue #59's bar for one user's decode is the weight bytes read a second against "the
machine's stream rate: two threads reading 2 GB", measured by the benchmark itself. One
user's step reads every weight once, so the rate is decode tok/s x `decode_weight_bytes`.
On this project's shared VMs the stream rate moves within a minute, so
scripts/bench/single_user.py takes it before each round (`StreamProbe`) and holds that
round's runs to it, for ours and llama-server alike.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

TOKEN_EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"


def decode_weight_bytes(path: str | Path) -> int | None:
    """The bytes of a GGUF's tensors that a one-token step reads: every tensor but the token
    embedding, of which a step reads one row, unless the file ties it to the LM head (no
    output.weight), when the head reads it whole. None for anything but a .gguf file."""
    path = Path(path)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from gguf import GGUFReader

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}
    is_tied = OUTPUT not in tensors
    return sum(n for name, n in tensors.items() if name != TOKEN_EMBEDDING or is_tied)


class StreamProbe:
    """`threads` threads reading a `num_bytes` buffer (the GGUF kernels' stream_read, on torch's
    threads and the matmuls' own hand-out): the best whole pass of a few, in GB/s. The buffer is
    allocated and touched once, so each measure reads memory the process already holds."""

    def __init__(self, num_bytes: int = 2 << 30, threads: int = 2) -> None:
        from engine.cpu.gguf_extension import load_gguf_kernels

        self._kernels = load_gguf_kernels()
        self.threads = threads
        self.buffer = torch.ones(num_bytes, dtype=torch.uint8)  # ones: every page touched now

    def measure(self, trials: int = 3) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            best = float("inf")
            for _ in range(trials):
                start = time.perf_counter()
                self._kernels.stream_read(self.buffer)
                best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)
        return self.buffer.numel() / best / 1e9


def weight_rates(decode_tok_s: float, weight_bytes: int, stream_gb_s: float) -> dict:
    """One run's weight read rate (GB/s) and its share of the round's stream rate."""
    weight_gb_s = decode_tok_s * weight_bytes / 1e9
    return {"weight_gb_s": weight_gb_s, "share_of_stream": weight_gb_s / stream_gb_s}
