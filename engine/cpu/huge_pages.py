"""KV-cache tensors (and the CPU's weight slabs and int8 or int4 panels, engine.cpu.packing
and engine.cpu.int8_linear) on
transparent huge pages, where Linux offers them on request.

Decode attention reads each sequence's blocks wherever they lie in the pool: a few
KB here, a few KB there, each on a different 4 KB page, so nearly every block costs
a TLB miss (and under a hypervisor, a two-level page walk). Huge pages
make those reads faster (docs/performance.md, "Huge pages"). Many
kernels ship with transparent huge pages in `madvise` mode, which gives them only
to memory that asks: this module asks for the KV pool's, before its first touch.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def huge_pages_on_request() -> bool:
    """True where the kernel gives huge pages to memory that asks (`always` needs no asking)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[madvise]" in THP_SETTING.read_text()
    except OSError:
        return False


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, its 2 MB-aligned interior advised onto huge pages
    before anything touches it (so each page is faulted in huge as it is first written). Plain
    pages if the advice fails."""
    tensor = torch.empty(shape, dtype=dtype)
    if huge_pages_on_request():
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        aligned_start = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        aligned_end = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if aligned_end > aligned_start and _libc_madvise()(aligned_start, aligned_end - aligned_start, MADV_HUGEPAGE):
            logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return tensor


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, on huge pages where Linux gives them (empty_on_huge_pages)."""
    return empty_on_huge_pages(shape, dtype).zero_()


def move_onto_huge_pages(owners: list, get, put) -> int:
    """Move the tensor get(owner) of every owner (all of one dtype) into one tensor on huge pages,
    put(owner, copy) placing each copy as soon as it is made, so the old one is freed at once
    (peak memory: the pool and one old tensor). Returns the bytes moved; 0 where Linux gives no
    huge pages on request. A step streams every weight once, a page after another: on 4 KB pages
    each one missed the TLB and the prefetcher stopped at its end."""
    if not owners or not huge_pages_on_request():
        return 0
    num_elements = [get(owner).numel() for owner in owners]
    # Not zeroed: every element is a copy's, and a page is touched only as its copy is written,
    # so the peak is the old tensors plus what has been copied so far, one tensor past the model.
    pool = empty_on_huge_pages((sum(num_elements),), get(owners[0]).dtype)
    offset = 0
    for owner, n in zip(owners, num_elements):
        old = get(owner)
        put(owner, pool[offset : offset + n].view(old.shape).copy_(old))
        offset += n
    return pool.numel() * pool.element_size()
