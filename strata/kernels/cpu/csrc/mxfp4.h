/* Small-batch products of MXFP4 weights as gpt-oss checkpoints store them (included by weight_only.c; the Python side
   is strata/layers/quantization/mxfp4.py): row n of the weight is `groups` blocks of 16 bytes, two e2m1 (FP4) codes
   a byte, low nibble first, and a uint8 e8m0 exponent per block in a separate [n, groups] table:
   value = e2m1 * 2^(exponent - 127). Each weight row is read once for up to 4 rows of x; a block's 32 values are
   decoded in registers through a 16-entry table and multiplied in float, as `x @ dequantized.T` is. */
#ifndef STRATA_MXFP4_H
#define STRATA_MXFP4_H

#include <stdint.h>
#include <string.h>

#include "prefetch.h"
#include "weight_values.h"

#define KIND_MXFP4 16 /* clear of the dense kinds (0-9) and of KIND_GGUF + ggml's types */
#define MXFP4_BLOCK_BYTES 16
#define MXFP4_MAX_MC 4

/* e2m1 codes doubled, so that they are whole numbers: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code | 8). The
   block's scale is then 2^(exponent - 128). */
static const int8_t MXFP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as float32, built from its bits: exact and finite for every e (0 and 1 give subnormals; 255, e8m0's
   NaN code, which no checkpoint holds, gives 2^127, so that a block of it overflows as ldexp's values would). */
static inline float mxfp4_half_scale(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : (uint32_t)0x00200000u << e;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if STRATA_AVX2
/* The 32 values of the block at p as doubled e2m1 codes in four registers of 8 floats, in K order. */
static inline void mxfp4_decode(const uint8_t *p, __m256 v[4]) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_DOUBLED), low4 = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi); /* values 0-15, 16-31 */
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
}

/* Row n against MC rows of x (stride k): each block's products form two chains, scaled into two running totals. */
static inline __attribute__((always_inline)) void mxfp4_row(const weights_t *w, const uint8_t *exps, int64_t n,
                                                           const float *x, const int MC, float *y) {
    const uint8_t *row = w->data + n * w->row_bytes, *e = exps + n * w->groups;
    __m256 total[MXFP4_MAX_MC][2];
    for (int m = 0; m < MC; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w->groups; b++) {
        if (b % 4 == 0) prefetch_ahead(row + b * MXFP4_BLOCK_BYTES, 64); /* once a cache line */
        __m256 v[4];
        mxfp4_decode(row + b * MXFP4_BLOCK_BYTES, v);
        const __m256 scale = _mm256_set1_ps(mxfp4_half_scale(e[b]));
        for (int m = 0; m < MC; m++) {
            const float *xb = x + m * w->k + b * BLOCK;
            const __m256 p0 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(v[0], _mm256_loadu_ps(xb)));
            const __m256 p1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(v[2], _mm256_loadu_ps(xb + 16)));
            total[m][0] = _mm256_fmadd_ps(p0, scale, total[m][0]);
            total[m][1] = _mm256_fmadd_ps(p1, scale, total[m][1]);
        }
    }
    for (int m = 0; m < MC; m++) y[m] = hsum(_mm256_add_ps(total[m][0], total[m][1]));
}

typedef void (*mxfp4_row_fn)(const weights_t *, const uint8_t *, int64_t, const float *, float *);
#define DEFINE_MXFP4_ROW(MC)                                                                                  \
    static void mxfp4_row_##MC(const weights_t *w, const uint8_t *exps, int64_t n, const float *x, float *y) { \
        mxfp4_row(w, exps, n, x, MC, y);                                                                      \
    }
DEFINE_MXFP4_ROW(1)
DEFINE_MXFP4_ROW(2)
DEFINE_MXFP4_ROW(4)
#define MXFP4_ROW_OF(MC) ((MC) == 4 ? mxfp4_row_4 : (MC) == 2 ? mxfp4_row_2 : mxfp4_row_1)
#define MXFP4_ROW(MC, w, exps, n, x, y) MXFP4_ROW_OF(MC)(w, exps, n, x, y)
#else
/* Portable: each block decoded into floats (its scale folded in), then multiplied by MC rows of x. */
static void mxfp4_row_portable(const weights_t *w, const uint8_t *exps, int64_t n, const float *x, int mc,
                               float *y) {
    const uint8_t *row = w->data + n * w->row_bytes, *e = exps + n * w->groups;
    for (int m = 0; m < mc; m++) y[m] = 0.f;
    for (int64_t b = 0; b < w->groups; b++) {
        const float scale = mxfp4_half_scale(e[b]);
        float v[BLOCK];
        for (int j = 0; j < MXFP4_BLOCK_BYTES; j++) {
            const uint8_t byte = row[b * MXFP4_BLOCK_BYTES + j];
            v[2 * j] = (float)MXFP4_DOUBLED[byte & 15];
            v[2 * j + 1] = (float)MXFP4_DOUBLED[byte >> 4];
        }
        for (int m = 0; m < mc; m++) {
            float acc = 0.f;
            for (int j = 0; j < BLOCK; j++) acc += v[j] * x[m * w->k + b * BLOCK + j];
            y[m] += acc * scale;
        }
    }
}
#define MXFP4_ROW(MC, w, exps, n, x, y) mxfp4_row_portable(w, exps, n, x, MC, y)
#endif

/* Rows n0..n1 of the weight against every row of x, up to 4 rows of x per pass over a weight row. */
static void mxfp4_rows_times_x(const weights_t *w, const uint8_t *exps, int64_t n0, int64_t n1, const float *x,
                               int64_t m_total, const float *bias, float *out) {
    for (int64_t m0 = 0; m0 < m_total;) {
        const int64_t left = m_total - m0;
        const int mc = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int64_t n = n0; n < n1; n++) {
            float y[MXFP4_MAX_MC];
            MXFP4_ROW(mc, w, exps, n, x + m0 * w->k, y);
            for (int m = 0; m < mc; m++) out[(m0 + m) * w->n + n] = y[m] + (bias ? bias[n] : 0.f);
        }
        m0 += mc;
    }
}

/* out[m_total, n] = x [m_total, k] times the MXFP4 weight's transpose (+ bias): blocks [n, row_bytes] (whole
   16-byte blocks of k / 32 a row, then any padding), exps uint8 [n, k / 32] contiguous. The weight's rows are
   shared among the threads. Returns 0, or -2 when k is not a whole number of blocks or the rows are too short. */
static int mxfp4_matmul(const float *x, int64_t m_total, int64_t k, const void *blocks, int64_t row_bytes,
                        const uint8_t *exps, const float *bias, float *out, int64_t n, int num_threads) {
    if (k % BLOCK || k / BLOCK * MXFP4_BLOCK_BYTES > row_bytes) return -2;
    const weights_t w = {blocks, row_bytes, n, k, k / BLOCK, BLOCK, NULL, NULL, KIND_MXFP4};
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* A small weight is read faster by one thread than the fork of a second costs. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < n ? n0 + ROWS_PER_TASK : n;
        mxfp4_rows_times_x(&w, exps, n0, n1, x, m_total, bias, out);
    }
    return 0;
}

#endif
