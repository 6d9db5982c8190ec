"""Builds and loads the C++ CPU kernels (sources in engine/cpu/csrc/*.cpp) once per machine.

torch.utils.cpp_extension compiles them with the host compiler the first time
(a minute or two) into <cache>/torch_extensions/<cpu key>-<source key>, and later
processes only load the shared library. The code is compiled for the host's own
instruction set (-march=native), so the folder is keyed by the CPU's model and
flags: a cache shared with another kind of machine never hands it an incompatible
binary. It is keyed by the sources, headers and flags too, so two checkouts with
different kernels (a branch, a worktree) each keep their build instead of
rebuilding over each other's. The sources are compiled from a copy inside the
folder: ninja rebuilds everything when the same files come from another path, so
checkouts with the same kernels share one build; the torch the venv holds is in the
key, since its header paths are in ninja's command lines too.

The flags here are the ones every kernel needs; a kernel that needs more or less
says so at its top with a pragma (fused_ops.cpp and apply_penalties.cpp turn FMA
contraction off to give the torch code's exact bits). No file is built with
-ffast-math: the kernels vectorize exp with ATen's own and reduce with explicit
vectors or `omp simd` reductions, so nothing waits on the compiler to reassociate.

No source includes <torch/extension.h>: it pulls in the whole C++ frontend (autograd, nn,
optim), three times the parse of what the kernels use, in every translation unit. Kernels
include <torch/types.h> (the tensor type and its factories), and the files that bind to
Python add <torch/csrc/utils/pybind.h> (pybind11 with the tensor casters).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
import logging
from pathlib import Path
from types import ModuleType

from engine.cpu.host import cache_dir, cpu_key
from engine.cpu.build_lock import exclusive_build

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"  # the sources; built from here
SOURCES = [
    CSRC / name
    for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "paged_shared_decode_attention.cpp",
                 "fused_ops.cpp", "small_batch_linear.cpp", "sample_rows.cpp", "apply_penalties.cpp", "apply_token_bitmask.cpp",
                 "decode_stack.cpp", "bindings.cpp")
]
HEADERS = [CSRC / name for name in ("vec_capability.h", "vec_reduce.h", "attention_tiles.h", "decode_attention_passes.h",
                                    "decode_attention_bf16.h",
                                    "decode_attention_x8.h",
                                    "prefill_bf16_tiles.h", "share_out.h", "work_pool.h", "lora_rows.h")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_module: ModuleType | None = None


def _sources_key(paths: list[Path], extra_cflags: tuple[str, ...] = ()) -> str:
    """torch rebuilds when a source or a flag changes, but does not read headers: the
    folder's name hashes all of them."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(CFLAGS + list(extra_cflags)).encode())
    # ninja's command lines name torch's headers: two venvs sharing the cache would rebuild over each other.
    # Unresolved, as torch writes them: venvs that are links to one (a worktree each) are told apart too.
    import torch

    digest.update(str(Path(torch.__file__).parent).encode() + torch.__version__.encode())
    return digest.hexdigest()[:12]


def copy_sources(paths: list[Path], folder: Path) -> list[Path]:
    """The files copied into `folder` (rewritten only where they differ, so ninja's
    timestamps stay put); headers beside the sources keep their #include "x.h" working."""
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for path in paths:
        copy = folder / path.name
        data = path.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.write_bytes(data)
        copies.append(copy)
    return copies


def load_extension(name: str, sources: list[Path], headers: list[Path],
                   extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Build (once per CPU, sources, flags and torch) and load the extension `name`, under
    the folder's build lock; raises if this machine cannot build it (no compiler, say).
    Each extension has its own folder, so editing one's sources rebuilds it alone;
    `extra_cflags` (a -D, say) build the same sources as another extension."""
    from torch.utils.cpp_extension import load

    # Resolved: ninja's command lines name the sources by path, so a cache reached through a link
    # (the tests' throwaway caches link this folder) would otherwise rebuild everything, twice.
    key = _sources_key(sources + headers, extra_cflags)
    build_dir = (cache_dir() / "torch_extensions").resolve() / f"{cpu_key()}-{key}"
    logger.info("loading %s (built on first use) from %s", name, build_dir)
    with exclusive_build(build_dir):
        copies = copy_sources(sources + headers, build_dir / "src")[:len(sources)]
        return load(name=name, sources=[str(s) for s in copies], extra_cflags=CFLAGS + list(extra_cflags),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir))


def extension_loader(name: str, sources: list[Path], headers: list[Path],
                     extra_cflags: tuple[str, ...] = ()) -> Callable[[], ModuleType]:
    """A function that builds and loads the extension `name` on its first call (load_extension)
    and returns the same module after; it raises if this machine cannot build it."""
    module: ModuleType | None = None

    def load() -> ModuleType:
        nonlocal module
        if module is None:
            module = load_extension(name, sources, headers, extra_cflags)
        return module

    return load


def load_cpu_kernels() -> ModuleType:
    """The compiled module; raises if this machine cannot build it (no compiler, say)."""
    global _module
    if _module is None:
        _module = load_extension("tokenloom_cpu_kernels", SOURCES, HEADERS)
    return _module


def load_cpu_kernels_or_none(fallback: str) -> ModuleType | None:
    """The compiled module, or None where it cannot be built (no compiler, say), logging
    `fallback`: what runs instead."""
    try:
        return load_cpu_kernels()
    except Exception as exc:
        logger.warning("%s: no CPU kernels (%s)", fallback, exc)
        return None


def main() -> None:
    """Build ahead of time (`make` runs this), so no engine start pays the compile."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = load_cpu_kernels()
    except Exception as exc:  # the engine falls back to the torch backend, so set-up goes on
        logger.warning("CPU kernels could not be built (%s); engines will use the torch attention backend", exc)
        return
    print(module.__file__)


if __name__ == "__main__":
    main()
