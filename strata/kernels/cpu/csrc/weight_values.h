/* The weight kinds strata's CPU kernels read (strata/layers/quantization/weight_only.py has the packed layout) and
   how their values come out of memory, shared by the small-batch kernels (weight_only.c) and the GEMM
   (weight_gemm.c). */
#ifndef STRATA_WEIGHT_VALUES_H
#define STRATA_WEIGHT_VALUES_H
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "isa.h"

#define BLOCK 32 /* values of K in one block of the packed layout */

/* KIND_GGUF + ggml's type number: GGUF weights in their blocks (gguf_blocks.h); GGUF's F16 is a dense kind here. */
enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT4 = 4, KIND_INT8 = 8, KIND_FP8 = 9, KIND_GGUF = 32, KIND_F16 = 33 };

/* Kinds with a scale per group (FP8: per output channel, no zero point). */
static inline int scaled(int kind) { return kind == KIND_INT4 || kind == KIND_INT8 || kind == KIND_FP8; }

/* float8 e4m3 (bias 7, no infinities; the loader refuses its NaN codes) as float32: its 7 bits under float32's
   exponent and mantissa, times 2^120 to move the bias from 127 to 7 (exact for subnormals too). */
static inline float fp8_to_f32(uint8_t b) {
    const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* IEEE half as float32 (subnormals, infinities and NaN included). */
static inline float f16_to_f32(uint16_t h) {
#if STRATA_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* One weight matrix: rows of `row_bytes`; quantized kinds carry scales (and zero points, or NULL for the
   symmetric 2^(bits-1)) per group of `group_size` values of K. Dense kinds have one group and no scales. */
typedef struct {
    const uint8_t *data;
    int64_t row_bytes, n, k, groups, group_size;
    const float *scales, *zeros;
    int kind;
} weights_t;

static inline float load_value(const weights_t *w, const uint8_t *row, int64_t k) {
    switch (w->kind) {
    case KIND_F32: return ((const float *)row)[k];
    case KIND_BF16: return bf16_to_f32(((const uint16_t *)row)[k]);
    case KIND_F16: return f16_to_f32(((const uint16_t *)row)[k]);
    case KIND_INT8: return (float)row[k];
    case KIND_FP8: return fp8_to_f32(row[k]);
    default: {
        const uint8_t byte = row[k / BLOCK * (BLOCK / 2) + k % (BLOCK / 2)];
        return (float)(k % BLOCK < BLOCK / 2 ? byte & 15 : byte >> 4);
    }
    }
}

static inline float zero_point(const weights_t *w, int64_t n, int64_t g) {
    if (w->kind == KIND_FP8) return 0.f;
    if (w->zeros) return w->zeros[n * w->groups + g];
    return w->kind == KIND_INT4 ? 8.f : 128.f;
}

#if STRATA_AVX2
/* The 32 values of block b of a row, as four registers of 8 floats (quantized kinds: the raw unsigned q). */
static inline void load_block(int kind, const uint8_t *row, int64_t b, __m256 v[4]) {
    if (kind == KIND_F32) {
        const float *p = (const float *)row + b * BLOCK;
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
    } else if (kind == KIND_BF16) {
        const uint16_t *p = (const uint16_t *)row + b * BLOCK;
        for (int j = 0; j < 4; j++) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
        }
    } else if (kind == KIND_F16) {
        const uint16_t *p = (const uint16_t *)row + b * BLOCK;
        for (int j = 0; j < 4; j++) {
#if STRATA_F16C
            v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
#else
            float f[8];
            for (int i = 0; i < 8; i++) f[i] = f16_to_f32(p[8 * j + i]);
            v[j] = _mm256_loadu_ps(f);
#endif
        }
    } else if (kind == KIND_FP8) { /* sign and 7 bits moved under float32's exponent, then rebiased */
        const uint8_t *p = row + b * BLOCK;
        const __m256i sign = _mm256_set1_epi32(0x80), rest = _mm256_set1_epi32(0x7f);
        const __m256 rebias = _mm256_set1_ps(0x1p120f);
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j)));
            const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(q, sign), 24),
                                                 _mm256_slli_epi32(_mm256_and_si256(q, rest), 20));
            v[j] = _mm256_mul_ps(_mm256_castsi256_ps(bits), rebias);
        }
    } else if (kind == KIND_INT8) { /* widened straight from memory: no shuffles between the loads */
        const uint8_t *p = row + b * BLOCK;
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j))));
    } else { /* bytes 0-7 hold values 0-7 and 16-23, bytes 8-15 values 8-15 and 24-31 */
        const uint8_t *p = row + b * (BLOCK / 2);
        const __m256i nibble = _mm256_set1_epi32(15);
        const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
        v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
    }
}

#endif

#endif
