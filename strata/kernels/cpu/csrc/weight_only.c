/* Small-batch linear products read straight from float32, bfloat16, FP8 (e4m3), int8 or int4 weights (strata's
   packed layout, strata/layers/quantization/weight_only.py); weight_gemm.c has the GEMM of larger batches.
   MXFP4 blocks (mxfp4.h) and GGUF blocks (gguf_matmul.h; gguf_q8.h with x rounded to 8 bits) have kernels of their
   own.
   Built on first use by kernels/cpu/build.py; AVX-512 VNNI (weight_only_vnni.h), AVX-512 (weight_only_avx512.h) or
   AVX2/FMA when the machine has it, plain C otherwise. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "isa.h"
#include "prefetch.h"
#include "weight_values.h"

#define ROWS_PER_TASK 16
#define MAX_MC 8 /* rows of x multiplied per pass over a weight row (AVX2; the plain C loops take 4) */

#if STRATA_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The zero-point term of row n: sum over groups of scale * zero * (x summed over the group's full blocks).
   Eight groups at a time where AVX2 allows: a row's term in one long chain of adds cost the int4 kernel 15%. */
static inline float zero_term(const weights_t *w, int64_t n, const float *xsum) {
    if (w->kind == KIND_FP8) return 0.f;
    const float *scales = w->scales + n * w->groups, *zeros = w->zeros ? w->zeros + n * w->groups : NULL;
    float correction = 0.f;
    int64_t g = 0;
#if STRATA_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= w->groups; g += 8) {
        const __m256 term = _mm256_mul_ps(_mm256_loadu_ps(scales + g), _mm256_loadu_ps(xsum + g));
        acc = zeros ? _mm256_fmadd_ps(term, _mm256_loadu_ps(zeros + g), acc) : _mm256_add_ps(acc, term);
    }
    correction = hsum(acc);
#endif
    for (; g < w->groups; g++) correction += scales[g] * (zeros ? zeros[g] : 1.f) * xsum[g];
    return zeros ? correction : correction * (w->kind == KIND_INT4 ? 8.f : 128.f);
}

#if STRATA_AVX2
/* Full blocks of row n against MC rows of x: y[m] = sum over blocks of scale * (q . x) minus the zero-point
   term sum over groups of scale * zero * xsum (x summed per group over the full blocks). Each block is widened
   once for all MC rows; a row's four products of it form one chain, scaled into the row's running total (one
   total a row: eight rows of two totals each spilled, and a weight widened for 4 rows at a time cost 16 rows
   four widenings). */
static inline __attribute__((always_inline)) void row_blocks(const weights_t *w, int64_t n, const float *x,
                                                            const float *xsum, const int KIND, const int MC,
                                                            float *y) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const int64_t full = w->k / BLOCK, per_group = w->group_size / BLOCK, x_stride = w->k;
    const int quantized = scaled(KIND);
    const float *scales = quantized ? w->scales + n * w->groups : NULL;
    __m256 total[MAX_MC];
    for (int m = 0; m < MC; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; b < full; g++) {
        const int64_t end = quantized && (g + 1) * per_group < full ? (g + 1) * per_group : full;
        const __m256 scale = quantized ? _mm256_broadcast_ss(scales + g) : _mm256_set1_ps(1.f);
        for (; b < end; b++) {
            const int64_t block_bytes = KIND == KIND_F32                      ? 128
                                        : KIND == KIND_BF16 || KIND == KIND_F16 ? 64
                                        : KIND == KIND_INT8 || KIND == KIND_FP8 ? 32
                                                                                : 16;
            if (b * block_bytes % 64 == 0) prefetch_ahead(row + b * block_bytes, block_bytes); /* once a line */
            __m256 v[4];
            load_block(KIND, row, b, v);
            for (int m = 0; m < MC; m++) {
                const float *xb = x + m * x_stride + b * BLOCK;
                __m256 p = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                for (int j = 1; j < 4; j++) p = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xb + 8 * j), p);
                total[m] = quantized ? _mm256_fmadd_ps(p, scale, total[m]) : _mm256_add_ps(p, total[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++)
        y[m] = hsum(total[m]) - (quantized ? zero_term(w, n, xsum + m * w->groups) : 0.f);
}
#else
static inline void row_blocks(const weights_t *w, int64_t n, const float *x, const float *xsum, const int KIND,
                              const int MC, float *y) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const int64_t full = w->k / BLOCK, per_group = w->group_size / BLOCK, x_stride = w->k;
    (void)KIND;
    const int quantized = scaled(w->kind);
    for (int m = 0; m < MC; m++) y[m] = 0.f;
    int64_t b = 0;
    for (int64_t g = 0; g < w->groups && b < full; g++) {
        const int64_t end = quantized && (g + 1) * per_group < full ? (g + 1) * per_group : full;
        float acc[MAX_MC] = {0.f};
        for (; b < end; b++) {
            float v[BLOCK];
            for (int j = 0; j < BLOCK; j++) v[j] = load_value(w, row, b * BLOCK + j);
            for (int m = 0; m < MC; m++)
                for (int j = 0; j < BLOCK; j++) acc[m] += v[j] * x[m * x_stride + b * BLOCK + j];
        }
        const float scale = quantized ? w->scales[n * w->groups + g] : 1.f;
        const float zero = quantized ? zero_point(w, n, g) : 0.f;
        for (int m = 0; m < MC; m++) y[m] += scale * (acc[m] - (quantized ? zero * xsum[m * w->groups + g] : 0.f));
    }
}
#endif

/* The values past the last full block, dequantized one by one. */
static inline float row_tail(const weights_t *w, int64_t n, const float *x) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const int quantized = scaled(w->kind);
    float acc = 0.f;
    for (int64_t k = w->k / BLOCK * BLOCK; k < w->k; k++) {
        float v = load_value(w, row, k);
        if (quantized) {
            const int64_t g = k / w->group_size;
            v = (v - zero_point(w, n, g)) * w->scales[n * w->groups + g];
        }
        acc += v * x[k];
    }
    return acc;
}

#if STRATA_AVX2
/* R float32 rows of the weight against one row of x, four chains of sums each, every line asked for 8 KiB ahead:
   the general kernel's two chains of one row read a float32 table (a tied LM head's) at 10-14 GB/s from DRAM on
   2 Zen 3 cores, two rows of four chains at 15-18 (bfloat16 rows it already reads at 18). */
static inline __attribute__((always_inline)) void f32_rows_of(const weights_t *w, int64_t n, const float *x,
                                                             const int R, float *y) {
    const int64_t full = w->k / BLOCK * BLOCK;
    const float *row[2] = {(const float *)(w->data + n * w->row_bytes),
                           (const float *)(w->data + (n + R - 1) * w->row_bytes)};
    __m256 sum[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) sum[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += BLOCK) {
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(row[r] + k + 2048, 0, 3);
            __builtin_prefetch(row[r] + k + 2048 + 16, 0, 3);
        }
        for (int c = 0; c < 4; c++) {
            const __m256 xv = _mm256_loadu_ps(x + k + 8 * c);
            for (int r = 0; r < R; r++) sum[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(row[r] + k + 8 * c), xv, sum[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r] = hsum(_mm256_add_ps(_mm256_add_ps(sum[r][0], sum[r][1]), _mm256_add_ps(sum[r][2], sum[r][3])));
}

/* Rows n0..n1 of a float32 weight against one row of x, two at a time. */
static void f32_rows(const weights_t *w, int64_t n0, int64_t n1, const float *x, const float *bias, float *out) {
    for (int64_t n = n0; n < n1;) {
        const int r = n + 2 <= n1 ? 2 : 1;
        float y[2];
        if (r == 2) f32_rows_of(w, n, x, 2, y);
        else f32_rows_of(w, n, x, 1, y);
        for (int i = 0; i < r; i++, n++) out[n] = y[i] + row_tail(w, n, x) + (bias ? bias[n] : 0.f);
    }
}
#endif

typedef void (*row_fn)(const weights_t *, int64_t, const float *, const float *, float *);
#define DEFINE_ROW(KIND, MC)                                                                                   \
    static void row_##KIND##_##MC(const weights_t *w, int64_t n, const float *x, const float *xsum, float *y) { \
        row_blocks(w, n, x, xsum, KIND, MC, y);                                                                \
    }
#define DEFINE_ROWS(KIND) DEFINE_ROW(KIND, 1) DEFINE_ROW(KIND, 2) DEFINE_ROW(KIND, 4) DEFINE_ROW(KIND, 8)
DEFINE_ROWS(KIND_F32)
DEFINE_ROWS(KIND_BF16)
DEFINE_ROWS(KIND_INT4)
DEFINE_ROWS(KIND_INT8)
DEFINE_ROWS(KIND_FP8)
DEFINE_ROWS(KIND_F16)
#define ROWS_OF(KIND, MC) \
    ((MC) == 8 ? row_##KIND##_8 : (MC) == 4 ? row_##KIND##_4 : (MC) == 2 ? row_##KIND##_2 : row_##KIND##_1)

/* The kernel for a weight kind and a chunk of 1, 2, 4 or 8 rows of x, each specialised at compile time. */
static row_fn row_kernel(int kind, int mc) {
    switch (kind) {
    case KIND_F32: return ROWS_OF(KIND_F32, mc);
    case KIND_BF16: return ROWS_OF(KIND_BF16, mc);
    case KIND_INT4: return ROWS_OF(KIND_INT4, mc);
    case KIND_FP8: return ROWS_OF(KIND_FP8, mc);
    case KIND_F16: return ROWS_OF(KIND_F16, mc);
    default: return ROWS_OF(KIND_INT8, mc);
    }
}

static void rows_times_x(const weights_t *w, int64_t n0, int64_t n1, const float *x, int64_t m_total,
                         const float *xsum, const float *bias, float *out) {
#if STRATA_AVX2
    if (w->kind == KIND_F32 && m_total == 1) { /* two weight rows at a time */
        f32_rows(w, n0, n1, x, bias, out);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m_total;) {
        const int64_t left = m_total - m0;
        const int mc = left >= 8 && STRATA_AVX2 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const row_fn kernel = row_kernel(w->kind, mc);
        const float *xm = x + m0 * w->k;
        for (int64_t n = n0; n < n1; n++) {
            float y[MAX_MC];
            kernel(w, n, xm, xsum + m0 * w->groups, y);
            for (int m = 0; m < mc; m++)
                out[(m0 + m) * w->n + n] = y[m] + row_tail(w, n, xm + m * w->k) + (bias ? bias[n] : 0.f);
        }
        m0 += mc;
    }
}

#if STRATA_AVX2 /* with AVX-512 too: the GGUF kernels share its rounding of x */
#include "weight_only_avx2.h"
#endif

#if STRATA_AVX512BW
#include "weight_only_avx512.h"
#endif
#if STRATA_AVX512VNNI
#include "weight_only_vnni.h"
#endif

#include "gguf_matmul.h"
#include "gguf_q8.h"
#include "mxfp4.h"
#include "mxfp4_q8.h"

#if STRATA_AVX512BW && !STRATA_AVX512VNNI /* the float32 path of AVX-512 CPUs without VNNI */
typedef void (*row512_fn)(const weights_t *, int64_t, const float *, int64_t, const float *, float *);
#define DEFINE_ROW512(KIND, MC)                                                                               \
    static void row512_##KIND##_##MC(const weights_t *w, int64_t n, const float *xp, int64_t blocks,          \
                                     const float *xsum, float *y) {                                            \
        avx512_row(w, n, xp, blocks, xsum, KIND, MC, y);                                                       \
    }
#define DEFINE_ROWS512(KIND) DEFINE_ROW512(KIND, 1) DEFINE_ROW512(KIND, 2) DEFINE_ROW512(KIND, 4) DEFINE_ROW512(KIND, 8)
DEFINE_ROWS512(KIND_INT4)
DEFINE_ROWS512(KIND_INT8)
#define ROWS512_OF(KIND, MC) \
    ((MC) == 8 ? row512_##KIND##_8 : (MC) == 4 ? row512_##KIND##_4 : (MC) == 2 ? row512_##KIND##_2 : row512_##KIND##_1)

/* Rows n0..n1 of the weight against every row of x, up to 8 rows of x per pass while the weight rows sit in
   L1/L2. The kernel covers the padded K (its padding meets zeros in the prepared x). */
static void rows_times_x512(const weights_t *w, int64_t n0, int64_t n1, const float *xp, int64_t blocks,
                            int64_t m_total, const float *xsum, const float *bias, float *out) {
    for (int64_t m0 = 0; m0 < m_total;) {
        const int64_t left = m_total - m0;
        const int mc = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const row512_fn kernel = w->kind == KIND_INT4 ? ROWS512_OF(KIND_INT4, mc) : ROWS512_OF(KIND_INT8, mc);
        for (int64_t n = n0; n < n1; n++) {
            float y[MAX_MC512];
            kernel(w, n, xp + m0 * blocks * BLOCK, blocks, xsum + m0 * w->groups, y);
            for (int m = 0; m < mc; m++) out[(m0 + m) * w->n + n] = y[m] + (bias ? bias[n] : 0.f);
        }
        m0 += mc;
    }
}

static int matmul_avx512(const weights_t *w, const float *x, int64_t m_total, const float *bias, float *out,
                         int num_threads) {
    const int64_t blocks = (w->k + BLOCK - 1) / BLOCK;
    const size_t xp_floats = (size_t)(m_total * blocks * BLOCK);
    float *xp = aligned_alloc(64, ((xp_floats + (size_t)(m_total * w->groups)) * sizeof(float) + 63) / 64 * 64);
    if (!xp) return -1;
    float *xsum = xp + xp_floats; /* x summed per group, in double: it meets the zero points' large factor */
    for (int64_t m = 0; m < m_total; m++)
        for (int64_t g = 0; g < w->groups; g++) {
            double sum = 0.;
            const int64_t hi = (g + 1) * w->group_size < w->k ? (g + 1) * w->group_size : w->k;
            for (int64_t i = g * w->group_size; i < hi; i++) sum += x[m * w->k + i];
            xsum[m * w->groups + g] = (float)sum;
        }
    avx512_prepare_x(w->kind, x, m_total, w->k, blocks, xp);
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* A small weight is read faster by one thread than the fork of a second costs. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        rows_times_x512(w, n0, n1, xp, blocks, m_total, xsum, bias, out);
    }
    free(xp);
    return 0;
}
#endif

/* Bytes of a strip of 16 outputs of a GGUF kind (KIND_GGUF + ggml's type) in the int8 kernels' tile layout
   (gguf_q8_tiled.h), rows of k values; -2 where this build has no kernels for that layout, the kind none, or k is
   not whole blocks. */
int64_t q8_tiled_strip_bytes(int kind, int64_t k) {
    if (!STRATA_AVX2 || !q8_has_kernel(kind) || k <= 0 || k % gguf_block_values(kind)) return -2;
    return q8t_strip_bytes(kind, k);
}

/* out[m_total, n] = x[m_total, k] (float32, contiguous) times the weight's transpose (+ bias, float32 or NULL).
   kind: 0 float32 / 1 bfloat16 weight [n, k]; 4 / 8: packed int4 / int8 with scales and zeros
   [n, groups]; 9: float8 e4m3 bytes [n, k] with scales [n, 1]; 16: MXFP4 blocks [n, k / 2] with their uint8 e8m0
   exponents [n, k / 32] passed as `scales` (mxfp4.h; zeros and groups unused); 32 + ggml's type: GGUF blocks
   (gguf_blocks.h; scales, zeros and groups unused); 64 + ggml's type: the same blocks times x rounded to Q8_0 / Q8_K
   as llama.cpp rounds it (gguf_q8.h); 96 + ggml's type: those products with the weight in the tile layout
   (gguf_q8_tiled.h, strips of 16 outputs `row_bytes` apart). Rows of the weight are shared among the threads, each read
   once for every 8 rows of x (4 in plain C; int4 and int8 at one row on AVX2: the fixed-point kernels). Returns 0,
   -1 when scratch memory ran out, -2 for a GGUF kind strata does not read or a K that is not a whole number of its
   blocks. */
int weight_only_matmul(const float *x, int64_t m_total, int64_t k, const void *weight, int64_t row_bytes,
                       int kind, const float *scales, const float *zeros, int64_t groups, int64_t group_size,
                       const float *bias, float *out, int64_t n, int num_threads) {
    if (kind == KIND_MXFP4)
        return mxfp4_matmul(x, m_total, k, weight, row_bytes, (const uint8_t *)scales, bias, out, n, num_threads);
    if (kind >= KIND_GGUF_Q8) { /* x rounded to 8 bits as llama.cpp rounds it (gguf_q8.h) */
        const int tiled = kind >= KIND_GGUF_Q8T, base = kind - (tiled ? KIND_GGUF_Q8T : KIND_GGUF_Q8) + KIND_GGUF;
        if (!q8_has_kernel(base) || (tiled ? q8_tiled_strip_bytes(base, k) != row_bytes
                                           : !gguf_shape_ok(base, k, row_bytes)))
            return -2;
        const weights_t gw = {weight, row_bytes, n, k, 1, k, NULL, NULL, base};
        return gguf_q8_matmul(&gw, tiled, x, m_total, bias, out, num_threads);
    }
    kind = gguf_dense_kind(kind);
    if (kind >= KIND_GGUF && kind != KIND_F16) {
        if (!gguf_shape_ok(kind, k, row_bytes)) return -2;
        const weights_t gw = {weight, row_bytes, n, k, 1, k, NULL, NULL, kind};
        return gguf_matmul(&gw, x, m_total, bias, out, num_threads);
    }
    const int quantized = kind == KIND_INT4 || kind == KIND_INT8; /* with zero points */
    const weights_t w = {weight, row_bytes, n, k, scaled(kind) ? groups : 1,
                         scaled(kind) ? group_size : k + BLOCK, scales, zeros, kind};
#if STRATA_AVX512BW /* dense kinds are memory-bound, and no faster with it */
#if STRATA_AVX512VNNI
    if (quantized) return matmul_vnni(&w, x, m_total, bias, out, num_threads);
#else
    if (quantized) return matmul_avx512(&w, x, m_total, bias, out, num_threads);
#endif
#endif
#if STRATA_AVX2 && !STRATA_AVX512BW
    if (kind == KIND_INT4 && m_total == 1) return matmul_int4_avx2(&w, x, bias, out, num_threads);
    if (kind == KIND_INT8 && m_total == 1 && (w.groups == 1 || w.group_size % I4_XBLOCK == 0))
        return matmul_int8_avx2(&w, x, bias, out, num_threads);
#endif
    /* x summed per group over the full blocks, for the zero points. */
    float *xsum = calloc((size_t)(m_total * w.groups), sizeof(float));
    if (!xsum) return -1;
    if (quantized) /* group by group: no division per value */
        for (int64_t m = 0; m < m_total; m++)
            for (int64_t g = 0, lo = 0; lo < k / BLOCK * BLOCK; g++, lo += group_size) {
                const int64_t hi = lo + group_size < k / BLOCK * BLOCK ? lo + group_size : k / BLOCK * BLOCK;
                float sum = 0.f;
                for (int64_t i = lo; i < hi; i++) sum += x[m * k + i];
                xsum[m * w.groups + g] = sum;
            }
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < n ? n0 + ROWS_PER_TASK : n;
        rows_times_x(&w, n0, n1, x, m_total, xsum, bias, out);
    }
    free(xsum);
    return 0;
}

/* out[count, k] = rows ids[0..count) of a weight as float32 (an embedding looked up in its own storage): GGUF blocks
   (32 + ggml's type) or the dense float32, float16 and bfloat16 kinds. Returns 0, or -2 for another kind or a K of
   partial blocks. */
int weight_rows(const void *weight, int64_t row_bytes, int kind, int64_t k, const int64_t *ids, int64_t count,
                float *out, int num_threads) {
    kind = gguf_dense_kind(kind);
    const int dense = kind == KIND_F32 || kind == KIND_F16 || kind == KIND_BF16;
    if (!dense && !gguf_shape_ok(kind, k, row_bytes)) return -2;
    const weights_t w = {weight, row_bytes, 0, k, 1, k, NULL, NULL, kind};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * k >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w.data + ids[i] * row_bytes;
        if (dense)
            for (int64_t j = 0; j < k; j++) out[i * k + j] = load_value(&w, row, j);
        else
            gguf_row_floats(kind, row, 0, k, out + i * k);
    }
    return 0;
}

/* A GGUF weight [n, k] (rows src_row_bytes apart) laid out in strips of 16 outputs (q8_tiled_strip_bytes each, the
   last one's rows past n zeros) at dst, once, at load. Returns 0, or -2 as q8_tiled_strip_bytes. */
int q8_tile_weight(const void *src, int64_t src_row_bytes, int64_t n, int64_t k, int kind, void *dst,
                   int num_threads) {
    const int64_t strip_bytes = q8_tiled_strip_bytes(kind, k);
    if (strip_bytes < 0 || !gguf_shape_ok(kind, k, src_row_bytes)) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t strip = 0; strip < (n + 15) / 16; strip++)
        q8t_layout_strip(kind, src, src_row_bytes, n, k, 16 * strip, (uint8_t *)dst + strip * strip_bytes);
    return 0;
}

/* Bytes of one row of k values rounded to 8 bits in blocks of per_block (32: Q8_0 / Q8_1, 256: Q8_K) as
   q8_round_rows lays it out, a multiple of 64; -2 for another block size or a k of partial blocks. */
int64_t q8_rounded_row_bytes(int64_t k, int per_block) {
    if ((per_block != 32 && per_block != QK_K) || k <= 0 || k % per_block) return -2;
    return (int64_t)q8_row_stride(k, per_block);
}

/* Rows x [m, k] rounded as llama.cpp rounds them (gguf_q8.h), once, into `rounded` (m rows of
   q8_rounded_row_bytes, 64-byte aligned): the routed experts' input, each token's row multiplied by every expert
   it is routed to. Returns 0, or -2 as q8_rounded_row_bytes. */
int q8_round_rows(const float *x, int64_t m, int64_t k, int per_block, void *rounded, int num_threads) {
    const int64_t stride = q8_rounded_row_bytes(k, per_block);
    if (stride < 0) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m >= 8)
    for (int64_t i = 0; i < m; i++) {
        q8_x_t row = q8_at((uint8_t *)rounded + stride * i, k, per_block);
        q8_round_row(x + i * k, k, per_block, &row);
    }
    return 0;
}

/* out[count, n] = rows ids[0..count) (rows 0..count when ids is NULL) of x rounded by q8_round_rows times a weight's
   transpose (+ bias): KIND_GGUF_Q8 + ggml's type (x in that type's blocks), or KIND_MXFP4 with its exponents
   [n, k / 32] (x in Q8_0 blocks; mxfp4_q8.h). Returns 0, -1 when memory ran out, -2 for another kind or shape. */
int q8_rounded_matmul(const void *rounded, int64_t k, const int64_t *ids, int64_t count, const void *weight,
                      int64_t row_bytes, int kind, const uint8_t *exps, const float *bias, float *out, int64_t n,
                      int num_threads) {
    const int mxfp4 = kind == KIND_MXFP4, base = kind - KIND_GGUF_Q8 + KIND_GGUF;
    if (mxfp4 ? k % BLOCK || k / BLOCK * MXFP4_BLOCK_BYTES > row_bytes || !exps
              : kind < KIND_GGUF_Q8 || !q8_has_kernel(base) || !gguf_shape_ok(base, k, row_bytes))
        return -2;
    const int per_block = mxfp4 ? 32 : (int)gguf_block_values(base);
    const int64_t stride = q8_rounded_row_bytes(k, per_block);
    q8_x_t *xs = malloc((size_t)(count > 0 ? count : 1) * sizeof(q8_x_t));
    if (!xs) return -1;
    for (int64_t i = 0; i < count; i++) xs[i] = q8_at((uint8_t *)rounded + stride * (ids ? ids[i] : i), k, per_block);
    const weights_t w = {weight, row_bytes, n, k, 1, k, NULL, NULL, mxfp4 ? KIND_MXFP4 : base};
    if (mxfp4) mxq_multiply(&w, exps, xs, count, bias, out, num_threads);
    else q8_multiply(&w, xs, count, bias, out, num_threads);
    free(xs);
    return 0;
}

/* Rows of x up to which a GGUF kind's products take the fixed-point kernels (gguf_dot_avx2.h), 0 to 8; returns 0,
   or -2 where this build has no fixed-point kernel for the kind. Set while no product of the kind runs:
   kernel_choice.py's calibration, then its measured crossover, before a model's first step. */
int set_fixed_point_rows(int kind, int64_t rows) {
#if STRATA_AVX2
    if (!gguf_has_fixed_point(kind) || rows < 0 || rows > FIXED_POINT_MAX_ROWS) return -2;
    fixed_point_rows_of[kind - KIND_GGUF] = rows;
    return 0;
#else
    (void)kind, (void)rows;
    return -2;
#endif
}

/* The rows of x up to which a GGUF kind takes the fixed-point kernels now; -2 where this build has none for it. */
int64_t fixed_point_rows(int kind) {
#if STRATA_AVX2
    return gguf_has_fixed_point(kind) ? gguf_fixed_point_rows(kind) : -2;
#else
    (void)kind;
    return -2;
#endif
}

/* Which kernels the int8-activation GGUF products (gguf_q8.h) run on in this build. */
const char *int8_activations_build(void) {
#if STRATA_AVX512VNNI
    return "AVX-512 VNNI";
#elif STRATA_AVXVNNI
    return "AVX-VNNI";
#elif STRATA_AVX2
    return "AVX2";
#else
    return "portable C";
#endif
}

/* Which of the kernels above this build compiled in, for the CPU it was built on (`strata bench latency` says). */
const char *weight_only_build(void) {
#if STRATA_AVX512VNNI
    return "AVX-512 with VNNI";
#elif STRATA_AVX512BW
    return "AVX-512";
#elif STRATA_AVX2
    return "AVX2";
#else
    return "portable C";
#endif
}

STRATA_ABI_EXPORT(weight_only, STRATA_ABI_WEIGHT_KINDS STRATA_ABI_CONST(KIND_MXFP4) STRATA_ABI_CONST(KIND_GGUF_Q8)
                                STRATA_ABI_CONST(KIND_GGUF_Q8T))
