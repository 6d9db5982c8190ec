"""Builds and loads the quantized matmul kernels (engine/cpu/csrc/quantized/: int8_linear.cpp, W8A8,
and int4_linear.cpp, W4A8 in Q4_1's format).

A module of its own, beside engine/cpu/extension.py's (same compiler flags, same
per-CPU cache folders): it is only needed with `--quantization int8` or `int4`, and editing it
rebuilds it alone (seconds) rather than every kernel (minutes)."""

from __future__ import annotations


from engine.cpu.extension import CSRC, extension_loader

SOURCES = [CSRC / "quantized" / name
           for name in ("int8_linear.cpp", "int4_linear.cpp", "embedding_rows.cpp")]
HEADERS = [CSRC / "share_out.h",  # shared with the bf16 slabs
           CSRC / "work_pool.h",  # ... and the decode steps' work pool
           CSRC / "quantized" / "vnni_io.h"]

load_quantized_kernels = extension_loader("tokenloom_quantized_kernels", SOURCES, HEADERS)  # the compiled module, built on first use


def main() -> None:
    """Build ahead of time (`make kernels` runs this) where the CPU can run it, so neither an
    int8 or int4 engine's start nor a test pays the compile."""
    import logging

    from engine.cpu.host import detect_cpu_features

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not detect_cpu_features().has_avx512_vnni:
        print("int8/int4 kernels: not built (this CPU has no AVX512_VNNI)")
        return
    try:
        print(load_quantized_kernels().__file__)
    except Exception as exc:  # set-up goes on: only --quantization int8|int4 needs it, and it says why
        logging.getLogger(__name__).warning("int8/int4 kernels could not be built (%s)", exc)


if __name__ == "__main__":
    main()
