"""The host: where tokenloom caches what it builds, and what the CPU is.

A leaf (imports nothing of ours): the one reader of /proc/cpuinfo, for the dtype policy's
features, the kernels' build key and the simulator's calibration name.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cache_dir() -> Path:
    """Converted models, built kernels, inductor's cache and calibrations (TOKENLOOM_CACHE overrides)."""
    return Path(os.environ.get("TOKENLOOM_CACHE") or Path.home() / ".cache" / "tokenloom")


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(CPUINFO.read_text().splitlines())
    except OSError:  # not Linux
        return ()


def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags (empty where there is none, or it lists none: not x86)."""
    flags = set()
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return frozenset(flags)


def cpu_name() -> str:
    """The CPU's model name, else what the platform says."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_key() -> str:
    """A short key for what this CPU compiles to (-march=native): its architecture, name and flags."""
    import hashlib

    description = "\n".join(sorted({line for line in _cpuinfo_lines() if line.startswith(("model name", "flags"))}))
    if not description:
        description = platform.processor()
    return platform.machine() + "-" + hashlib.sha256(description.encode()).hexdigest()[:12]
