/* AVX2 dot products of GGUF weight rows with x rounded to Q8_0 / Q8_K (gguf_q8.h includes this where the build has
   no AVX-512 VNNI), in llama.cpp's manner (ggml-cpu's x86 vec_dot_*_q8_*): the weights' unsigned q times x's signed
   q by vpmaddubsw into int16 pairs, vpmaddwd joining them (by ones, or by the K-quants' sub-block scales) into int32
   lanes of 4 values in x's order; the legacy kinds take AVX-VNNI's 256-bit vpdpbusd instead where the build has it.
   vpmaddubsw saturates an int16 pair past 32767: the operands keep under it (x's q within +-127; 4/5/6-bit weights at
   most 15/31/63: 2 * 63 * 127 = 16002; Q8_0's weights as their magnitudes, at most 128, x's sign flipped where they
   are negative: 2 * 128 * 127 = 32512). Offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32) come off the integer sums
   through x's sums; mins (Q4_1 / Q5_1's m * s, the K-quants' dmin * mn * bsums) in float once a block. Each block's
   weight values are made once for 4 rows of x: 576 x 1536 Q4_1 at 64 rows took 3.1 ms a row at a time, 2.2 so
   (one Sapphire Rapids thread; the weight's float GEMM 1.2; `python -m strata.bench.int8_products`). */
#ifndef STRATA_GGUF_Q8_AVX2_H
#define STRATA_GGUF_Q8_AVX2_H
#include <immintrin.h>

#define Q8A_ROWS 4 /* rows of x that share each block's weight values (the registers hold 4 rows' sums and more) */

/* Unsigned bytes w times signed bytes x, summed per 4 (lane i: bytes 4i .. 4i + 3), exact within the ranges above. */
static inline __m256i q8a_dot(__m256i w, __m256i x) {
#if STRATA_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* 32 bits (a legacy block's qh at p) as 32 bytes, 16 where the bit is set: each value's fifth bit. */
static inline __m256i q8a_fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}

static inline float q8a_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Block b of a legacy kind (at `block`) against MC rows of x: acc[r] + its d * x[r]'s d times the exact int32 sums
   per lane; the weight's values made once for all rows. */
static inline __attribute__((always_inline)) void q8a_legacy_block(const int KIND, const int MC, const uint8_t *block,
                                                                   int64_t b, const q8_x_t *x, __m256 *acc,
                                                                   float *mins) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    __m256i w;
    if (KIND == KIND_Q8_0) { /* |w| times x with w's sign: vpmaddubsw's first operand is unsigned */
        w = _mm256_loadu_si256((const __m256i *)(block + 2));
    } else {
        const int64_t qs = (with_min ? 4 : 2) + (five ? 4 : 0);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + qs));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
        if (five) w = _mm256_or_si256(w, q8a_fifth_bits(block + qs - 4));
    }
    const __m256i magnitude = KIND == KIND_Q8_0 ? _mm256_sign_epi8(w, w) : w;
    const float d = half_at(block), m = with_min ? half_at(block + 2) : 0.f;
    for (int r = 0; r < MC; r++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[r].q + 32 * b));
        __m256i dot = q8a_dot(magnitude, KIND == KIND_Q8_0 ? _mm256_sign_epi8(xq, w) : xq);
        if (KIND != KIND_Q8_0 && !with_min) /* Q4_0 / Q5_0: q - 8 / q - 16, exactly */
            dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(
                                            _mm256_loadu_si256((const __m256i *)(x[r].lanes + 8 * b)), five ? 4 : 3));
        if (with_min) mins[r] += m * x[r].s[b];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x[r].d[b]), acc[r]);
    }
}

/* sum over sub-blocks j of mins[j] * (x summed over sub-block j's 32 values), x's sums per 16 at s16. */
static inline int32_t q8a_k_mins(__m256i scales_mins, const int32_t *s16) {
    const __m256i pairs = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)s16),
                                            _mm256_loadu_si256((const __m256i *)(s16 + 8))); /* 0 1 4 5 | 2 3 6 7 */
    const __m256i sums = _mm256_permute4x64_epi64(pairs, _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i mins = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(scales_mins, 1));
    const __m256i p = _mm256_mullo_epi32(mins, sums);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* One Q4_K / Q5_K block against MC rows of x's Q8_K block b: 32 bytes of qs hold sub-blocks 2i (low nibbles) and
   2i + 1 (high); each sub-block's 16 int16 pairs meet its scale in vpmaddwd. mins[r] takes dmin's term off. */
static inline __attribute__((always_inline)) void q8a_q45k_block(const int KIND, const int MC, const uint8_t *block,
                                                                 int64_t b, const q8_x_t *x, __m256 *acc, float *mins) {
    const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16);
    const __m256i nibble = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i scales_mins = q8_k_scales_mins(block + 4);
    const __m256i scales = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x00); /* both halves: scales */
    const __m256i qh = KIND == KIND_Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16)) : _mm256_setzero_si256();
    __m256i total[Q8A_ROWS];
    for (int r = 0; r < MC; r++) total[r] = _mm256_setzero_si256();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
        __m256i w[2] = {_mm256_and_si256(bytes, nibble), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
        for (int half = 0; half < 2; half++) {
            const int j = 2 * i + half; /* sub-block; Q5_K: bit j of qh[l] is its value l's fifth */
            if (KIND == KIND_Q5_K)
                w[half] = _mm256_or_si256(w[half],
                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
            const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(2 * j | (2 * j + 1) << 8)));
            for (int r = 0; r < MC; r++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[r].q + QK_K * b + 32 * j));
                total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w[half], xq), scale));
            }
        }
    }
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int r = 0; r < MC; r++) {
        mins[r] -= x[r].d[b] * dmin * (float)q8a_k_mins(scales_mins, x[r].sum16 + QK_K / 16 * b);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_set1_ps(x[r].d[b] * d), acc[r]);
    }
}

/* sum over Q6_K's 16 sub-blocks of scale * x's sum per 16 (at s16), per int32 lane: its -32 offset's factor. */
static inline __m256i q8a_q6k_offset(__m128i scale_bytes, const int32_t *s16) {
    const __m256i sums = _mm256_permute4x64_epi64( /* |sums per 16| <= 2032: int16 */
        _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)s16), _mm256_loadu_si256((const __m256i *)(s16 + 8))),
        _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_madd_epi16(sums, _mm256_cvtepi8_epi16(scale_bytes));
}

/* One Q6_K block against MC rows of x's Q8_K block b: for each half h, 64 bytes of ql hold runs 0-1 (low nibbles)
   and 2-3 (high), two bits of qh each; a run's two 16-value sub-blocks meet their int8 scales in vpmaddwd. The -32
   offset comes off at the end: 32 * sum of scale * x's sum per 16. */
static inline __attribute__((always_inline)) void q8a_q6k_block(const int MC, const uint8_t *block, int64_t b,
                                                                const q8_x_t *x, __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(block + 192));
    __m256i total[Q8A_ROWS];
    for (int r = 0; r < MC; r++) total[r] = _mm256_setzero_si256();
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i ql[2] = {_mm256_loadu_si256((const __m256i *)(block + 64 * h)),
                               _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32))};
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i low = _mm256_and_si256(s < 2 ? ql[s] : _mm256_srli_epi16(ql[s - 2], 4), nibble);
            const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), two), 4);
            const __m256i q = _mm256_or_si256(low, high);
            const int at = 8 * h + 2 * s; /* scale of the run's first 16 values (low lane), then its second's */
            const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (at + 1), 0x0101010101010101LL * at);
            const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scale_bytes, pick));
            for (int r = 0; r < MC; r++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[r].q + QK_K * b + 128 * h + 32 * s));
                total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scale));
            }
        }
    }
    const float d = half_at(block + 208);
    for (int r = 0; r < MC; r++) {
        const __m256i offset = q8a_q6k_offset(scale_bytes, x[r].sum16 + QK_K / 16 * b);
        const __m256i exact = _mm256_sub_epi32(total[r], _mm256_slli_epi32(offset, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(d * x[r].d[b]), acc[r]);
    }
}

/* Block b of a row against MC rows of x, its lines asked for ahead. */
static inline __attribute__((always_inline)) void q8a_block(const int KIND, const int MC, const uint8_t *row,
                                                            int64_t b, const q8_x_t *x, __m256 *acc, float *mins) {
    const int64_t bytes = gguf_block_bytes(KIND);
    const uint8_t *block = row + b * bytes;
    if (gguf_block_values(KIND) == 32) {
        if (b % 2 == 0) prefetch_ahead(block, 2 * bytes);
        q8a_legacy_block(KIND, MC, block, b, x, acc, mins);
    } else {
        prefetch_ahead(block, bytes);
        if (KIND == KIND_Q6_K) q8a_q6k_block(MC, block, b, x, acc);
        else q8a_q45k_block(KIND, MC, block, b, x, acc, mins);
    }
}

/* One weight row against MC rows of x (1 or Q8A_ROWS): y[r]. Each block's weight values are made once for all MC
   rows; one row keeps two chains of sums (even and odd blocks, the loop unrolled so that the registers stay
   registers), several rows one chain each. */
static inline __attribute__((always_inline)) void q8a_rows(const int KIND, const int MC, const uint8_t *row,
                                                           int64_t blocks, const q8_x_t *x, float *y) {
    __m256 acc[2][Q8A_ROWS];
    float mins[2][Q8A_ROWS];
    for (int c = 0; c < 2; c++)
        for (int r = 0; r < MC; r++) acc[c][r] = _mm256_setzero_ps(), mins[c][r] = 0.f;
    int64_t b = 0;
    if (MC == 1)
        for (; b + 2 <= blocks; b += 2) {
            q8a_block(KIND, MC, row, b, x, acc[0], mins[0]);
            q8a_block(KIND, MC, row, b + 1, x, acc[1], mins[1]);
        }
    for (; b < blocks; b++) q8a_block(KIND, MC, row, b, x, acc[0], mins[0]);
    for (int r = 0; r < MC; r++)
        y[r] = q8a_hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (mins[0][r] + mins[1][r]);
}

/* One weight row against `count` rows of x (1, 2 or Q8A_ROWS): y[r]. */
static void q8_rows_avx2(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x, int count, float *y) {
#define Q8A_KIND(KIND)                                                                                              \
    case KIND:                                                                                                      \
        if (count == Q8A_ROWS) q8a_rows(KIND, Q8A_ROWS, row, blocks, x, y);                                        \
        else if (count == 2) q8a_rows(KIND, 2, row, blocks, x, y);                                                 \
        else q8a_rows(KIND, 1, row, blocks, x, y);                                                                 \
        return;
    switch (kind) { /* constant kinds and row counts, so each kernel inlines */
    Q8_EACH_KIND(Q8A_KIND)
    default: return;
    }
#undef Q8A_KIND
}

#endif
