/* AVX-512 VNNI dot products of GGUF weight rows with x rounded to Q8_0 / Q8_K (gguf_q8.h, which includes this), one
   weight row against 1, 2, 4 or Q8V_ROWS rows of x at a time: each 64 weight values are made once and meet every row,
   64 values a register in x's own order, each int32 lane belonging to one block (legacy kinds: two blocks a register)
   or one sub-block (K-quants). Weights that are signed (Q4_0's q - 8, Q5_0's q - 16, Q8_0, Q6_K's q - 32) meet
   x + 128 as vpdpbusd's unsigned operand, its sums starting from -128 times the weights' own per-lane sums, so that
   no offset depends on x; unsigned ones (Q4_1, Q5_1, Q4_K, Q5_K) meet x's signed q. Each lane's exact int32 sum
   takes its scale in float: the weight's d times x's d per lane (legacy kinds), or the sub-block's d * scale and then
   x's d once a block (K-quants); mins through x's s per lane or its sums per 16 times d. A row's arithmetic is the
   same whatever the count. Only 512-bit forms (no AVX-512 VL), as the forced `avx512_vnni` test build compiles. */
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

#define Q8V_ROWS 8 /* rows of x one pass over a weight row serves (two float sums each stay in registers) */

/* MC rounded rows of x as one base pointer each (the row's q) and the other arrays' byte offsets from it, the same for
   every row (q8_at's layout): eight rows' addresses then fit the general registers. */
typedef struct {
    const uint8_t *base[Q8V_ROWS];
    int64_t uq, d, d_lanes, s_lanes, sum16_d;
} q8v_view_t;

#define Q8V_AT(v, r, field, byte) ((v)->base[r] + (v)->field + (byte))

static inline __attribute__((always_inline)) void q8v_view(const int MC, const q8_x_t *x, q8v_view_t *v) {
    for (int r = 0; r < MC; r++) v->base[r] = (const uint8_t *)x[r].q;
    const uint8_t *q = (const uint8_t *)x[0].q;
    v->uq = x[0].uq - q, v->d = (const uint8_t *)x[0].d - q, v->d_lanes = (const uint8_t *)x[0].d_lanes - q;
    v->s_lanes = (const uint8_t *)x[0].s_lanes - q, v->sum16_d = (const uint8_t *)x[0].sum16_d - q;
}

/* -128 times each lane's sum of 4 signed weights: where x + 128 meets them, the sum starts here to be x's alone. */
static inline __m512i q8v_start(__m512i signed_w) {
    const __m512i zero = _mm512_setzero_si512();
    return _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)0x80), signed_w));
}

/* The 64 values of a legacy block pair (at block, the next block after it) in order: Q4_0's q - 8, Q5_0's q - 16 and
   Q8_0's signed; Q4_1's and Q5_1's q, unsigned. */
static inline __attribute__((always_inline)) __m512i q8v_legacy_values(const int KIND, const uint8_t *block) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    const uint8_t *next = block + gguf_block_bytes(KIND);
    if (KIND == KIND_Q8_0)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(block + 2))),
                                  _mm256_loadu_si256((const __m256i *)(next + 2)), 1);
    const int64_t qs = (with_min ? 4 : 2) + (five ? 4 : 0);
    __m512i w = q8v_nibbles2(block + qs, next + qs);
    if (five) {
        uint32_t qa, qb;
        memcpy(&qa, block + qs - 4, sizeof qa);
        memcpy(&qb, next + qs - 4, sizeof qb);
        w = _mm512_mask_add_epi8(w, (__mmask64)qa | (__mmask64)qb << 32, w, _mm512_set1_epi8(16));
    }
    return with_min ? w : _mm512_sub_epi8(w, _mm512_set1_epi8(five ? 16 : 8));
}

/* Values 64i .. 64i + 63 of a Q4_K / Q5_K block (sub-blocks 2i and 2i + 1: 32 bytes of qs, low nibbles then high),
   unsigned. */
static inline __attribute__((always_inline)) __m512i q8v_q45k_values(const int KIND, const uint8_t *block, int i) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + (KIND == KIND_Q5_K ? 48 : 16) + 32 * i));
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                   _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), 1);
    if (KIND == KIND_Q5_K) { /* bit 2i (first 32 values) or 2i + 1 (second 32) of qh[l] is value l's fifth bit */
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16)));
        const __m512i select = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * i))),
                                                  _mm256_set1_epi8((char)(1 << (2 * i + 1))), 1);
        w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, select), w, _mm512_set1_epi8(16));
    }
    return w;
}

/* Values 64i .. 64i + 63 of a Q6_K block, q - 32 (signed): half h = i / 2 keeps 64 values in the low nibbles of its
   64 bytes of ql and the next 64 in the high ones, two bits of its 32 bytes of qh each. */
static inline __attribute__((always_inline)) __m512i q8v_q6k_values(const uint8_t *block, int i) {
    const int h = i / 2, high = i % 2;
    const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
    const __m512i shift = _mm512_add_epi16(_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                                           _mm512_set1_epi16((short)(4 * high)));
    const __m512i low = _mm512_and_si512(high ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(15));
    const __m512i top = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3)), 4);
    return _mm512_sub_epi8(_mm512_or_si512(low, top), _mm512_set1_epi8(32));
}

/* Blocks b and b + 1 of a legacy kind against MC rows of x: acc[r] + the exact sums times both d's, mins[r] + the
   weight's m times x's s (Q4_1 / Q5_1). */
static inline __attribute__((always_inline)) void q8v_legacy_pair_rows(const int KIND, const int MC,
                                                                       const uint8_t *block, int64_t b,
                                                                       const q8v_view_t *x, __m512 *acc,
                                                                       __m512 *mins) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1;
    const uint8_t *next = block + gguf_block_bytes(KIND);
    const __m512i zero = _mm512_setzero_si512(), w = q8v_legacy_values(KIND, block);
    const __m512i start = with_min ? zero : q8v_start(w);
    /* both blocks' fp16 d (and m) in one conversion: halves d0 m0 d1 m1, each spread over its block's 8 lanes */
    uint32_t first, second;
    memcpy(&first, block, sizeof first);
    memcpy(&second, next, sizeof second);
    const __m512 halves = _mm512_cvtph_ps(_mm256_setr_epi32((int)first, (int)second, 0, 0, 0, 0, 0, 0));
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), halves);
    const __m512 m = with_min ? _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
                                                      halves)
                              : _mm512_setzero_ps();
    for (int r = 0; r < MC; r++) {
        const __m512i dot =
            with_min ? _mm512_dpbusd_epi32(zero, w, _mm512_loadu_si512((const void *)(x->base[r] + 32 * b)))
                     : _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)Q8V_AT(x, r, uq, 32 * b)), w);
        const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps((const float *)Q8V_AT(x, r, d_lanes, 32 * b)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        if (with_min) mins[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps((const float *)Q8V_AT(x, r, s_lanes, 32 * b)), mins[r]);
    }
}

/* One Q4_K / Q5_K block against MC rows of x's Q8_K block b (the one-row kernel's register layout): each 64 values'
   sums times their two sub-blocks' d * scale into inner[r], x's d applied once; the mins through x's sums per 16. */
static inline __attribute__((always_inline)) void q8v_q45k_rows(const int KIND, const int MC, const uint8_t *block,
                                                                int64_t b, const q8v_view_t *x, __m512 *acc) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512 scales_mins = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(q8_k_scales_mins(block + 4)));
    const __m512 scales = _mm512_mul_ps(scales_mins, _mm512_set1_ps(half_at(block)));
    const __m512 mins = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
                                              _mm512_mul_ps(scales_mins, _mm512_set1_ps(-half_at(block + 2))));
    __m512 inner[Q8V_ROWS];
    for (int r = 0; r < MC; r++) inner[r] = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i w = q8v_q45k_values(KIND, block, i);
        const __m512 scale = _mm512_permutexvar_ps(
            _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * i), _mm512_set1_epi32(2 * i + 1)), scales);
        for (int r = 0; r < MC; r++) {
            const __m512i xq = _mm512_loadu_si512((const void *)(x->base[r] + QK_K * b + 64 * i));
            inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, xq)), scale, inner[r]);
        }
    }
    for (int r = 0; r < MC; r++) {
        acc[r] = _mm512_fmadd_ps(inner[r], _mm512_set1_ps(*(const float *)Q8V_AT(x, r, d, 4 * b)), acc[r]);
        acc[r] = _mm512_fmadd_ps(mins, _mm512_loadu_ps((const float *)Q8V_AT(x, r, sum16_d, QK_K / 4 * b)), acc[r]);
    }
}

/* One Q6_K block against MC rows of x's Q8_K block b (the one-row kernel's layout): q - 32 signed against x + 128,
   each 4 lanes one 16-value sub-block whose d * scale applies in float. */
static inline __attribute__((always_inline)) void q8v_q6k_rows(const int MC, const uint8_t *block, int64_t b,
                                                               const q8v_view_t *x, __m512 *acc) {
    const __m512 scales = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
        _mm512_set1_ps(half_at(block + 208)));
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 inner[Q8V_ROWS];
    for (int r = 0; r < MC; r++) inner[r] = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i w = q8v_q6k_values(block, i), start = q8v_start(w);
        const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(4 * i)), scales);
        for (int r = 0; r < MC; r++) {
            const __m512i dot =
                _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)Q8V_AT(x, r, uq, QK_K * b + 64 * i)), w);
            inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, inner[r]);
        }
    }
    for (int r = 0; r < MC; r++)
        acc[r] = _mm512_fmadd_ps(inner[r], _mm512_set1_ps(*(const float *)Q8V_AT(x, r, d, 4 * b)), acc[r]);
}

/* One weight row against MC rows of x: y[r]. A legacy row's odd last block goes through the portable kernel. */
static inline __attribute__((always_inline)) void q8v_rows(const int KIND, const int MC, const uint8_t *row,
                                                           int64_t blocks, const q8_x_t *rows, float *y) {
    const int64_t bytes = gguf_block_bytes(KIND);
    q8v_view_t view, *x = &view;
    q8v_view(MC, rows, x);
    __m512 acc[Q8V_ROWS], mins[Q8V_ROWS]; /* mins: Q4_1 / Q5_1's, a chain of their own */
    for (int r = 0; r < MC; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    int64_t b = 0;
    if (gguf_block_values(KIND) == 32) {
        for (; b + 2 <= blocks; b += 2) {
            prefetch_ahead(row + b * bytes, 2 * bytes);
            q8v_legacy_pair_rows(KIND, MC, row + b * bytes, b, x, acc, mins);
        }
        if (KIND == KIND_Q4_1 || KIND == KIND_Q5_1)
            for (int r = 0; r < MC; r++) acc[r] = _mm512_add_ps(acc[r], mins[r]);
    } else {
        for (; b < blocks; b++) {
            prefetch_ahead(row + b * bytes, bytes);
            if (KIND == KIND_Q6_K) q8v_q6k_rows(MC, row + b * bytes, b, x, acc);
            else q8v_q45k_rows(KIND, MC, row + b * bytes, b, x, acc);
        }
    }
    for (int r = 0; r < MC; r++) {
        y[r] = _mm512_reduce_add_ps(acc[r]);
        if (b < blocks) y[r] += q8_block_portable(KIND, row + b * bytes, b, rows + r);
    }
}

/* One weight row against `count` rows of x (1, 2, 4 or Q8V_ROWS): y[r], each row's sums in the same order whatever
   the count (a decode row and a verification step's rows take the same arithmetic). */
static void q8_rows_vnni(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x, int count, float *y) {
#define Q8V_KIND(KIND)                                                                                              \
    case KIND:                                                                                                      \
        if (count == Q8V_ROWS) q8v_rows(KIND, Q8V_ROWS, row, blocks, x, y);                                        \
        else if (count == 4) q8v_rows(KIND, 4, row, blocks, x, y);                                                 \
        else if (count == 2) q8v_rows(KIND, 2, row, blocks, x, y);                                                 \
        else q8v_rows(KIND, 1, row, blocks, x, y);                                                                 \
        return;
    switch (kind) { /* constant kinds and row counts, so each kernel inlines */
    Q8_EACH_KIND(Q8V_KIND)
    default: return;
    }
#undef Q8V_KIND
}

#endif
