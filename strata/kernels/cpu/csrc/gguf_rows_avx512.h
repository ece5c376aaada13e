/* AVX-512 products of GGUF block weights by 1-12 rows of x in one pass over each weight row (included by
   gguf_matmul.h): a 32-value run widened once into two 16-float registers (4-bit kinds by table lookup), then one
   FMA per register and row of x.
   A verification step of speculative decoding (k + 1 rows) so widens each run once, where the 8-, 4- and 1-row
   passes of the AVX2 kernel widened it two or three times; past a few rows the FMAs bound the step. */
#ifndef STRATA_GGUF_ROWS_AVX512_H
#define STRATA_GGUF_ROWS_AVX512_H
#include <immintrin.h>

#define GGUF_WIDE_ROWS 12 /* rows of x one pass takes: two weight rows' sums for 12 fill the 32 registers */

static inline __m512 widen16_512(__m128i q, const int SIGNED, float scale, float offset) {
    const __m512i wide = SIGNED ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale), _mm512_set1_ps(offset));
}

/* Run j of a Q4_0, Q4_1 or Q4_K block as two registers of 16 floats by lookup: the 16 values its nibbles stand for,
   fma(q, scale, offset) as widen16_512 computes them, fill one register, and vpermps reads the low 4 bits of a lane
   as the index, so a lane holding a whole byte gives its low nibble's value and, shifted by 4, its high one's. Four
   to six vector ops a run where widening took eight or more: at 2 rows of x on two Xeon cores SmolLM2's Q4_1 file
   decodes 190-204 -> 250-254 tokens/s (the float kernel now beats the fixed-point one there), at 9 rows 2-11% more. */
static inline __attribute__((always_inline)) void nibble_run512(const int KIND, const uint8_t *block, int j,
                                                               __m512 v[2]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const float d = half_at(block);
    __m512 values;
    __m512i lanes[2];
    if (KIND == KIND_Q4_K) { /* run j: the low (even j) or high nibbles of 32 bytes */
        int sc, mn;
        k_scale_min(block + 4, j, &sc, &mn);
        const float scale = d * (float)sc, offset = -(half_at(block + 2) * (float)mn);
        values = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
        const uint8_t *qs = block + 16 + 32 * (j / 2);
        for (int i = 0; i < 2; i++) {
            lanes[i] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i)));
            if (j & 1) lanes[i] = _mm512_srli_epi32(lanes[i], 4);
        }
    } else { /* Q4_0, Q4_1: values 0-15 in the low nibbles of 16 bytes, 16-31 in the high ones */
        const int with_min = KIND == KIND_Q4_1;
        values = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(with_min ? half_at(block + 2) : -8.f * d));
        lanes[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + (with_min ? 4 : 2))));
        lanes[1] = _mm512_srli_epi32(lanes[0], 4);
    }
    for (int i = 0; i < 2; i++) v[i] = _mm512_permutexvar_ps(lanes[i], values);
}

/* Weight rows n and n + 1 (`pair`; else n alone) against MC rows of x (stride k): y[r * MC + m] = weight row n + r
   dotted with x row m. Two weight rows share each load of x: past 8 rows the x of the wider matrices no longer fits
   in L1, and one load per FMA would bound the kernel (Zen 4, SmolLM2's Q4_1 weights: 13 rows in one pass of
   single weight rows cost 1.37x 12 rows in pairs). Up to 4 rows keep two chains of sums per weight row and row
   of x (one FMA's latency would otherwise hold the next). */
static inline __attribute__((always_inline)) void gguf_rows512(const weights_t *w, int64_t n, const float *x,
                                                              const int KIND, const int MC, const int PAIR,
                                                              float *y) {
    const int64_t per_block = gguf_block_values(KIND), bytes = gguf_block_bytes(KIND), blocks = w->k / per_block;
    const int64_t k = w->k;
    const int chains = MC <= 4 ? 2 : 1;
    const uint8_t *rows[2] = {w->data + n * w->row_bytes, w->data + (n + PAIR) * w->row_bytes};
    __m512 total[2][GGUF_WIDE_ROWS][2];
    for (int r = 0; r <= PAIR; r++)
        for (int m = 0; m < MC; m++) total[r][m][0] = total[r][m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int r = 0; r <= PAIR; r++) prefetch_blocks(rows[r], b, bytes);
        for (int j = 0; j < per_block / 32; j++) {
            __m512 v[2][2];
            for (int r = 0; r <= PAIR; r++) {
                if (KIND == KIND_Q4_0 || KIND == KIND_Q4_1 || KIND == KIND_Q4_K) {
                    nibble_run512(KIND, rows[r] + b * bytes, j, v[r]);
                    continue;
                }
                __m128i q[2];
                float scale[2], offset[2];
                gguf_run_bytes(KIND, rows[r] + b * bytes, j, q, scale, offset);
                for (int i = 0; i < 2; i++) v[r][i] = widen16_512(q[i], KIND == KIND_Q8_0, scale[i], offset[i]);
            }
            const float *xb = x + b * per_block + 32 * j;
            for (int m = 0; m < MC; m++) {
                const __m512 lo = _mm512_loadu_ps(xb + m * k), hi = _mm512_loadu_ps(xb + m * k + 16);
                for (int r = 0; r <= PAIR; r++) {
                    total[r][m][0] = _mm512_fmadd_ps(v[r][0], lo, total[r][m][0]);
                    total[r][m][chains - 1] = _mm512_fmadd_ps(v[r][1], hi, total[r][m][chains - 1]);
                }
            }
        }
    }
    for (int r = 0; r <= PAIR; r++)
        for (int m = 0; m < MC; m++)
            y[r * MC + m] = _mm512_reduce_add_ps(chains == 2 ? _mm512_add_ps(total[r][m][0], total[r][m][1])
                                                             : total[r][m][0]);
}

typedef void (*gguf_rows512_fn)(const weights_t *, int64_t, const float *, float *);
#define DEFINE_ROWS512(KIND, MC)                                                                       \
    static void gguf_rows512_##KIND##_##MC(const weights_t *w, int64_t n, const float *x, float *y) {    \
        gguf_rows512(w, n, x, KIND, MC, 0, y);                                                         \
    }                                                                                                  \
    static void gguf_pairs512_##KIND##_##MC(const weights_t *w, int64_t n, const float *x, float *y) {   \
        gguf_rows512(w, n, x, KIND, MC, 1, y);                                                         \
    }
#define DEFINE_ROWS512_ALL(KIND)                                                                       \
    DEFINE_ROWS512(KIND, 1) DEFINE_ROWS512(KIND, 2) DEFINE_ROWS512(KIND, 3) DEFINE_ROWS512(KIND, 4)     \
    DEFINE_ROWS512(KIND, 5) DEFINE_ROWS512(KIND, 6) DEFINE_ROWS512(KIND, 7) DEFINE_ROWS512(KIND, 8)     \
    DEFINE_ROWS512(KIND, 9) DEFINE_ROWS512(KIND, 10) DEFINE_ROWS512(KIND, 11) DEFINE_ROWS512(KIND, 12)  \
    static const gguf_rows512_fn gguf_rows512_##KIND[2][GGUF_WIDE_ROWS] = {                            \
        {gguf_rows512_##KIND##_1, gguf_rows512_##KIND##_2, gguf_rows512_##KIND##_3,                    \
         gguf_rows512_##KIND##_4, gguf_rows512_##KIND##_5, gguf_rows512_##KIND##_6,                    \
         gguf_rows512_##KIND##_7, gguf_rows512_##KIND##_8, gguf_rows512_##KIND##_9,                    \
         gguf_rows512_##KIND##_10, gguf_rows512_##KIND##_11, gguf_rows512_##KIND##_12},                \
        {gguf_pairs512_##KIND##_1, gguf_pairs512_##KIND##_2, gguf_pairs512_##KIND##_3,                 \
         gguf_pairs512_##KIND##_4, gguf_pairs512_##KIND##_5, gguf_pairs512_##KIND##_6,                 \
         gguf_pairs512_##KIND##_7, gguf_pairs512_##KIND##_8, gguf_pairs512_##KIND##_9,                 \
         gguf_pairs512_##KIND##_10, gguf_pairs512_##KIND##_11, gguf_pairs512_##KIND##_12}};
DEFINE_ROWS512_ALL(KIND_Q4_0)
DEFINE_ROWS512_ALL(KIND_Q4_1)
DEFINE_ROWS512_ALL(KIND_Q5_0)
DEFINE_ROWS512_ALL(KIND_Q5_1)
DEFINE_ROWS512_ALL(KIND_Q8_0)
DEFINE_ROWS512_ALL(KIND_Q4_K)
DEFINE_ROWS512_ALL(KIND_Q5_K)
DEFINE_ROWS512_ALL(KIND_Q6_K)

/* The kernels of a GGUF kind: [pair][rows of x - 1]. */
static const gguf_rows512_fn *gguf_rows512_kernels(int kind, int pair) {
    switch (kind) {
    case KIND_Q4_0: return gguf_rows512_KIND_Q4_0[pair];
    case KIND_Q4_1: return gguf_rows512_KIND_Q4_1[pair];
    case KIND_Q5_0: return gguf_rows512_KIND_Q5_0[pair];
    case KIND_Q5_1: return gguf_rows512_KIND_Q5_1[pair];
    case KIND_Q8_0: return gguf_rows512_KIND_Q8_0[pair];
    case KIND_Q4_K: return gguf_rows512_KIND_Q4_K[pair];
    case KIND_Q5_K: return gguf_rows512_KIND_Q5_K[pair];
    default: return gguf_rows512_KIND_Q6_K[pair];
    }
}

/* Rows n0..n1 of a GGUF weight against every row of x, weight rows two at a time (a task's last odd one alone), x in
   as few passes of at most GGUF_WIDE_ROWS rows as it takes, evenly split (16 rows: two of 8). */
static void gguf_rows_times_x512(const weights_t *w, int64_t n0, int64_t n1, const float *x, int64_t m_total,
                                 const float *bias, float *out) {
    const int64_t passes = (m_total + GGUF_WIDE_ROWS - 1) / GGUF_WIDE_ROWS;
    for (int64_t m0 = 0, p = 0; p < passes; p++) {
        const int mc = (int)((m_total - m0) / (passes - p));
        const gguf_rows512_fn single = gguf_rows512_kernels(w->kind, 0)[mc - 1];
        const gguf_rows512_fn pair = gguf_rows512_kernels(w->kind, 1)[mc - 1];
        for (int64_t n = n0; n < n1;) {
            const int two = n + 1 < n1;
            float y[2 * GGUF_WIDE_ROWS];
            (two ? pair : single)(w, n, x + m0 * w->k, y);
            for (int r = 0; r <= two; r++, n++)
                for (int m = 0; m < mc; m++) out[(m0 + m) * w->n + n] = y[r * mc + m] + (bias ? bias[n] : 0.f);
        }
        m0 += mc;
    }
}

#endif
