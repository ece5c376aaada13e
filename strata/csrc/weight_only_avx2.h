/* AVX2 small-batch kernel for int4 weights (included by weight_only.c on AVX2 CPUs without AVX-512, after
   load_block): four weight rows per pass, so each block of x is loaded once for four rows, and within a group each
   row's sums of q * x run unscaled in two chains of their own and meet the group's scale once. A 16-layer step's
   int4 weights (2 Zen 3 cores): 13.7-14.4 ms with the one-row kernel, 13.0-13.2 with this one. int8 weights stay on
   the one-row kernel, which read them faster (15.2 against 21.6-24.6 ms): four interleaved streams of 1 KB rows
   cost more than the shared x loads save. */
#ifndef STRATA_WEIGHT_ONLY_AVX2_H
#define STRATA_WEIGHT_ONLY_AVX2_H
#include <immintrin.h>

#define FOUR 4
#define FOUR_ROWS_MAX_M 1 /* more rows of x share each weight conversion in the one-row kernels */

/* Full blocks of rows n .. n + 3 against one row of x: y[r] = sum over groups of scale * (q . x), without the
   zero-point term. */
static void four_rows_int4(const weights_t *w, int64_t n, const float *x, float y[FOUR]) {
    const int64_t full = w->k / BLOCK, per_group = w->group_size / BLOCK, block_bytes = BLOCK / 2;
    const uint8_t *rows[FOUR];
    const float *scales[FOUR];
    for (int r = 0; r < FOUR; r++)
        rows[r] = w->data + (n + r) * w->row_bytes, scales[r] = w->scales + (n + r) * w->groups;
    __m256 total[FOUR];
    for (int r = 0; r < FOUR; r++) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; b < full; g++) {
        const int64_t end = (g + 1) * per_group < full ? (g + 1) * per_group : full;
        __m256 acc[FOUR][2];
        for (int r = 0; r < FOUR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (; b < end; b++) {
            if (b * block_bytes % 64 == 0)
                for (int r = 0; r < FOUR; r++) prefetch_ahead(rows[r] + b * block_bytes, 64);
            const float *xb = x + b * BLOCK;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            for (int r = 0; r < FOUR; r++) {
                __m256 v[4];
                load_block(KIND_INT4, rows[r], b, v);
                acc[r][0] = _mm256_fmadd_ps(v[0], x0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(v[1], x1, acc[r][1]);
                acc[r][0] = _mm256_fmadd_ps(v[2], x2, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(v[3], x3, acc[r][1]);
            }
        }
        for (int r = 0; r < FOUR; r++)
            total[r] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_broadcast_ss(scales[r] + g),
                                       total[r]);
    }
    for (int r = 0; r < FOUR; r++) y[r] = hsum(total[r]);
}

/* Rows n0 .. n1 of an int4 weight against every row of x, four weight rows at a time (the rest one by one). */
static void rows_times_x_avx2(const weights_t *w, int64_t n0, int64_t n1, const float *x, int64_t m_total,
                              const float *xsum, const float *bias, float *out) {
    for (int64_t m = 0; m < m_total; m++) {
        const float *xm = x + m * w->k, *xsum_m = xsum + m * w->groups;
        int64_t n = n0;
        for (; n + FOUR <= n1; n += FOUR) {
            float y[FOUR];
            four_rows_int4(w, n, xm, y);
            for (int r = 0; r < FOUR; r++)
                out[m * w->n + n + r] = y[r] - zero_term(w, n + r, xsum_m) + row_tail(w, n + r, xm) +
                                        (bias ? bias[n + r] : 0.f);
        }
        if (n < n1) rows_times_x(w, n, n1, xm, 1, xsum_m, bias, out + m * w->n);
    }
}

#endif
