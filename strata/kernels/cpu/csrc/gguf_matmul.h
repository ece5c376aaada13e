/* Small-batch products of GGUF block weights (included by weight_only.c after its dense kernels): each weight row
   read once for every row of x, its 32-value runs dequantized in registers (gguf_blocks.h) and multiplied in float,
   as `x @ dequantized.T` is (AVX-512: gguf_rows_avx512.h); on AVX2 CPUs the fewest rows of x take the fixed-point
   kernels of gguf_dot_avx2.h instead, up to a count measured per kind (Q8_0, whose float kernel already reads at
   memory speed, excepted). */
#ifndef STRATA_GGUF_MATMUL_H
#define STRATA_GGUF_MATMUL_H

#include "gguf_blocks.h"
#if STRATA_AVX2
#include "gguf_dot_avx2.h"
#endif

/* Prefetch each cache line of a row's blocks once, when block b (of `bytes`) is the first to reach into it. */
static inline void prefetch_blocks(const uint8_t *row, int64_t b, int64_t bytes) {
    const int64_t start = b * bytes, end = start + bytes;
    for (int64_t line = (start + 63) / 64 * 64; line < end; line += 64)
        __builtin_prefetch(row + line + PREFETCH_BYTES, 0, 3);
}

/* Rows of x per pass over a weight row of the AVX2 kernel: 8 lets a verification step of speculative decoding
   (k + 1 rows) dequantize each run once for 8 rows (1-row passes: 8 dequantizations; 4-row passes: 2). */
#define GGUF_MAX_MC 8

#if STRATA_AVX512BW
#include "gguf_rows_avx512.h"
#elif STRATA_AVX2
/* Row n of the weight against MC rows of x (stride k): y[m] = the row's dot product with x row m. One row of x
   keeps four chains of sums (a run's four FMAs would otherwise wait on each other), 2-4 rows two each, 8 rows one
   (the registers hold no more). */
static inline __attribute__((always_inline)) void gguf_row(const weights_t *w, int64_t n, const float *x,
                                                          const int KIND, const int MC, float *y) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const int64_t per_block = gguf_block_values(KIND), bytes = gguf_block_bytes(KIND), blocks = w->k / per_block;
    const int chains = MC == 1 ? 4 : MC >= 8 ? 1 : 2;
    __m256 total[GGUF_MAX_MC][4];
    for (int m = 0; m < MC; m++)
        for (int c = 0; c < chains; c++) total[m][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * bytes;
        prefetch_blocks(row, b, bytes);
        for (int j = 0; j < per_block / 32; j++) {
            __m256 v[4];
            gguf_run(KIND, block, j, v);
            const float *xb = x + b * per_block + 32 * j;
            for (int m = 0; m < MC; m++)
                for (int r = 0; r < 4; r++)
                    total[m][r % chains] = _mm256_fmadd_ps(v[r], _mm256_loadu_ps(xb + m * w->k + 8 * r),
                                                           total[m][r % chains]);
        }
    }
    for (int m = 0; m < MC; m++) {
        __m256 sum = chains == 1 ? total[m][0] : _mm256_add_ps(total[m][0], total[m][1]);
        if (chains == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(total[m][2], total[m][3]));
        y[m] = hsum(sum);
    }
}

typedef void (*gguf_row_fn)(const weights_t *, int64_t, const float *, float *);
#define DEFINE_GGUF_ROW(KIND, MC)                                                           \
    static void gguf_row_##KIND##_##MC(const weights_t *w, int64_t n, const float *x, float *y) { \
        gguf_row(w, n, x, KIND, MC, y);                                                     \
    }
#define DEFINE_GGUF_ROWS(KIND) \
    DEFINE_GGUF_ROW(KIND, 1) DEFINE_GGUF_ROW(KIND, 2) DEFINE_GGUF_ROW(KIND, 4) DEFINE_GGUF_ROW(KIND, 8)
DEFINE_GGUF_ROWS(KIND_Q4_0)
DEFINE_GGUF_ROWS(KIND_Q4_1)
DEFINE_GGUF_ROWS(KIND_Q5_0)
DEFINE_GGUF_ROWS(KIND_Q5_1)
DEFINE_GGUF_ROWS(KIND_Q8_0)
DEFINE_GGUF_ROWS(KIND_Q4_K)
DEFINE_GGUF_ROWS(KIND_Q5_K)
DEFINE_GGUF_ROWS(KIND_Q6_K)
#define GGUF_ROWS_OF(KIND, MC) ((MC) == 8 ? gguf_row_##KIND##_8 : (MC) == 4 ? gguf_row_##KIND##_4 \
                                : (MC) == 2 ? gguf_row_##KIND##_2 : gguf_row_##KIND##_1)

/* The kernel for a GGUF kind and a chunk of 1, 2, 4 or 8 rows of x, each specialised at compile time. */
static gguf_row_fn gguf_row_kernel(int kind, int mc) {
    switch (kind) {
    case KIND_Q4_0: return GGUF_ROWS_OF(KIND_Q4_0, mc);
    case KIND_Q4_1: return GGUF_ROWS_OF(KIND_Q4_1, mc);
    case KIND_Q5_0: return GGUF_ROWS_OF(KIND_Q5_0, mc);
    case KIND_Q5_1: return GGUF_ROWS_OF(KIND_Q5_1, mc);
    case KIND_Q8_0: return GGUF_ROWS_OF(KIND_Q8_0, mc);
    case KIND_Q4_K: return GGUF_ROWS_OF(KIND_Q4_K, mc);
    case KIND_Q5_K: return GGUF_ROWS_OF(KIND_Q5_K, mc);
    default: return GGUF_ROWS_OF(KIND_Q6_K, mc);
    }
}
#else
/* Portable: each 32-value run dequantized into floats, then multiplied by MC rows of x. */
static void gguf_row_portable(const weights_t *w, int64_t n, const float *x, int mc, float *y) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const int64_t per_block = gguf_block_values(w->kind), bytes = gguf_block_bytes(w->kind);
    for (int m = 0; m < mc; m++) y[m] = 0.f;
    for (int64_t k0 = 0; k0 < w->k; k0 += 32) {
        float v[32];
        gguf_run_floats(w->kind, row + k0 / per_block * bytes, (int)(k0 % per_block / 32), v);
        for (int m = 0; m < mc; m++) {
            float acc = 0.f;
            for (int l = 0; l < 32; l++) acc += v[l] * x[m * w->k + k0 + l];
            y[m] += acc;
        }
    }
}
#endif

/* Rows n0..n1 of a GGUF weight against every row of x, up to GGUF_MAX_MC rows of x per pass over a weight row
   (8 on AVX2 CPUs; the portable kernel takes 4; AVX-512: 12, gguf_rows_avx512.h). */
static void gguf_rows_times_x(const weights_t *w, int64_t n0, int64_t n1, const float *x, int64_t m_total,
                              const float *bias, float *out) {
#if STRATA_AVX512BW
    gguf_rows_times_x512(w, n0, n1, x, m_total, bias, out);
#else
    for (int64_t m0 = 0; m0 < m_total;) {
        const int64_t left = m_total - m0;
        const int mc = left >= 8 && STRATA_AVX2 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
#if STRATA_AVX2
        const gguf_row_fn kernel = gguf_row_kernel(w->kind, mc);
#endif
        for (int64_t n = n0; n < n1; n++) {
            float y[GGUF_MAX_MC];
#if STRATA_AVX2
            kernel(w, n, x + m0 * w->k, y);
#else
            gguf_row_portable(w, n, x + m0 * w->k, mc, y);
#endif
            for (int m = 0; m < mc; m++) out[(m0 + m) * w->n + n] = y[m] + (bias ? bias[n] : 0.f);
        }
        m0 += mc;
    }
#endif
}

/* out[m_total, n] = x times a GGUF block weight's transpose (+ bias); the rows of the weight shared among the
   threads. Returns 0, or -1 when scratch memory ran out. */
static int gguf_matmul(const weights_t *w, const float *x, int64_t m_total, const float *bias, float *out,
                       int num_threads) {
#if STRATA_AVX2
    if (m_total >= 1 && m_total <= gguf_fixed_point_rows(w->kind))
        return gguf_matmul_fixed_point(w, x, m_total, bias, out, num_threads);
#endif
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* A small weight is read faster by one thread than the fork of a second costs. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        gguf_rows_times_x(w, n0, n1, x, m_total, bias, out);
    }
    return 0;
}

#endif
