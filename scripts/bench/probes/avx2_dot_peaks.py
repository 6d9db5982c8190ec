"""Register-only rates of AVX2's int8 dot product (vpmaddubsw), the ceiling of the GGUF kernels' prefill, JSON out.

Without VNNI the GGUF block kernels (engine/cpu/csrc/gguf/) multiply with vpmaddubsw: 32 int8
multiply-adds an instruction into int16, added up by a vpaddw. A prompt's matmuls are bound by
how many of those pairs the cores retire, so their GOPS (scripts/bench/gguf_prefill_profile.py)
are read against this probe's, measured the same sitting (docs/cpu-kernels.md). Loops, each on
every thread at once (OpenMP, --threads), no memory traffic past L1:

- `maddubs_add`: vpmaddubsw + vpaddw into 8 independent int16 sums (the multiply pipe's rate);
- `broadcast_maddubs_add`: the same, each vpmaddubsw's activations a 4-byte broadcast from
  one pointer plus a constant, as the 8-row groups' inner loop (gguf_dot_x8.h) takes them.

Compiled with gcc on each run (-mavx2), nothing kept:

    python -m scripts.bench.probes.avx2_dot_peaks --threads 2 --json results/avx2_dot_peaks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from scripts.lib.bench_report import write_report

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
static int32_t X[4096] __attribute__((aligned(64)));
#define N 50000000L
// One thread's loop: 8 int16 sums in registers, each a vpaddw of a vpmaddubsw a step.
#define STEP(A, W, XV) A = _mm256_add_epi16(A, _mm256_maddubs_epi16(W, XV)); __asm__("" : "+x"(A));
static int loop(int broadcast) {
  // eight different weight registers, hidden from gcc: no two steps of a pass are the same
  // product, which it would otherwise compute once
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), w2 = _mm256_set1_epi8(7), w3 = _mm256_set1_epi8(9);
  __m256i w4 = _mm256_set1_epi8(11), w5 = _mm256_set1_epi8(13), w6 = _mm256_set1_epi8(2), w7 = _mm256_set1_epi8(4);
  __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
  __asm__("" : "+x"(w4), "+x"(w5), "+x"(w6), "+x"(w7));
  __m256i x = _mm256_set1_epi8(1);
  __m256i a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x;
  if (broadcast) {
    for (long k = 0; k < N; ++k) {
      const int32_t* p = X + (k & 31) * 8;
      __asm__("" : "+r"(p));
      STEP(a0, w0, _mm256_set1_epi32(p[0])) STEP(a1, w1, _mm256_set1_epi32(p[1]))
      STEP(a2, w2, _mm256_set1_epi32(p[2])) STEP(a3, w3, _mm256_set1_epi32(p[3]))
      STEP(a4, w4, _mm256_set1_epi32(p[4])) STEP(a5, w5, _mm256_set1_epi32(p[5]))
      STEP(a6, w6, _mm256_set1_epi32(p[6])) STEP(a7, w7, _mm256_set1_epi32(p[7]))
    }
  } else {
    for (long k = 0; k < N; ++k) {
      STEP(a0, w0, x) STEP(a1, w1, x) STEP(a2, w2, x) STEP(a3, w3, x)
      STEP(a4, w4, x) STEP(a5, w5, x) STEP(a6, w6, x) STEP(a7, w7, x)
      __asm__("" : "+x"(x));  // a new x each pass, so no product is hoisted out of the loop
    }
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                     _mm256_add_epi16(_mm256_add_epi16(a4, a5), _mm256_add_epi16(a6, a7)));
  return _mm256_extract_epi16(s, 0);
}
// Billions of vpmaddubsw a second on all threads, the loops started together.
static double rate(int broadcast) {
  double start = 0, end = 0;
  int sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp master
    start = omp_get_wtime();
    sink += loop(broadcast);
#pragma omp barrier
#pragma omp master
    end = omp_get_wtime();
  }
  __asm__ volatile("" :: "r"(sink));
  return 8.0 * N * omp_get_max_threads() / (end - start) / 1e9;
}
int main(void) {
  for (int i = 0; i < 4096; ++i) X[i] = i * 40503;
  printf("{\"maddubs_add\": %.3f, \"broadcast_maddubs_add\": %.3f}\n", rate(0), rate(1));
  return 0;
}
"""


def measure(threads: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peaks.c", Path(folder) / "peaks"
        source.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx2", "-fopenmp", str(source), "-o", str(binary)], check=True)
        done = subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "true"})
        return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs; each figure is the best")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    runs = [measure(args.threads) for _ in range(args.repeats)]
    best = {name: max(run[name] for run in runs) for name in runs[0]}  # billions of vpmaddubsw a second
    report = {"unit": "billion 256-bit vpmaddubsw a second, all threads", "threads": args.threads, "best": best,
              "runs": runs,
              # 32 multiply-adds an instruction, 2 operations each: the GOPS gguf_prefill_profile reports
              "gops": {name: round(64 * rate, 1) for name, rate in best.items()}}
    print(json.dumps(report, indent=2))
    write_report(args.json, report, indent=2)
    return report


if __name__ == "__main__":
    main()
