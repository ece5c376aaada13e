/* AVX-512 VNNI dot products of GGUF weight rows with x rounded to Q8_0 / Q8_K (gguf_q8.h, which includes this): the
   weights' unsigned q (Q8_0's: their magnitudes, x's sign flipped where they are negative) times x's signed q by
   vpdpbusd, 64 values a register laid out in x's own order, each int32 lane belonging to one block (legacy kinds:
   two blocks a register) or one sub-block (K-quants: their scales applied to the lanes in int32); one float
   multiply-add per register applies the blocks' d. Offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32) come off the
   integer sums through x's per-lane sums; mins (Q4_1 / Q5_1's m * s, the K-quants' dmin * mn * bsums) in float once
   a block. Only 512-bit forms (no AVX-512 VL), as the forced `avx512_vnni` test build compiles. */
#ifndef STRATA_GGUF_Q8_VNNI_H
#define STRATA_GGUF_Q8_VNNI_H
#include <immintrin.h>

/* Two blocks' 32 4-bit values each (16 bytes of nibbles at a and b) as 64 bytes in value order. */
static inline __m512i q8v_nibbles2(const uint8_t *a, const uint8_t *b) {
    const __m256i ab = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)b), _mm_loadu_si128((const __m128i *)a));
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(ab, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(ab, 4), nibble);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* a_lo, b_lo, a_hi, b_hi */
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

/* Blocks b and b + 1 of a legacy kind (at `block`) against x: acc + their d * x's d times the exact int32 sums. */
static inline __attribute__((always_inline)) __m512 q8v_legacy_pair(const int KIND, const uint8_t *block, int64_t b,
                                                                   const q8_x_t *x, __m512 acc, float *mins) {
    const int64_t bytes = gguf_block_bytes(KIND);
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    const uint8_t *next = block + bytes;
    const __m512i xq = _mm512_loadu_si512((const void *)(x->q + 32 * b)), zero = _mm512_setzero_si512();
    __m512i dot;
    if (KIND == KIND_Q8_0) {
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(block + 2))),
                                             _mm256_loadu_si256((const __m256i *)(next + 2)), 1);
        const __m512i signed_x = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(w), zero, xq);
        dot = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w), signed_x);
    } else {
        const int64_t qs = (with_min ? 4 : 2) + (five ? 4 : 0);
        __m512i w = q8v_nibbles2(block + qs, next + qs);
        if (five) {
            uint32_t qa, qb;
            memcpy(&qa, block + qs - 4, sizeof qa);
            memcpy(&qb, next + qs - 4, sizeof qb);
            w = _mm512_mask_add_epi8(w, (__mmask64)qa | (__mmask64)qb << 32, w, _mm512_set1_epi8(16));
        }
        dot = _mm512_dpbusd_epi32(zero, w, xq);
        if (!with_min) /* Q4_0 / Q5_0: q - 8 / q - 16, exactly */
            dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->lanes + 8 * b)),
                                                          five ? 4 : 3));
    }
    if (with_min) *mins += half_at(block + 2) * x->s[b] + half_at(next + 2) * x->s[b + 1];
    const __m512 scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half_at(block) * x->d[b]),
                                              _mm512_set1_ps(half_at(next) * x->d[b + 1]));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}

static inline __attribute__((always_inline)) float q8v_legacy_row(const int KIND, const uint8_t *row, int64_t blocks,
                                                                  const q8_x_t *x) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains */
    float mins = 0.f;
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) {
        prefetch_ahead(row + b * bytes, 4 * bytes);
        even = q8v_legacy_pair(KIND, row + b * bytes, b, x, even, &mins);
        odd = q8v_legacy_pair(KIND, row + (b + 2) * bytes, b + 2, x, odd, &mins);
    }
    for (; b + 2 <= blocks; b += 2) even = q8v_legacy_pair(KIND, row + b * bytes, b, x, even, &mins);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) + mins;
    for (; b < blocks; b++) sum += q8_block_portable(KIND, row + b * bytes, b, x);
    return sum;
}

/* One Q4_K / Q5_K block against x's Q8_K block b: 32 bytes of qs hold sub-blocks 2i (low nibbles) and 2i + 1 (high),
   one register of 64 values in order; lanes 0-7 take scale 2i, 8-15 scale 2i + 1, in int32. */
static inline __attribute__((always_inline)) __m512 q8v_q45k_block(const int KIND, const uint8_t *block, int64_t b,
                                                                  const q8_x_t *x, __m512 acc, float *mins) {
    const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16);
    const int8_t *xq = x->q + QK_K * b;
    const int32_t *s16 = x->sum16 + QK_K / 16 * b;
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m512i zero = _mm512_setzero_si512();
    __m512i total = zero;
    int32_t summ = 0;
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        int sc[2], mn[2];
        k_scale_min(block + 4, 2 * i, sc, mn);
        k_scale_min(block + 4, 2 * i + 1, sc + 1, mn + 1);
        summ += mn[0] * (s16[4 * i] + s16[4 * i + 1]) + mn[1] * (s16[4 * i + 2] + s16[4 * i + 3]);
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                       _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), 1);
        if (KIND == KIND_Q5_K) { /* bit 2i (first 32 values) or 2i + 1 (second 32) of qh[l] is value l's fifth bit */
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16)));
            const __m512i select = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * i))),
                                                      _mm256_set1_epi8((char)(1 << (2 * i + 1))), 1);
            w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, select), w, _mm512_set1_epi8(16));
        }
        const __m512i dot = _mm512_dpbusd_epi32(zero, w, _mm512_loadu_si512((const void *)(xq + 64 * i)));
        const __m512i scales = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(sc[0]), _mm512_set1_epi32(sc[1]));
        total = _mm512_add_epi32(total, _mm512_mullo_epi32(dot, scales));
    }
    *mins += x->d[b] * half_at(block + 2) * (float)summ;
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(x->d[b] * half_at(block)), acc);
}

/* One Q6_K block against x's Q8_K block b: 64 bytes of ql hold 64 values of a half in their low nibbles and the
   next 64 in their high ones, with two bits of qh each; each 4 lanes are one 16-value sub-block, whose int8 scale
   applies in int32 after the -32 offset came off through x's lane sums. */
static inline __attribute__((always_inline)) __m512 q8v_q6k_block(const uint8_t *block, int64_t b, const q8_x_t *x,
                                                                 __m512 acc) {
    const __m512i nibble = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3), zero = _mm512_setzero_si512();
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)));
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shift01 = _mm512_inserti64x4(zero, _mm256_set1_epi16(2), 1);
    const __m512i shift23 = _mm512_add_epi16(shift01, _mm512_set1_epi16(4));
    __m512i total = zero;
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift01), two), 4)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift23), two), 4))};
        for (int r = 0; r < 2; r++) {
            const int64_t at = QK_K * b + 128 * h + 64 * r;
            __m512i dot = _mm512_dpbusd_epi32(zero, q[r], _mm512_loadu_si512((const void *)(x->q + at)));
            dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->lanes + at / 4)), 5));
            const __m512i index = _mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h + 4 * r));
            total = _mm512_add_epi32(total, _mm512_mullo_epi32(dot, _mm512_permutexvar_epi32(index, scales)));
        }
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(half_at(block + 208) * x->d[b]), acc);
}

static inline __attribute__((always_inline)) float q8v_kquant_row(const int KIND, const uint8_t *row, int64_t blocks,
                                                                  const q8_x_t *x) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    float mins = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * bytes;
        prefetch_ahead(block, bytes);
        __m512 *acc = b & 1 ? &odd : &even;
        *acc = KIND == KIND_Q6_K ? q8v_q6k_block(block, b, x, *acc) : q8v_q45k_block(KIND, block, b, x, *acc, &mins);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) - mins;
}

static float q8_row_vnni(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x) {
    switch (kind) { /* constant kinds, so each kernel inlines */
    case KIND_Q4_0: return q8v_legacy_row(KIND_Q4_0, row, blocks, x);
    case KIND_Q4_1: return q8v_legacy_row(KIND_Q4_1, row, blocks, x);
    case KIND_Q5_0: return q8v_legacy_row(KIND_Q5_0, row, blocks, x);
    case KIND_Q5_1: return q8v_legacy_row(KIND_Q5_1, row, blocks, x);
    case KIND_Q8_0: return q8v_legacy_row(KIND_Q8_0, row, blocks, x);
    case KIND_Q4_K: return q8v_kquant_row(KIND_Q4_K, row, blocks, x);
    case KIND_Q5_K: return q8v_kquant_row(KIND_Q5_K, row, blocks, x);
    default: return q8v_kquant_row(KIND_Q6_K, row, blocks, x);
    }
}

#include "gguf_q8_vnni_rows.h"

/* One weight row against `count` rows of x (1, 2, 4 or Q8V_ROWS): y[r]. */
static void q8_rows_vnni(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x, int count, float *y) {
    if (count == 1) {
        y[0] = q8_row_vnni(kind, row, blocks, x);
        return;
    }
#define Q8V_KIND(KIND)                                                                                              \
    case KIND:                                                                                                      \
        if (count == Q8V_ROWS) q8v_rows(KIND, Q8V_ROWS, row, blocks, x, y);                                        \
        else if (count == 4) q8v_rows(KIND, 4, row, blocks, x, y);                                                 \
        else q8v_rows(KIND, 2, row, blocks, x, y);                                                                 \
        return;
    switch (kind) { /* constant kinds and row counts, so each kernel inlines */
    Q8V_KIND(KIND_Q4_0) Q8V_KIND(KIND_Q4_1) Q8V_KIND(KIND_Q5_0) Q8V_KIND(KIND_Q5_1) Q8V_KIND(KIND_Q8_0)
    Q8V_KIND(KIND_Q4_K) Q8V_KIND(KIND_Q5_K) Q8V_KIND(KIND_Q6_K)
    default: return;
    }
#undef Q8V_KIND
}

#endif
