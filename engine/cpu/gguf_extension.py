"""Builds and loads the GGUF block kernels (engine/cpu/csrc/gguf/: Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K as a file stores them, on AVX2, the grouped rows' inner products on AVX512-VNNI
where the CPU has it).

A module of its own, beside engine/cpu/extension.py's and quantized_extension.py's (same
compiler flags, same per-CPU cache folders): only a GGUF's layers need it, and editing it
rebuilds it alone.
"""

from __future__ import annotations


from engine.cpu.extension import CSRC, extension_loader

SOURCES = [CSRC / "gguf" / name for name in ("gguf_linear.cpp", "gguf_rows.cpp", "gguf_repack.cpp")]
HEADERS = [CSRC / "share_out.h",  # shared with the bf16 slabs and the int8/int4 panels
           CSRC / "work_pool.h",  # ... and the decode steps' work pool
           CSRC / "gguf" / "gguf_dot.h", CSRC / "gguf" / "gguf_dot_x8.h",
           CSRC / "gguf" / "gguf_dot_q6_k_x8.h", CSRC / "gguf" / "gguf_dot_q4_1_x8.h",
           CSRC / "gguf" / "gguf_types.h", CSRC / "gguf" / "gguf_activations.h", CSRC / "gguf" / "gguf_dot_x16.h"]

load_gguf_kernels = extension_loader("tokenloom_gguf_kernels", SOURCES, HEADERS)  # the compiled module, built on first use
# The same kernels with AVX2's inner products on a CPU with AVX512-VNNI (gguf_dot.h's
# TL_GGUF_AVX2_ONLY): the tests hold the two paths to the same bits, the benchmarks compare
# them. It registers no torch op; call its gguf_linear.
load_gguf_kernels_avx2 = extension_loader("tokenloom_gguf_kernels_avx2", SOURCES, HEADERS,
                                          ("-DTL_GGUF_AVX2_ONLY", "-DTL_GGUF_SIDE_BUILD"))


def main() -> None:
    """Build ahead of time (`make kernels` runs this), so neither a GGUF engine's start nor a
    test pays the compile."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = load_gguf_kernels()
    except Exception as exc:  # set-up goes on: GGUF layers then dequantize instead, and say why
        logging.getLogger(__name__).warning("gguf kernels could not be built (%s)", exc)
        return
    print(f"{module.__file__} ({module.dot_isa()})" if module.has_gguf_kernels()
          else "gguf kernels: built, but this CPU lacks AVX2/FMA/F16C")


if __name__ == "__main__":
    main()
