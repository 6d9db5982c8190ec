"""engine/loader/load_heap.py: inside frees_returned_while_loading, a buffer freed beside the copy
that replaced it (a load's pattern: read, repack, free the read) returns its pages; outside, glibc's
raised threshold keeps such buffers in the heap, counted in RSS."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from engine.loader.load_heap import _glibc

CHURN = """
import json, sys, torch
from contextlib import nullcontext
from engine.loader.load_heap import frees_returned_while_loading

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

big = torch.ones(4 << 20)  # 16 MB, mapped apart by glibc; its free raises the threshold to 16 MB
del big
kept = []
before = rss()
with (frees_returned_while_loading() if sys.argv[1] == "on" else nullcontext()):
    for i in range(48):
        # 4 MB and more, each read a little larger than the last, as a file's tensors differ: no
        # freed read fits the next one, so outside the context each stays a hole in the heap
        read = torch.full(((1 << 20) + i * (16 << 10),), i, dtype=torch.float32)
        kept.append(read + 1)  # its copy, kept as a model keeps its repacked weight
        del read
print(json.dumps({"growth": rss() - before, "sum": sum(int(t[0]) for t in kept)}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or _glibc() is None, reason="glibc's malloc only")
def test_freed_read_buffers_leave_rss_while_loading():
    growth = {}
    for arm in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", CHURN, arm], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["sum"] == sum(range(1, 49))
        growth[arm] = result["growth"]
    kept_bytes = sum(4 * ((1 << 20) + i * (16 << 10)) for i in range(48))
    assert growth["off"] > 1.7 * kept_bytes, growth  # the freed reads stayed: about twice the copies
    assert growth["on"] < 1.2 * kept_bytes, growth  # the copies and little else
