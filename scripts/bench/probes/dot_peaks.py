"""Register-only rates of the CPU's dot-product instructions and of the int8 kernel's inner loop, JSON out.

What bounds int8 against bf16 on a CPU without AMX (docs/performance.md, "Why int8 cannot
reach 1.5x our bf16"): one core, no memory traffic, billions of 512-bit instructions a
second for
- `vpdpbusd` (AVX512_VNNI: 64 int8 multiply-adds) and `vdpbf16ps` (AVX512_BF16: 32 bf16 ones),
  12 independent accumulators each;
- int8_linear.cpp's inner loop (6 tokens x 32 rows, a group's 16 quads, weights in L1):
  sums running on across groups ("no_epilogue"), closed each group by a bare add ("add"), and
  by the kernel's epilogue ((sum - correction) x weight scale x token scale into fp32: "scales").

Compiled with gcc on each run (AVX-512 flags: the CPU must have AVX512_VNNI and AVX512_BF16), nothing kept:

    python -m scripts.bench.probes.dot_peaks --json results/dot_peaks.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from scripts.lib.bench_report import write_report

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static uint32_t W[2 * 16 * 32] __attribute__((aligned(64)));
static uint32_t X[2 * 16 * 16];
static float WS[64], XS[64];
static int32_t C[64];
#define N 200000000L
#define GROUPS 20000000L
static double peak_dpbusd(void) {
  __m512i a[12], w = _mm512_set1_epi32(0x01010101), x = _mm512_set1_epi32(0x02020202);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  double t = now();
  for (long n = 0; n < N / 12; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
    __asm__ volatile("" : "+v"(w));
  }
  t = now() - t;
  int s = 0; for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(a[i]);
  __asm__ volatile("" :: "r"(s));
  return N / t / 1e9;
}
static double peak_dpbf16(void) {
  __m512 b[12];
  __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80), x = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (int i = 0; i < 12; ++i) b[i] = _mm512_set1_ps(i);
  double t = now();
  for (long n = 0; n < N / 12; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) b[i] = _mm512_dpbf16_ps(b[i], w, x);
    __asm__ volatile("" : "+v"(w));
  }
  t = now() - t;
  float f = 0; for (int i = 0; i < 12; ++i) f += _mm512_reduce_add_ps(b[i]);
  __asm__ volatile("" :: "x"(f));
  return N / t / 1e9;
}
// epilogue: 0 sums run on, 1 a bare add each group, 2 the kernel's scales each group
static double inner_loop(int epilogue) {
  __m512 acc[6][2];
  __m512i s[6][2];
  for (int r = 0; r < 6; ++r) { acc[r][0] = acc[r][1] = _mm512_setzero_ps(); s[r][0] = s[r][1] = _mm512_setzero_si512(); }
  double t = now();
  for (long g = 0; g < GROUPS; ++g) {
    const uint32_t* w = W + (g & 1) * 512;
    if (epilogue) {
#pragma GCC unroll 6
      for (int r = 0; r < 6; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
    }
#pragma GCC unroll 16
    for (int q = 0; q < 16; ++q) {
      __m512i w0 = _mm512_load_si512(w + q * 32), w1 = _mm512_load_si512(w + q * 32 + 16);
#pragma GCC unroll 6
      for (int r = 0; r < 6; ++r) {
        __m512i xr = _mm512_set1_epi32(X[r * 16 + q + (g & 1) * 256]);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xr);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xr);
      }
    }
    if (epilogue == 1) {
#pragma GCC unroll 6
      for (int r = 0; r < 6; ++r) {
        acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_castsi512_ps(s[r][0]));
        acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_castsi512_ps(s[r][1]));
      }
    } else if (epilogue == 2) {
      const __m512 ws0 = _mm512_loadu_ps(WS + (g & 7) * 2), ws1 = _mm512_loadu_ps(WS + 16 + (g & 7) * 2);
#pragma GCC unroll 6
      for (int r = 0; r < 6; ++r) {
        const __m512 xs = _mm512_set1_ps(XS[r + (g & 7)]);
        const __m512i c = _mm512_set1_epi32(C[r + (g & 7)]);
        acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][0], c)), _mm512_mul_ps(ws0, xs), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][1], c)), _mm512_mul_ps(ws1, xs), acc[r][1]);
      }
    }
    __asm__ volatile("" ::: "memory");
  }
  t = now() - t;
  float f = 0;
  for (int r = 0; r < 6; ++r) f += _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + _mm512_reduce_add_epi32(s[r][0]);
  __asm__ volatile("" :: "x"(f));
  return GROUPS * 192.0 / t / 1e9;
}
int main(void) {
  for (int i = 0; i < 1024; ++i) W[i] = i * 2654435761u;
  for (int i = 0; i < 512; ++i) X[i] = i * 40503u;
  for (int i = 0; i < 64; ++i) { WS[i] = 1.f / (i + 1); XS[i] = 0.5f; C[i] = i; }
  printf("{\"vpdpbusd\": %.3f, \"vdpbf16ps\": %.3f, \"int8_loop_no_epilogue\": %.3f, "
         "\"int8_loop_add\": %.3f, \"int8_loop_scales\": %.3f}\n",
         peak_dpbusd(), peak_dpbf16(), inner_loop(0), inner_loop(1), inner_loop(2));
  return 0;
}
"""


def measure() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peaks.c", Path(folder) / "peaks"
        source.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16",
                        str(source), "-o", str(binary)], check=True)
        return json.loads(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="runs; each figure is the best")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    runs = [measure() for _ in range(args.repeats)]
    best = {name: max(run[name] for run in runs) for name in runs[0]}  # billions of instructions a second, one core
    report = {"unit": "billion 512-bit instructions a second, one core", "best": best, "runs": runs,
              "int8_ops_vs_bf16_flops": 2 * best["vpdpbusd"] / best["vdpbf16ps"],
              "int8_loop_scales_share_of_peak": best["int8_loop_scales"] / best["vpdpbusd"]}
    print(json.dumps(report, indent=2))
    write_report(args.json, report, indent=2)


if __name__ == "__main__":
    main()
