/* GGUF products with x rounded to 8 bits as llama.cpp rounds it (the `quantized_activations=int8` option): each row
   of x once per product to Q8_0 blocks (32 values, an fp16 d = max|x| / 127, q = roundf(x / d); with Q8_1's
   s = fp16(d * sum q) for Q4_1 / Q5_1) for the legacy kinds, to Q8_K blocks (256 values, float d, q = nearest_int)
   for the K-quants, as ggml-quants.c's quantize_row_q8_{0,1,K}_ref do; then exact integer dot products per block,
   scaled in float once a block (AVX-512 VNNI vpdpbusd: the weights' unsigned q times x's signed q; AVX2's
   vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd, in gguf_q8_avx2.h; portable C elsewhere). A model's product weights
   on AVX2 and AVX-512 builds are in the tile layout of gguf_q8_tiled.h instead (its VNNI kernels and AMX's int8
   tiles from Q8T_MIN_TILE_ROWS; AVX2's in gguf_q8_tiled_avx2.h); the kernels on the blocks serve the routed
   experts and the portable builds. Included by weight_only.c after gguf_matmul.h; kinds KIND_GGUF_Q8 + ggml's
   type (KIND_GGUF_Q8T + ggml's type: the tile layout). */
#ifndef STRATA_GGUF_Q8_H
#define STRATA_GGUF_Q8_H
#include <math.h>

#include "gguf_blocks.h"
#include "gguf_q8_round.h"

enum { KIND_GGUF_Q8 = 64 }; /* + ggml's type: that GGUF kind, products with x rounded to 8 bits */

#define Q8_ROWS_PER_PASS 64 /* rows of x per pass over a task's weight rows (their rounded x stays in L2) */

/* M(kind) for each GGUF kind with int8-activation kernels: every dispatch over them lists them here, once. */
#define Q8_EACH_KIND(M) \
    M(KIND_Q4_0) M(KIND_Q4_1) M(KIND_Q5_0) M(KIND_Q5_1) M(KIND_Q8_0) M(KIND_Q4_K) M(KIND_Q5_K) M(KIND_Q6_K)

/* Whether a GGUF kind has int8-activation kernels. */
static inline int q8_has_kernel(int kind) {
    switch (kind) {
#define Q8_CASE(K) case K:
    Q8_EACH_KIND(Q8_CASE) return 1;
#undef Q8_CASE
    default: return 0;
    }
}

/* Portable: one block of a weight row against rounded x (block b). Integer sums per run, float once a block. */
static inline float q8_block_portable(int kind, const uint8_t *block, int64_t b, const q8_x_t *x) {
    int q[32];
    float scale[2], offset[2];
    if (gguf_block_values(kind) == 32) {
        gguf_run_scalar(kind, block, 0, q, scale, offset);
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int l = 0; l < 32; l++) sum += q[l] * xq[l];
        const int32_t xsum = x->sum16[2 * b] + x->sum16[2 * b + 1];
        const float d = half_at(block);
        if (kind == KIND_Q4_1 || kind == KIND_Q5_1) return d * x->d[b] * (float)sum + half_at(block + 2) * x->s[b];
        return d * x->d[b] * (float)(sum - gguf_zero(kind) * xsum);
    }
    int32_t total = 0, mins = 0;
    for (int j = 0; j < 8; j++) { /* 32-value runs */
        gguf_run_scalar(kind, block, j, q, scale, offset);
        const int8_t *xq = x->q + QK_K * b + 32 * j;
        int32_t half_sums[2] = {0, 0};
        for (int l = 0; l < 32; l++) half_sums[l / 16] += q[l] * xq[l];
        const int32_t *s16 = x->sum16 + QK_K / 16 * b + 2 * j;
        if (kind == KIND_Q6_K) { /* 16-value sub-blocks with int8 scales, offset -32 */
            const int h = j / 4, s = j % 4;
            for (int i = 0; i < 2; i++)
                total += (int8_t)block[192 + 8 * h + 2 * s + i] * (half_sums[i] - 32 * s16[i]);
        } else {
            int sc, mn;
            k_scale_min(block + 4, j, &sc, &mn);
            total += sc * (half_sums[0] + half_sums[1]);
            mins += mn * (s16[0] + s16[1]);
        }
    }
    if (kind == KIND_Q6_K) return half_at(block + 208) * x->d[b] * (float)total;
    return x->d[b] * half_at(block) * (float)total - x->d[b] * half_at(block + 2) * (float)mins;
}

static inline float q8_row_portable(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x) {
    const int64_t bytes = gguf_block_bytes(kind);
    float sum = 0.f;
    for (int64_t b = 0; b < blocks; b++) sum += q8_block_portable(kind, row + b * bytes, b, x);
    return sum;
}

#if STRATA_AVX2
/* A Q4_K / Q5_K block's 8 sub-block scales (low half) and mins (high half) as 16 int16 (gguf_dot_avx2.h's bytes). */
static inline __m256i q8_k_scales_mins(const uint8_t *packed) { return _mm256_cvtepu8_epi16(k_scales_mins(packed)); }
#endif

#if STRATA_AVX512VNNI
#include "gguf_q8_vnni.h"
#elif STRATA_AVX2
#include "gguf_q8_avx2.h"
#endif
#include "gguf_q8_tiled.h" /* after the VNNI kernels */
#if STRATA_AMX_INT8
#include "gguf_q8_tiled_amx.h"
#endif

#if STRATA_AVX512VNNI
#define Q8_TILE Q8V_ROWS /* rows of x that the kernels take at once (and their halves, down to one) */
#elif STRATA_AVX2
#define Q8_TILE Q8A_ROWS
#else
#define Q8_TILE 1
#endif

/* One weight row against `count` rounded rows of x (Q8_TILE or a power of two below it): y[r]. The AVX-512 VNNI
   kernels, else AVX2's, else portable C. */
static inline void q8_rows(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x, int count, float *y) {
#if STRATA_AVX512VNNI
    q8_rows_vnni(kind, row, blocks, x, count, y);
#elif STRATA_AVX2
    q8_rows_avx2(kind, row, blocks, x, count, y);
#else
    for (int r = 0; r < count; r++) y[r] = q8_row_portable(kind, row, blocks, x + r);
#endif
}

/* Rounds every row of x once (threads over rows when there are many) into rows q8_row_stride apart, then m_alloc -
   m_total rows of zeros; -1 when memory ran out. The caller frees *buffer. */
static int q8_prepare(const float *x, int64_t m_total, int64_t m_alloc, int64_t k, int per_block, q8_x_t *xs,
                      void **buffer) {
    const size_t stride = q8_row_stride(k, per_block);
    uint8_t *base = aligned_alloc(64, stride * (size_t)m_alloc);
    if (!base) return -1;
    *buffer = base;
    memset(base + stride * (size_t)m_total, 0, stride * (size_t)(m_alloc - m_total));
    for (int64_t m = 0; m < m_total; m++) xs[m] = q8_at(base + stride * (size_t)m, k, per_block);
    /* threads from 64 Ki values: a verification step's rows round in less time than a fork costs */
#pragma omp parallel for schedule(static) if (m_total * k >= (1 << 16))
    for (int64_t m = 0; m < m_total; m++) q8_round_row(x + m * k, k, per_block, xs + m);
    return 0;
}

/* out[m_total, n] = rounded rows xs times a GGUF weight's transpose (+ bias): the weight's rows shared among the
   threads, each read once for up to Q8_ROWS_PER_PASS rows of x. */
static void q8_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                        int num_threads) {
    const int64_t blocks = w->k / gguf_block_values(w->kind);
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        for (int64_t m0 = 0; m0 < m_total; m0 += Q8_ROWS_PER_PASS) {
            const int64_t m1 = m0 + Q8_ROWS_PER_PASS < m_total ? m0 + Q8_ROWS_PER_PASS : m_total;
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *row = w->data + n * w->row_bytes;
                for (int64_t m = m0; m < m1;) {
                    int count = Q8_TILE;
                    while (count > m1 - m) count /= 2;
                    float y[Q8_TILE];
                    q8_rows(w->kind, row, blocks, xs + m, count, y);
                    for (int r = 0; r < count; r++, m++) out[m * w->n + n] = y[r] + (bias ? bias[n] : 0.f);
                }
            }
        }
    }
}

/* out[m_total, n] = x (rounded as above) times a GGUF weight's transpose (+ bias), any number of rows of x. A weight
   in the tile layout (tiled; AVX2 builds and up, gguf_q8_tiled.h): on AMX's int8 tiles from Q8T_MIN_TILE_ROWS rows
   where the build and the CPU have them, else its strips shared among the threads; a weight in its GGUF blocks (the
   routed experts, builds without the layout): its rows shared among the threads, each read once for up to
   Q8_ROWS_PER_PASS rows of x. Returns 0, -1 when memory ran out, -2 for a kind without these kernels. */
static int gguf_q8_matmul(const weights_t *w, int tiled, const float *x, int64_t m_total, const float *bias,
                          float *out, int num_threads) {
    if (!q8_has_kernel(w->kind) || (tiled && !STRATA_AVX2)) return -2;
    const int per_block = (int)gguf_block_values(w->kind);
#if STRATA_AMX_INT8
    const int tiles = tiled && m_total >= Q8T_MIN_TILE_ROWS && amx_permitted();
#else
    const int tiles = 0;
#endif
    const int64_t m_alloc = tiles ? (m_total + 15) / 16 * 16 : m_total;
    q8_x_t *xs = calloc((size_t)m_total, sizeof(q8_x_t));
    void *buffer = NULL;
    if (!xs || q8_prepare(x, m_total, m_alloc, w->k, per_block, xs, &buffer) != 0) {
        free(xs);
        return -1;
    }
    int status = 0;
#if STRATA_AMX_INT8
    const int64_t stride = (int64_t)q8_row_stride(w->k, per_block);
    if (tiles) status = q8t_tile_multiply(w, xs, m_total, stride, bias, out, num_threads);
    else
#endif
#if STRATA_AVX2
    if (tiled) q8t_multiply(w, xs, m_total, bias, out, num_threads);
    else
#endif
        q8_multiply(w, xs, m_total, bias, out, num_threads);
    free(buffer);
    free(xs);
    return status;
}

#endif
