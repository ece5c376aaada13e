/* The instruction sets a build of strata's kernels uses, one macro each (0 or 1), with one meaning in every file.
   They follow the compiler's target (-march=native, or STRATA_KERNEL_MARCH's x86-64 level) and three switches a
   build may define: STRATA_PORTABLE (plain C everywhere), STRATA_NO_AVX512 (AVX2/FMA at most), STRATA_NO_AMX.
   Each level implies the ones above it, so a file tests the one level it needs. */
#ifndef STRATA_ISA_H
#define STRATA_ISA_H

/* AVX2 with FMA: 256-bit vectors, the SIMD baseline of every vectorized path. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(STRATA_PORTABLE)
#define STRATA_AVX2 1
#else
#define STRATA_AVX2 0
#endif

/* Hardware half <-> float conversion beside AVX2. */
#if STRATA_AVX2 && defined(__F16C__)
#define STRATA_F16C 1
#else
#define STRATA_F16C 0
#endif

/* AVX-512 Foundation: 512-bit float vectors (FMA, permutes, masked loads of 32-bit lanes). */
#if STRATA_AVX2 && defined(__AVX512F__) && !defined(STRATA_NO_AVX512)
#define STRATA_AVX512F 1
#else
#define STRATA_AVX512F 0
#endif

/* AVX-512 byte and word instructions (the integer widening of packed weights needs them). */
#if STRATA_AVX512F && defined(__AVX512BW__)
#define STRATA_AVX512BW 1
#else
#define STRATA_AVX512BW 0
#endif

/* AVX-512 VNNI: vpdpbusd, the fixed-point dot products. */
#if STRATA_AVX512BW && defined(__AVX512VNNI__)
#define STRATA_AVX512VNNI 1
#else
#define STRATA_AVX512VNNI 0
#endif

/* AVX-VNNI: the 256-bit vpdpbusd (VEX), beside AVX2 on CPUs with or without AVX-512 (a branch of its own, not a level
   below or above AVX-512). */
#if STRATA_AVX2 && defined(__AVXVNNI__)
#define STRATA_AVXVNNI 1
#else
#define STRATA_AVXVNNI 0
#endif

/* AMX tiles with bfloat16 products (and AVX512-BF16 to make their operands), on Linux, which grants the tile state
   on request (arch_prctl). */
#if STRATA_AVX512F && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__) && !defined(STRATA_NO_AMX)
#define STRATA_AMX 1
#else
#define STRATA_AMX 0
#endif

/* AMX's int8 tile products (tdpbusd) beside the tiles above. */
#if STRATA_AMX && defined(__AMX_INT8__)
#define STRATA_AMX_INT8 1
#else
#define STRATA_AMX_INT8 0
#endif

/* An x86 CPU (its pause instruction in spin loops), whatever the vector extensions. */
#if defined(__x86_64__) || defined(__i386__)
#define STRATA_X86 1
#else
#define STRATA_X86 0
#endif

#if STRATA_AVX2
#include <immintrin.h>
#endif

#endif
