/* exp(x) in plain arithmetic the compiler vectorizes (libm's expf is a call per value), shared by strata's C
   libraries: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error under
   3e-7), 2^n built in the exponent bits; x clamped to [-87, 88], where float32 stays normal and finite. n is
   rounded by adding and taking away 1.5 * 2^23 (ties to even): roundf would be a libm call per value, and the
   loops calling this would not vectorize. */
#ifndef STRATA_FAST_EXP_H
#define STRATA_FAST_EXP_H
#include <stdint.h>
#include <string.h>

#include "isa.h"

static inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float shifter = 12582912.f; /* 1.5 * 2^23: adding it leaves no fraction bits */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* fast_exp on 8 or 16 floats at once, the same operations in the same order (GCC contracts the scalar form's
   multiply-adds into these FMAs). Loops of fast_exp stay scalar on AVX2 builds: GCC 12's partial redundancy
   elimination gives each side of the clamp its own path, and the loop no longer vectorizes. */
#if STRATA_AVX2
#define DEFINE_FAST_EXP_VEC(NAME, V, P, I, TOI, SLLI, ADDI, CAST)                                                 \
    static inline V NAME(V x) {                                                                                    \
        x = P##_min_ps(P##_set1_ps(88.f), P##_max_ps(P##_set1_ps(-87.f), x)); /* x second: NaN stays NaN */      \
        const V shifter = P##_set1_ps(12582912.f);                                                                 \
        const V n = P##_sub_ps(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), shifter), shifter);             \
        const V r = P##_fnmadd_ps(n, P##_set1_ps(1.42860682030941723e-6f),                                        \
                                  P##_fnmadd_ps(n, P##_set1_ps(0.693145751953125f), x));                          \
        V p = P##_fmadd_ps(P##_set1_ps(1.f / 720.f), r, P##_set1_ps(1.f / 120.f));                                \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.f / 24.f));                                                          \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.f / 6.f));                                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                                                \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.f));                                                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.f));                                                                 \
        const I bits = SLLI(ADDI(TOI(n), P##_set1_epi32(127)), 23);                                               \
        return P##_mul_ps(p, CAST(bits));                                                                          \
    }
DEFINE_FAST_EXP_VEC(fast_exp8, __m256, _mm256, __m256i, _mm256_cvttps_epi32, _mm256_slli_epi32, _mm256_add_epi32,
                    _mm256_castsi256_ps)
#if STRATA_AVX512F
DEFINE_FAST_EXP_VEC(fast_exp16, __m512, _mm512, __m512i, _mm512_cvttps_epi32, _mm512_slli_epi32, _mm512_add_epi32,
                    _mm512_castsi512_ps)
#endif
#undef DEFINE_FAST_EXP_VEC
#endif

/* x[i] = fast_exp(x[i]) for i < n, 16 or 8 at a time where the build has the vector forms. */
static inline void fast_exp_in_place(float *x, int64_t n) {
    int64_t i = 0;
#if STRATA_AVX512F
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, fast_exp16(_mm512_loadu_ps(x + i)));
#endif
#if STRATA_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, fast_exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = fast_exp(x[i]);
}

#endif
