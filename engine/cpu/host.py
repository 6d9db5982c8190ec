"""The host: where tokenloom caches what it builds, and what the CPU is.

A leaf (imports nothing of ours): the one reader of /proc/cpuinfo, for the dtype policy's
features, the kernels' build key and the simulator's calibration name.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CpuFeatures:
    has_amx_bf16: bool = False  # AMX tiles with bf16 dot products (Sapphire Rapids and later)
    has_avx512_bf16: bool = False  # AVX512_BF16's vdpbf16ps (Cooper Lake, Zen 4 and later)
    has_avx512_vnni: bool = False  # vpdpbusd, the int8 kernel's dot product (Cascade Lake, Zen 4 and later)


@functools.cache
def detect_cpu_features() -> CpuFeatures:
    """The host CPU's bf16 support, from torch's cpuinfo probe, else /proc/cpuinfo's flags."""
    try:
        import torch

        capabilities = torch.cpu.get_capabilities()
        return CpuFeatures(
            has_amx_bf16=bool(capabilities.get("amx_bf16")), has_avx512_bf16=bool(capabilities.get("avx512_bf16")),
            has_avx512_vnni=bool(capabilities.get("avx512_vnni")),
        )
    except (AttributeError, RuntimeError):  # an older torch without the probe
        pass
    flags = cpu_flags()
    return CpuFeatures(has_amx_bf16="amx_bf16" in flags, has_avx512_bf16="avx512_bf16" in flags,
                       has_avx512_vnni="avx512_vnni" in flags)
