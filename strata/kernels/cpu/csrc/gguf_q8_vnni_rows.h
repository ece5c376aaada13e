/* AVX-512 VNNI products of one GGUF weight row with several rows of x rounded to Q8_0 / Q8_K (2, 4 or Q8V_ROWS at a
   time; gguf_q8_vnni.h has the one-row kernels): each 64 weight values are made once and meet every row of x, four
   vector instructions a row and 64 values. Weights that are signed (Q4_0's q - 8, Q5_0's q - 16, Q8_0, Q6_K's q - 32)
   meet x + 128 as vpdpbusd's unsigned operand, its sums starting from -128 times the weights' own per-lane sums, so
   that no offset depends on x; unsigned ones (Q4_1, Q5_1, Q4_K, Q5_K) meet x's signed q. Each lane's exact int32
   sum takes its scale in float: the weight's d times x's d per lane (legacy kinds), or the sub-block's d * scale and
   then x's d once a block (K-quants); mins through x's s per lane or its sums per 16 times d. Included by
   gguf_q8_vnni.h. */
#ifndef STRATA_GGUF_Q8_VNNI_ROWS_H
#define STRATA_GGUF_Q8_VNNI_ROWS_H
#include <immintrin.h>

#define Q8V_ROWS 8 /* rows of x one pass over a weight row serves (two float sums each stay in registers) */

/* -128 times each lane's sum of 4 signed weights: where x + 128 meets them, the sum starts here to be x's alone. */
static inline __m512i q8v_start(__m512i signed_w) {
    const __m512i zero = _mm512_setzero_si512();
    return _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)0x80), signed_w));
}

/* Blocks b and b + 1 of a legacy kind against MC rows of x: acc[r] + the exact sums times both d's (+ mins). */
static inline __attribute__((always_inline)) void q8v_legacy_pair_rows(const int KIND, const int MC,
                                                                       const uint8_t *block, int64_t b,
                                                                       const q8_x_t *x, __m512 *acc) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    const uint8_t *next = block + gguf_block_bytes(KIND);
    const __m512i zero = _mm512_setzero_si512();
    __m512i w;
    if (KIND == KIND_Q8_0) {
        w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(block + 2))),
                               _mm256_loadu_si256((const __m256i *)(next + 2)), 1);
    } else {
        const int64_t qs = (with_min ? 4 : 2) + (five ? 4 : 0);
        w = q8v_nibbles2(block + qs, next + qs);
        if (five) {
            uint32_t qa, qb;
            memcpy(&qa, block + qs - 4, sizeof qa);
            memcpy(&qb, next + qs - 4, sizeof qb);
            w = _mm512_mask_add_epi8(w, (__mmask64)qa | (__mmask64)qb << 32, w, _mm512_set1_epi8(16));
        }
        if (!with_min) w = _mm512_sub_epi8(w, _mm512_set1_epi8(five ? 16 : 8));
    }
    const __m512i start = with_min ? zero : q8v_start(w);
    const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half_at(block)), _mm512_set1_ps(half_at(next)));
    const __m512 m = with_min ? _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half_at(block + 2)),
                                                     _mm512_set1_ps(half_at(next + 2)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < MC; r++) {
        const __m512i dot =
            with_min ? _mm512_dpbusd_epi32(zero, w, _mm512_loadu_si512((const void *)(x[r].q + 32 * b)))
                     : _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)(x[r].uq + 32 * b)), w);
        const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(x[r].d_lanes + 8 * b));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        if (with_min) acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x[r].s_lanes + 8 * b), acc[r]);
    }
}

/* One Q4_K / Q5_K block against MC rows of x's Q8_K block b (the one-row kernel's register layout): each 64 values'
   sums times their two sub-blocks' d * scale into inner[r], x's d applied once; the mins through x's sums per 16. */
static inline __attribute__((always_inline)) void q8v_q45k_rows(const int KIND, const int MC, const uint8_t *block,
                                                                int64_t b, const q8_x_t *x, __m512 *acc) {
    const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16);
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m512i zero = _mm512_setzero_si512();
    const __m512 scales_mins = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(q8_k_scales_mins(block + 4)));
    const __m512 scales = _mm512_mul_ps(scales_mins, _mm512_set1_ps(half_at(block)));
    const __m512 mins = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
                                              _mm512_mul_ps(scales_mins, _mm512_set1_ps(-half_at(block + 2))));
    __m512 inner[Q8V_ROWS];
    for (int r = 0; r < MC; r++) inner[r] = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                       _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), 1);
        if (KIND == KIND_Q5_K) {
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16)));
            const __m512i select = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * i))),
                                                      _mm256_set1_epi8((char)(1 << (2 * i + 1))), 1);
            w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, select), w, _mm512_set1_epi8(16));
        }
        const __m512 scale = _mm512_permutexvar_ps(
            _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * i), _mm512_set1_epi32(2 * i + 1)), scales);
        for (int r = 0; r < MC; r++) {
            const __m512i xq = _mm512_loadu_si512((const void *)(x[r].q + QK_K * b + 64 * i));
            inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, xq)), scale, inner[r]);
        }
    }
    for (int r = 0; r < MC; r++) {
        acc[r] = _mm512_fmadd_ps(inner[r], _mm512_set1_ps(x[r].d[b]), acc[r]);
        acc[r] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(x[r].sum16_d + QK_K / 16 * b), acc[r]);
    }
}

/* One Q6_K block against MC rows of x's Q8_K block b (the one-row kernel's layout): q - 32 signed against x + 128,
   each 4 lanes one 16-value sub-block whose d * scale applies in float. */
static inline __attribute__((always_inline)) void q8v_q6k_rows(const int MC, const uint8_t *block, int64_t b,
                                                               const q8_x_t *x, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3), zero = _mm512_setzero_si512();
    const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
                                        _mm512_set1_ps(half_at(block + 208)));
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shift01 = _mm512_inserti64x4(zero, _mm256_set1_epi16(2), 1);
    const __m512i shift23 = _mm512_add_epi16(shift01, _mm512_set1_epi16(4));
    __m512 inner[Q8V_ROWS];
    for (int r = 0; r < MC; r++) inner[r] = _mm512_setzero_ps();
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift01), two), 4)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift23), two), 4))};
        for (int half = 0; half < 2; half++) {
            const __m512i w = _mm512_sub_epi8(q[half], _mm512_set1_epi8(32)), start = q8v_start(w);
            const __m512 scale =
                _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h + 4 * half)), scales);
            const int64_t at = QK_K * b + 128 * h + 64 * half;
            for (int r = 0; r < MC; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)(x[r].uq + at)), w);
                inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, inner[r]);
            }
        }
    }
    for (int r = 0; r < MC; r++) acc[r] = _mm512_fmadd_ps(inner[r], _mm512_set1_ps(x[r].d[b]), acc[r]);
}

/* One weight row against MC rows of x: y[r]. A legacy row's odd last block goes through the portable kernel. */
static inline __attribute__((always_inline)) void q8v_rows(const int KIND, const int MC, const uint8_t *row,
                                                           int64_t blocks, const q8_x_t *x, float *y) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m512 acc[Q8V_ROWS];
    for (int r = 0; r < MC; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    if (gguf_block_values(KIND) == 32) {
        for (; b + 2 <= blocks; b += 2) {
            prefetch_ahead(row + b * bytes, 2 * bytes);
            q8v_legacy_pair_rows(KIND, MC, row + b * bytes, b, x, acc);
        }
    } else {
        for (; b < blocks; b++) {
            prefetch_ahead(row + b * bytes, bytes);
            if (KIND == KIND_Q6_K) q8v_q6k_rows(MC, row + b * bytes, b, x, acc);
            else q8v_q45k_rows(KIND, MC, row + b * bytes, b, x, acc);
        }
    }
    for (int r = 0; r < MC; r++) {
        y[r] = _mm512_reduce_add_ps(acc[r]);
        if (b < blocks) y[r] += q8_block_portable(KIND, row + b * bytes, b, x + r);
    }
}

#endif
