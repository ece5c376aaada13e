/* AVX-512 VNNI products of GGUF kinds (Q4_0 .. Q5_1, Q4_K, Q5_K, Q6_K) by a few rows of x, x rounded to 24-bit fixed
   point as for gguf_dot_avx2.h (included after it, whose prepared x this reads in its quad, k-quad or in-order layout).
   Four blocks' 4-bit values fill one 64-byte register (values 0-15 of each block, then a second register with values
   16-31), vpdpbusd multiplies them by each of x's three digits and sums four products an int32 lane: every lane belongs
   to one block, so one float multiply per 128 values applies the four blocks' d. Zen 4, SmolLM2's Q4_1: half the
   instructions of the AVX2 kernel per value. The K-quants likewise: 64 bytes of a Q4_K / Q5_K block's qs hold four
   32-value sub-blocks (two in the low nibbles, two in the high), 64 bytes of a Q6_K block's ql two runs of 32 in either
   nibble; each lane's int32 sum belongs to one sub-block, so one float multiply per lane applies its scale. A [32000 x
   1024] weight at one row of x on two Xeon cores: Q4_K 20.5 -> 23 GB/s, Q6_K 27 -> 29. */
#ifndef STRATA_GGUF_DOT_VNNI_H
#define STRATA_GGUF_DOT_VNNI_H
#include <immintrin.h>

/* The halves at p, p + stride, .. (count of them, 1-4) as floats, zeros after them. */
static inline __m128 four_halves(const uint8_t *p, int64_t stride, int count) {
#if STRATA_F16C
    uint64_t bits = 0;
    for (int j = 0; j < count; j++) bits |= (uint64_t)half_bits(p + j * stride) << (16 * j);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)bits));
#else
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < count; j++) v[j] = f16_to_f32(half_bits(p + j * stride));
    return _mm_loadu_ps(v);
#endif
}

/* Two registers of 64 unsigned values (each at most 63) against x's digits at `at` and `at` + 64: each int32 lane
   the exact sum of its four values times the 24-bit x (65536 high + 256 middle + low digit, joined in int32 as the
   AVX2 kernel's). */
static inline __attribute__((always_inline)) void digit_sums_vnni(__m512i first, __m512i second, const gguf_x_t *xp,
                                                                  int64_t at, __m512i acc[2]) {
    acc[0] = acc[1] = _mm512_setzero_si512();
    for (int d = 0; d < I4_DIGITS; d++) {
        if (d) acc[0] = _mm512_slli_epi32(acc[0], 8), acc[1] = _mm512_slli_epi32(acc[1], 8);
        acc[0] = _mm512_dpbusd_epi32(acc[0], first, _mm512_loadu_si512((const void *)(xp->digits[d] + at)));
        acc[1] = _mm512_dpbusd_epi32(acc[1], second, _mm512_loadu_si512((const void *)(xp->digits[d] + at + 64)));
    }
}

/* total + each lane's int32 sum times its sub-block's scale: lane i of acc[k] takes scales[index[k][i]]. */
static inline __attribute__((always_inline)) __m512 add_scaled_lanes(const __m512i acc[2], __m512i first,
                                                                    __m512i second, __m512 scales, __m512 total) {
    total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0]), _mm512_permutexvar_ps(first, scales), total);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[1]), _mm512_permutexvar_ps(second, scales), total);
}

/* Blocks b .. b + 3 (`count` of them, 1-4: a row's last ones) against quad x: the four d's times x's scale, each
   spread over its block's four lanes, times the exact int32 sums; the mins of Q4_1 / Q5_1 meet x's sums per 32 in
   `mins`. */
static inline __attribute__((always_inline)) __m512 legacy_quad(const uint8_t *block, int64_t b, int count,
                                                               const gguf_x_t *xp, const int KIND, __m512 total,
                                                               __m128 *mins) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    const int64_t bytes = gguf_block_bytes(KIND), qs = (with_min ? 4 : 2) + (five ? 4 : 0);
    /* a row's last blocks (count < 4): the missing ones zero, never read past the row */
    __m512i q = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)(block + qs)));
    if (count > 1) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(block + bytes + qs)), 1);
    if (count > 2) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(block + 2 * bytes + qs)), 2);
    if (count > 3) q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(block + 3 * bytes + qs)), 3);
    uint64_t low_bits = 0, high_bits = 0; /* Q5's fifth bits: byte 16 j + l of either register is block j's */
    for (int j = 0; five && j < count; j++) {
        uint32_t qh;
        memcpy(&qh, block + j * bytes + qs - 4, sizeof qh);
        low_bits |= (uint64_t)(qh & 0xffff) << (16 * j), high_bits |= (uint64_t)(qh >> 16) << (16 * j);
    }
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512i low = _mm512_and_si512(q, nibble), high = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
    if (five) {
        low = _mm512_mask_add_epi8(low, (__mmask64)low_bits, low, _mm512_set1_epi8(16));
        high = _mm512_mask_add_epi8(high, (__mmask64)high_bits, high, _mm512_set1_epi8(16));
    }
    __m512i sums[2];
    digit_sums_vnni(low, high, xp, b / 4 * 128, sums);
    __m512i acc = _mm512_add_epi32(sums[0], sums[1]); /* each lane one block's 8 products */
    if (!with_min) /* Q4_0 and Q5_0 take away 8 or 16 times each lane's x, exactly */
        acc = _mm512_sub_epi32(acc, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(xp->lanes + b / 4 * 16)),
                                                      five ? 4 : 3));
    const __m128 d = four_halves(block, bytes, count); /* a missing block's q and d are 0 */
    if (with_min) *mins = _mm_fmadd_ps(four_halves(block + 2, bytes, count), _mm_loadu_ps(xp->sum32 + b), *mins);
    const __m512 scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                               _mm512_castps128_ps512(_mm_mul_ps(d, _mm_set1_ps(xp->scale[b / 4]))));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, total);
}

static inline __attribute__((always_inline)) float legacy_row_vnni(const uint8_t *row, int64_t blocks,
                                                                   const gguf_x_t *xp, const int KIND) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: one FMA's latency each */
    __m128 mins = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
        prefetch_ahead(row + b * bytes, 8 * bytes);
        even = legacy_quad(row + b * bytes, b, 4, xp, KIND, even, &mins);
        odd = legacy_quad(row + (b + 4) * bytes, b + 4, 4, xp, KIND, odd, &mins);
    }
    for (; b < blocks; b += 4)
        even = legacy_quad(row + b * bytes, b, blocks - b < 4 ? (int)(blocks - b) : 4, xp, KIND, even, &mins);
    __m128 m = _mm_add_ps(mins, _mm_movehl_ps(mins, mins));
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) + _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* Q4_K / Q5_K, one block against the k-quad x (x_position): 64 bytes of qs at a time, whose low nibbles are
   sub-blocks 4h and 4h + 2 and high nibbles 4h + 1 and 4h + 3, against x's values in that order. Lanes 0-7 of
   each product are the first sub-block's, 8-15 the second's: their scales (d * sc * x's scale) meet the joined
   int32 sums in float. The mins meet x's sums per 32 in `mins`, as in the AVX2 kernel. */
static inline __attribute__((always_inline)) __m512 q45k_block_vnni(const uint8_t *block, int64_t s,
                                                                   const gguf_x_t *xp, const int KIND,
                                                                   __m512 total, __m256 *mins) {
    const __m128i packed = k_scales_mins(block + 4);
    k_block_mins(block, packed, s, xp, mins);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed)); /* lanes 0-7: the 8 scales */
    const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16);
    const __m512i nibble = _mm512_set1_epi8(15), bit = _mm512_set1_epi8(1);
    const __m512i qh = KIND == KIND_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16)))
                                         : _mm512_setzero_si512();
    const float d = half_at(block);
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512((const void *)(qs + 64 * h));
        __m512i low = _mm512_and_si512(q, nibble), high = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
        if (KIND == KIND_Q5_K) { /* sub-block j's fifth bits are bits j of qh: 4h, 4h + 2 low; 4h + 1, 4h + 3 high */
            const __m512i first = _mm512_set1_epi16((short)(4 * h)), second = _mm512_set1_epi16((short)(4 * h + 2));
            const __m512i shift = _mm512_inserti64x4(first, _mm512_castsi512_si256(second), 1);
            const __m512i next = _mm512_add_epi16(shift, _mm512_set1_epi16(1));
            const __m512i lo_bits = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), bit);
            const __m512i hi_bits = _mm512_and_si512(_mm512_srlv_epi16(qh, next), bit);
            low = _mm512_or_si512(low, _mm512_slli_epi16(lo_bits, 4));
            high = _mm512_or_si512(high, _mm512_slli_epi16(hi_bits, 4));
        }
        __m512i acc[2];
        digit_sums_vnni(low, high, xp, s * QK_K + 128 * h, acc);
        /* lanes 0-7 of the low nibbles' sums take scale 4h, 8-15 scale 4h + 2; the high nibbles' 4h + 1, 4h + 3 */
        const __m512i index = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                                               _mm512_set1_epi32(4 * h));
        total = add_scaled_lanes(acc, index, _mm512_add_epi32(index, _mm512_set1_epi32(1)),
                                 _mm512_mul_ps(sc, _mm512_set1_ps(d * xp->scale[2 * s + h])), total);
    }
    return total;
}

/* Q6_K, one block against the in-order x: 64 bytes of ql at a time hold runs 0-1 of a 128-value half in their low
   nibbles and runs 2-3 in their high ones, with two bits of qh each (gguf_blocks.h), so each register is 64 values
   in order; lanes 4j .. 4j + 3 are one 16-value sub-block's, scaled in float by its int8 scale. The -32 offset
   meets x's sums per 16 in `offsets`, as in the AVX2 kernel. */
static inline __attribute__((always_inline)) __m512 q6k_block_vnni(const uint8_t *block, int64_t sb,
                                                                  const gguf_x_t *xp, __m512 total,
                                                                  __m256 *offsets) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(block + 192));
    const float d = half_at(block + 208);
    q6k_block_offsets(block, sb, xp, offsets);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)); /* the 16 sub-blocks' scales */
    const __m512i nibble = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
        /* run r takes bits 2r, 2r + 1 of qh: runs 0 and 1 (low nibbles), then 2 and 3 (high) */
        const __m512i shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i shift23 = _mm512_add_epi16(shift01, _mm512_set1_epi16(4));
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift01), two), 4)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift23), two), 4))};
        __m512i acc[2];
        digit_sums_vnni(q[0], q[1], xp, sb * QK_K + 128 * h, acc);
        const __m512i index = _mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h)); /* sub-blocks 8h .. 8h + 7 */
        total = add_scaled_lanes(acc, index, _mm512_add_epi32(index, _mm512_set1_epi32(4)),
                                 _mm512_mul_ps(sc, _mm512_set1_ps(d * xp->scale[2 * sb + h])), total);
    }
    return total;
}

static inline __attribute__((always_inline)) float kquant_row_vnni(const uint8_t *row, int64_t blocks,
                                                                   const gguf_x_t *xp, const int KIND) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: one FMA's latency each */
    __m256 offsets = _mm256_setzero_ps();
    for (int64_t s = 0; s < blocks; s++) {
        const uint8_t *block = row + s * bytes;
        prefetch_ahead(block, bytes);
        const __m512 total = s & 1 ? odd : even;
        const __m512 next = KIND == KIND_Q6_K ? q6k_block_vnni(block, s, xp, total, &offsets)
                                              : q45k_block_vnni(block, s, xp, KIND, total, &offsets);
        if (s & 1) odd = next;
        else even = next;
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) -
           (KIND == KIND_Q6_K ? 32.f : 1.f) * hsum(offsets);
}

#endif
