/* AVX-512 VNNI products of the legacy GGUF kinds (Q4_0, Q4_1, Q5_0, Q5_1) by a few rows of x, x rounded to 24-bit
   fixed point as for gguf_dot_avx2.h (included after it, whose prepared x this reads in its quad layout). Four
   blocks' 4-bit values fill one 64-byte register (values 0-15 of each block, then a second register with values
   16-31), vpdpbusd multiplies them by each of x's three digits and sums four products an int32 lane: every lane
   belongs to one block, so one float multiply per 128 values applies the four blocks' d. Zen 4, SmolLM2's Q4_1:
   half the instructions of the AVX2 kernel per value. */
#ifndef STRATA_GGUF_DOT_VNNI_H
#define STRATA_GGUF_DOT_VNNI_H
#include <immintrin.h>

/* The halves at p, p + stride, .. (count of them, 1-4) as floats, zeros after them. */
static inline __m128 four_halves(const uint8_t *p, int64_t stride, int count) {
#if defined(__F16C__)
    uint64_t bits = 0;
    for (int j = 0; j < count; j++) bits |= (uint64_t)half_bits(p + j * stride) << (16 * j);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)bits));
#else
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < count; j++) v[j] = f16_to_f32(half_bits(p + j * stride));
    return _mm_loadu_ps(v);
#endif
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
    const int64_t at = b / 4 * 128;
    __m512i acc = _mm512_setzero_si512();
    for (int d = 0; d < I4_DIGITS; d++) { /* 65536 high + 256 middle + low, joined in int32 as the AVX2 kernel's */
        if (d) acc = _mm512_slli_epi32(acc, 8);
        acc = _mm512_dpbusd_epi32(acc, low, _mm512_loadu_si512((const void *)(xp->digits[d] + at)));
        acc = _mm512_dpbusd_epi32(acc, high, _mm512_loadu_si512((const void *)(xp->digits[d] + at + 64)));
    }
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
    __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* two chains: one FMA's latency each */
    __m128 mins = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) {
        const uint8_t *block = row + b * bytes;
        prefetch_ahead(block, 4 * bytes);
        total[b / 4 & 1] = legacy_quad(block, b, 4, xp, KIND, total[b / 4 & 1], &mins);
    }
    if (b < blocks) total[0] = legacy_quad(row + b * bytes, b, (int)(blocks - b), xp, KIND, total[0], &mins);
    __m128 m = _mm_add_ps(mins, _mm_movehl_ps(mins, mins));
    return _mm512_reduce_add_ps(_mm512_add_ps(total[0], total[1])) + _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

#endif
