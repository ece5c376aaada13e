/* Small-batch products read straight from oneDNN's packed (blocked) linear weights, so that one copy of each
   weight serves oneDNN's GEMM for large batches and this kernel for the few rows of a decode step. Built on
   first use by kernels/cpu/build.py, called from strata/layers/onednn_weights.py, which checks the layout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "bf16.h"
#include "isa.h"
#include "prefetch.h"

#define MAX_ROWS 4 /* rows of x per pass over a block of weights */

/* Layout: outputs in blocks of NB; block b holds k_pad rows of NB outputs (float32), or k_pad / 2 rows of NB
   pairs (bfloat16: values k and k + 1 of one output side by side); padding holds zeros. */
#define DEFINE_BLOCK(NAME, NB)                                                                                 \
    static void NAME(const float *x, int64_t rows, int64_t k, const void *block, int bf16, float *acc) {      \
        for (int64_t i = 0; i < rows * NB; i++) acc[i] = 0.f;                                                  \
        if (!bf16) {                                                                                           \
            const float *w = block;                                                                            \
            for (int64_t kk = 0; kk < k; kk++, w += NB) {                                                      \
                prefetch_ahead(w, NB * 4);                                                                     \
                for (int64_t m = 0; m < rows; m++) {                                                           \
                    const float xv = x[m * k + kk];                                                            \
                    float *a = acc + m * NB;                                                                   \
                    _Pragma("omp simd") for (int64_t i = 0; i < NB; i++) a[i] += xv * w[i];                    \
                }                                                                                              \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        const uint32_t *w = block;                                                                             \
        for (int64_t kk = 0; kk < k; kk += 2, w += NB) {                                                       \
            prefetch_ahead(w, NB * 4);                                                                         \
            for (int64_t m = 0; m < rows; m++) {                                                               \
                const float x0 = x[m * k + kk], x1 = kk + 1 < k ? x[m * k + kk + 1] : 0.f;                     \
                float *a = acc + m * NB;                                                                       \
                _Pragma("omp simd") for (int64_t i = 0; i < NB; i++) {                                         \
                    uint32_t lo_bits = w[i] << 16, hi_bits = w[i] & 0xffff0000u;                               \
                    float lo, hi;                                                                              \
                    memcpy(&lo, &lo_bits, 4);                                                                  \
                    memcpy(&hi, &hi_bits, 4);                                                                  \
                    a[i] += x0 * lo + x1 * hi;                                                                 \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

DEFINE_BLOCK(block_64, 64)
DEFINE_BLOCK(block_32, 32)
DEFINE_BLOCK(block_16, 16)
DEFINE_BLOCK(block_8, 8)

typedef void (*block_fn)(const float *, int64_t, int64_t, const void *, int, float *);

#if STRATA_AVX2
/* float32 weights on AVX2: R rows of x against a strip of S outputs of a block of NB, the R * S / 8 sums in
   registers over k rows of the block. The loops above keep their sums in memory (a load and a store beside each
   FMA): 15-16 GB/s from DRAM on 2 Zen 3 cores where one row of x through this reads at the plain read loop's
   18-20. A strip narrower than the block asks for the rest of each row, which the next strip reads from L1. */
static inline __attribute__((always_inline)) void strip_f32(const float *x, int64_t x_stride, int64_t k,
                                                           const float *w, int64_t nb, const int R, const int S,
                                                           float *acc) {
    __m256 sum[12];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < S / 8; j++) sum[r * S / 8 + j] = _mm256_loadu_ps(acc + r * nb + 8 * j);
    for (int64_t kk = 0; kk < k; kk++, w += nb) {
        for (int64_t c = S; c < nb; c += 16) __builtin_prefetch(w + c, 0, 3);
        __m256 xv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) xv[r] = _mm256_broadcast_ss(x + r * x_stride + kk);
#pragma GCC unroll 8
        for (int j = 0; j < S / 8; j++) {
            const __m256 wv = _mm256_loadu_ps(w + 8 * j);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) sum[r * S / 8 + j] = _mm256_fmadd_ps(wv, xv[r], sum[r * S / 8 + j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < S / 8; j++) _mm256_storeu_ps(acc + r * nb + 8 * j, sum[r * S / 8 + j]);
}

#if STRATA_AVX512F
/* The same for a whole 64-wide block on AVX-512: four zmm sums a row of x over all k rows of the block, one
   stream the hardware prefetcher follows (asking for lines 1-16 KiB ahead measured slower). One row of x reads
   Llama 250M's float32 linears at 28.8 GB/s against 25.0 through the ymm strips, on two Xeon cores. */
static inline __attribute__((always_inline)) void block64_f32(const float *x, int64_t x_stride, int64_t k,
                                                              const float *w, const int R, float *acc) {
    __m512 sum[12];
#pragma GCC unroll 12
    for (int i = 0; i < 4 * R; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++, w += 64) {
        __m512 xv[3];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) xv[r] = _mm512_set1_ps(x[r * x_stride + kk]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512 wv = _mm512_loadu_ps(w + 16 * j);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) sum[4 * r + j] = _mm512_fmadd_ps(wv, xv[r], sum[4 * r + j]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < 4 * R; i++) _mm512_storeu_ps(acc + (i / 4) * 64 + 16 * (i % 4), sum[i]);
}
#define DEFINE_BLOCK64(R)                                                                                      \
    static void block64_##R(const float *x, int64_t k, const float *w, int64_t nb, float *acc) {              \
        (void)nb;                                                                                              \
        block64_f32(x, k, k, w, R, acc);                                                                       \
    }
DEFINE_BLOCK64(1) DEFINE_BLOCK64(2) DEFINE_BLOCK64(3)
#endif

#define KC 64 /* rows of a block per strip when several strips cover it: 16 KiB of a 64-wide block */
/* The block in strips as wide as twelve sums allow (64 outputs for one row of x, 32 for two or three), K in
   chunks of KC. */
#define DEFINE_STRIPS(R, S)                                                                                   \
    static void strips_##R##_##S(const float *x, int64_t k, const float *w, int64_t nb, float *acc) {         \
        for (int64_t i = 0; i < R * nb; i++) acc[i] = 0.f;                                                     \
        for (int64_t k0 = 0; k0 < k; k0 += KC)                                                                 \
            for (int64_t c = 0; c < nb; c += S)                                                                \
                strip_f32(x + k0, k, k0 + KC < k ? KC : k - k0, w + k0 * nb + c, nb, R, S, acc + c);            \
    }
DEFINE_STRIPS(1, 64) DEFINE_STRIPS(1, 32) DEFINE_STRIPS(1, 16) DEFINE_STRIPS(1, 8)
DEFINE_STRIPS(2, 32) DEFINE_STRIPS(2, 16) DEFINE_STRIPS(2, 8)
DEFINE_STRIPS(3, 32) DEFINE_STRIPS(3, 16) DEFINE_STRIPS(3, 8)

/* Up to MAX_ROWS rows of x against a block: float32 weights and up to three rows through the strips, the rest
   through fn (four rows in strips of 16 outputs read at 11 GB/s, 14 through fn). */
static void block_product(const float *x, int64_t rows, int64_t k, const void *block, int bf16, int64_t nb,
                          block_fn fn, float *acc) {
    typedef void (*strips_fn)(const float *, int64_t, const float *, int64_t, float *);
    static const strips_fn by_rows[3][4] = {{strips_1_8, strips_1_16, strips_1_32, strips_1_64},
                                            {strips_2_8, strips_2_16, strips_2_32, strips_2_32},
                                            {strips_3_8, strips_3_16, strips_3_32, strips_3_32}};
    if (bf16 || rows > 3) return fn(x, rows, k, block, bf16, acc);
#if STRATA_AVX512F
    static const strips_fn whole[3] = {block64_1, block64_2, block64_3};
    if (nb == 64) return whole[rows - 1](x, k, block, nb, acc);
#endif
    by_rows[rows - 1][nb == 8 ? 0 : nb == 16 ? 1 : nb == 32 ? 2 : 3](x, k, block, nb, acc);
}
#else
static void block_product(const float *x, int64_t rows, int64_t k, const void *block, int bf16, int64_t nb,
                          block_fn fn, float *acc) {
    (void)nb;
    fn(x, rows, k, block, bf16, acc);
}
#endif

/* out[m_total, n] (+ bias, float32) = x[m_total, k] times the blocked weight's transpose; x and out are float32,
   or bfloat16 when io_bf16 (widened on entry, rounded on the way out, the math in float32); nb is 8, 16, 32 or
   64, k_pad the padded rows per block (a multiple of 2 for bfloat16 weights). Returns -1 for an unsupported nb,
   -2 when scratch memory ran out. */
int blocked_matmul(const void *x_in, int64_t m_total, int64_t k, const void *weight, int bf16, int64_t nb,
                   int64_t k_pad, int64_t n, const float *bias, void *out_any, int num_threads, int io_bf16) {
    const block_fn fn = nb == 64 ? block_64 : nb == 32 ? block_32 : nb == 16 ? block_16 : nb == 8 ? block_8 : NULL;
    if (!fn) return -1;
    float *widened = NULL;
    const float *x = x_in;
    if (io_bf16) {
        widened = malloc((size_t)(m_total * k) * sizeof(float));
        if (!widened) return -2;
        for (int64_t i = 0; i < m_total * k; i++) widened[i] = bf16_to_f32(((const uint16_t *)x_in)[i]);
        x = widened;
    }
    const int64_t blocks = (n + nb - 1) / nb, block_bytes = k_pad * nb * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[MAX_ROWS * 64];
        const int64_t n0 = b * nb, width = n0 + nb <= n ? nb : n - n0;
        for (int64_t m0 = 0; m0 < m_total; m0 += MAX_ROWS) {
            const int64_t rows = m_total - m0 < MAX_ROWS ? m_total - m0 : MAX_ROWS;
            block_product(x + m0 * k, rows, k, (const char *)weight + b * block_bytes, bf16, nb, fn, acc);
            for (int64_t m = 0; m < rows; m++)
                for (int64_t i = 0; i < width; i++) {
                    const float y = acc[m * nb + i] + (bias ? bias[n0 + i] : 0.f);
                    if (io_bf16) ((uint16_t *)out_any)[(m0 + m) * n + n0 + i] = f32_to_bf16(y);
                    else ((float *)out_any)[(m0 + m) * n + n0 + i] = y;
                }
        }
    }
    free(widened);
    return 0;
}

STRATA_ABI_EXPORT(blocked_matmul)
