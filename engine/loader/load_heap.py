"""glibc's heap while a model loads: each freed weight buffer goes back to the system at once.

glibc serves an allocation from its heap unless it is at least M_MMAP_THRESHOLD bytes, and each
time it frees a block it had mapped for itself it raises that threshold to the block's size, up
to 32 MB. A load frees a buffer per tensor (a GGUF tensor's read buffer once its rows are
repacked, every GgufLinear's blocks once gathered onto huge pages), most of them under 32 MB, so
after the first large free they came from the heap and, freed, stayed in its free lists, counted
in RSS beside their copies: an 8B Q4_K_M file's peak went past the issue's bound on it
(`scripts.bench.gguf_load --shape llama-3.1-8b`; the figures in docs/models.md). So the
threshold is fixed at 1 MB while loading; after, it is fixed at 32 MB,
where glibc's own would have settled, so that steps' temporaries keep coming from the heap, and
the heap is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # malloc.h
LOAD_THRESHOLD_BYTES = 1 << 20
STEADY_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts

_libc = None


def _glibc():
    """libc with mallopt and malloc_trim (glibc), or None (another C library, another OS)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        _libc = lib if lib is not None and hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
    return _libc or None


@contextmanager
def frees_returned_while_loading() -> Iterator[None]:
    """Inside: allocations of 1 MB or more are mapped apart, so freeing one returns its pages."""
    libc = _glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD_BYTES):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, STEADY_THRESHOLD_BYTES)
        libc.malloc_trim(0)
