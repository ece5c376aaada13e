/* MXFP4 weights (mxfp4.h's layout: 16 bytes of e2m1 codes a block, value 2j in byte j's low nibble, 2j + 1 in its
   high one, a separate e8m0 exponent a block) times x rounded to Q8_0 blocks (gguf_q8.h), as llama.cpp's
   ggml_vec_dot_mxfp4_q8_0 does: the codes as the whole numbers 2 * e2m1 (kvalues_mxfp4), exact int32 sums a block
   with x's int8 q, then times x's fp16 d and 2^(e - 128) in float. AVX-512 VNNI: two blocks a register, the codes
   + 12 (unsigned) by vpdpbusd, 12 * x's lane sums taken off; AVX2: vpmaddubsw, one block a register; portable C
   elsewhere. Included by weight_only.c after gguf_q8.h and mxfp4.h. */
#ifndef STRATA_MXFP4_Q8_H
#define STRATA_MXFP4_Q8_H

/* Doubled e2m1 codes + 12: 0..24, unsigned operands of vpdpbusd / vpmaddubsw. */
static const int8_t MXQ_OFFSET_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static inline float mxq_block_portable(const uint8_t *codes, uint8_t e, int64_t b, const q8_x_t *x) {
    const int8_t *xq = x->q + 32 * b;
    int32_t sum = 0;
    for (int j = 0; j < 16; j++)
        sum += MXFP4_DOUBLED[codes[j] & 15] * xq[2 * j] + MXFP4_DOUBLED[codes[j] >> 4] * xq[2 * j + 1];
    return x->d[b] * mxfp4_half_scale(e) * (float)sum;
}

#if STRATA_AVX512VNNI
/* Blocks b and b + 1 (32 bytes of codes at p) against x: acc + their scales times the exact int32 sums. */
static inline __m512 mxq_pair_vnni(const uint8_t *p, const uint8_t *e, int64_t b, const q8_x_t *x, __m512 acc) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXQ_OFFSET_CODES));
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)p), low4 = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low4));
    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
    /* per 128-bit lane (one block): values 0-15, then 16-31 */
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(lo, hi)),
                                         _mm256_unpackhi_epi8(lo, hi), 1); /* b 0-15, b+1 0-15, b 16-31, b+1 16-31 */
    const __m512i w = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)(x->q + 32 * b)));
    dot = _mm512_sub_epi32(dot, _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(x->lanes + 8 * b)),
                                                   _mm512_set1_epi32(12)));
    const __m512 scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(x->d[b] * mxfp4_half_scale(e[0])),
                                              _mm512_set1_ps(x->d[b + 1] * mxfp4_half_scale(e[1])));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}
#elif STRATA_AVX2
/* Block b (16 bytes of codes at p) against x: acc + its scale times the exact int32 sums (8 lanes). */
static inline __m256 mxq_block_avx2(const uint8_t *p, uint8_t e, int64_t b, const q8_x_t *x, __m256 acc) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MXQ_OFFSET_CODES), low4 = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m256i w = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    /* pairs at most 2 * 24 * 127: no int16 saturation */
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b)));
    __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    dot = _mm256_sub_epi32(dot, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(x->lanes + 8 * b)),
                                                   _mm256_set1_epi32(12)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x->d[b] * mxfp4_half_scale(e)), acc);
}
#endif

/* One MXFP4 weight row (`groups` blocks, exponents e) against one rounded row of x. */
static float mxq_row(const uint8_t *row, const uint8_t *e, int64_t groups, const q8_x_t *x) {
    int64_t b = 0;
    float sum = 0.f;
#if STRATA_AVX512VNNI
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (; b + 4 <= groups; b += 4) {
        prefetch_ahead(row + b * MXFP4_BLOCK_BYTES, 64);
        even = mxq_pair_vnni(row + b * MXFP4_BLOCK_BYTES, e + b, b, x, even);
        odd = mxq_pair_vnni(row + (b + 2) * MXFP4_BLOCK_BYTES, e + b + 2, b + 2, x, odd);
    }
    for (; b + 2 <= groups; b += 2) even = mxq_pair_vnni(row + b * MXFP4_BLOCK_BYTES, e + b, b, x, even);
    sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
#elif STRATA_AVX2
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (; b + 2 <= groups; b += 2) {
        if (b % 4 == 0) prefetch_ahead(row + b * MXFP4_BLOCK_BYTES, 64);
        even = mxq_block_avx2(row + b * MXFP4_BLOCK_BYTES, e[b], b, x, even);
        odd = mxq_block_avx2(row + (b + 1) * MXFP4_BLOCK_BYTES, e[b + 1], b + 1, x, odd);
    }
    sum = hsum(_mm256_add_ps(even, odd));
#endif
    for (; b < groups; b++) sum += mxq_block_portable(row + b * MXFP4_BLOCK_BYTES, e[b], b, x);
    return sum;
}

/* out[m_total, n] = rounded rows xs (Q8_0) times an MXFP4 weight's transpose (+ bias): blocks [n, row_bytes], exps
   uint8 [n, k / 32]; the weight's rows shared among the threads, each read once for up to Q8_ROWS_PER_PASS rows. */
static void mxq_multiply(const weights_t *w, const uint8_t *exps, const q8_x_t *xs, int64_t m_total,
                         const float *bias, float *out, int num_threads) {
    const int64_t groups = w->k / BLOCK, tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        for (int64_t m0 = 0; m0 < m_total; m0 += Q8_ROWS_PER_PASS) {
            const int64_t m1 = m0 + Q8_ROWS_PER_PASS < m_total ? m0 + Q8_ROWS_PER_PASS : m_total;
            for (int64_t n = n0; n < n1; n++)
                for (int64_t m = m0; m < m1; m++)
                    out[m * w->n + n] = mxq_row(w->data + n * w->row_bytes, exps + n * groups, groups, xs + m) +
                                        (bias ? bias[n] : 0.f);
        }
    }
}

#endif
