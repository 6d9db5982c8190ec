// Selects ATen's vector width for this build before <ATen/cpu/vec/vec.h> is included.
//
// ATen's own kernels are built once per instruction set and dispatched at run time;
// ours are built on the host with -march=native (engine/cpu/extension.py keys
// the build by CPU), so the compiler's own target macros say which width is safe.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif
