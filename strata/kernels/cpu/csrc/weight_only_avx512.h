/* AVX-512 small-batch kernels for int4 / int8 weights (included by weight_only.c, after weights_t, when the
   compiler targets AVX-512 F/BW). int4: a block's 16 bytes are broadcast to the four 128-bit lanes, each lane
   rotates its dwords so that a different nibble lands in the top mantissa bits, and one ternary-logic op masks it
   under the exponent of 1.0, giving v = 1 + q / 16 exactly, with no shuffle; x is permuted once per call into the
   order those registers hold. int8: bytes widened from memory and converted (v = q). Either way, per group,
   sum (q - z) x = R * sum v x - (offset + z) * sum x, with (R, offset) = (16, 16) or (1, 0). */
#ifndef STRATA_WEIGHT_ONLY_AVX512_H
#define STRATA_WEIGHT_ONLY_AVX512_H
#include <immintrin.h>

#define MAX_MC512 8 /* rows of x multiplied per pass over a weight row */

/* Position p (0..31) of a prepared x block holds value source_of(kind, p) of the block. */
static inline int source_of(int kind, int p) {
    const int h = p / 16, i = p % 16;
    if (kind != KIND_INT4) return p;
    const int j = 4 * h + i / 4; /* lane quad j of half h takes nibble 4h + j of each dword */
    return 4 * (i % 4) + j / 2 + 16 * (j & 1);
}

/* The lanes of 16 floats that lie before the end, `left` values away (none when left <= 0). */
static inline __mmask16 tail_mask16(int64_t left) {
    return left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* x [m_total, k] into xp [m_total, blocks * 32] in the order the decoded weights hold, zero past k. */
static inline void avx512_prepare_x(int kind, const float *x, int64_t m_total, int64_t k, int64_t blocks,
                                    float *xp) {
    int32_t lo[16], hi[16];
    for (int p = 0; p < 16; p++) lo[p] = source_of(kind, p), hi[p] = source_of(kind, p + 16);
    const __m512i idx_lo = _mm512_loadu_si512(lo), idx_hi = _mm512_loadu_si512(hi);
    for (int64_t m = 0; m < m_total; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *src = x + m * k + b * BLOCK;
            const int64_t left = k - b * BLOCK;
            const __m512 x0 = _mm512_maskz_loadu_ps(tail_mask16(left), src);
            const __m512 x1 = _mm512_maskz_loadu_ps(tail_mask16(left - 16), src + 16);
            float *dst = xp + (m * blocks + b) * BLOCK;
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(x0, idx_lo, x1));
            _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(x0, idx_hi, x1));
        }
}

/* Rotations (per lane) that bring each lane's int4 nibble to the top of the mantissa, and the mask there. */
typedef struct {
    __m512i rot0, rot1, mask, one;
} decoder_t;

static inline decoder_t make_decoder(void) {
    decoder_t d;
    d.one = _mm512_set1_epi32(0x3f800000);
    d.rot0 = _mm512_set_epi32(7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15, 19, 19, 19, 19);
    d.rot1 = _mm512_set_epi32(23, 23, 23, 23, 27, 27, 27, 27, 31, 31, 31, 31, 3, 3, 3, 3);
    d.mask = _mm512_set1_epi32(0x00780000); /* bits 19-22 */
    return d;
}

/* Block b of a row as two registers of 16 floats in prepared-x order. */
static inline __attribute__((always_inline)) void decode_block(const int KIND, const uint8_t *row, int64_t b,
                                                               const decoder_t *d, __m512 v[2]) {
    if (KIND == KIND_INT8) { /* widened straight from memory, converted: q itself */
        const uint8_t *p = row + b * BLOCK;
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    } else { /* 0xea: (rotated & mask) | one */
        const __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + b * (BLOCK / 2))));
        v[0] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_rolv_epi32(q, d->rot0), d->mask, d->one, 0xea));
        v[1] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_rolv_epi32(q, d->rot1), d->mask, d->one, 0xea));
    }
}

/* sum over groups of scale * (offset + zero) * xsum, spread over 16 lanes: the part of R * sum v x that is not
   the product. */
static inline __m512 zero_terms(const float *scales, const float *zeros, float zero, const float *xsum,
                                int64_t groups, float offset) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 m = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 z = zeros ? _mm512_maskz_loadu_ps(m, zeros + g) : _mm512_set1_ps(zero);
        const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scales + g), _mm512_add_ps(z, _mm512_set1_ps(offset)));
        acc = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(m, xsum + g), acc);
    }
    return acc;
}

/* Row n against MC rows of prepared x, every block of the padded K. Each block's products gather in `acc`
   (2 * MC independent FMA chains), which joins `total` at the group's scale. */
static inline __attribute__((always_inline)) void avx512_row(const weights_t *w, int64_t n, const float *xp,
                                                             int64_t blocks, const float *xsum, const int KIND,
                                                             const int MC, float *y) {
    const uint8_t *row = w->data + n * w->row_bytes;
    const float *scales = w->scales + n * w->groups;
    const int64_t per_group = w->group_size / BLOCK, x_stride = blocks * BLOCK;
    const decoder_t d = make_decoder();
    __m512 total[MAX_MC512];
    for (int m = 0; m < MC; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0, b = 0; b < blocks; g++) {
        const int64_t end = b + per_group < blocks ? b + per_group : blocks;
        __m512 acc[MAX_MC512][2];
        for (int m = 0; m < MC; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (; b < end; b++) {
            __m512 v[2];
            decode_block(KIND, row, b, &d, v);
            for (int m = 0; m < MC; m++) {
                const float *xb = xp + m * x_stride + b * BLOCK;
                acc[m][0] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xb), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xb + 16), acc[m][1]);
            }
        }
        const __m512 scale = _mm512_set1_ps(scales[g]);
        for (int m = 0; m < MC; m++) total[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][0], acc[m][1]), scale, total[m]);
    }
    /* int4 decodes to 1 + q / 16, int8 to q. */
    const float r = KIND == KIND_INT4 ? 16.f : 1.f, offset = KIND == KIND_INT4 ? 16.f : 0.f;
    const float zero = KIND == KIND_INT4 ? 8.f : 128.f;
    const float *zeros = w->zeros ? w->zeros + n * w->groups : NULL;
    for (int m = 0; m < MC; m++)
        y[m] = r * _mm512_reduce_add_ps(total[m]) -
               _mm512_reduce_add_ps(zero_terms(scales, zeros, zero, xsum + m * w->groups, w->groups, offset));
}

#endif
