/* The decode attention's vector loops (AVX-512, else AVX2; included by cpu_attention.c before its DEFINE_ATTEND):
   the vocabulary each instruction set defines, a tile of tokens' scores reduced together, and the value loop that
   keeps queries' output sums in registers over the tokens. */
#ifndef STRATA_DECODE_ATTENTION_WIDE_H
#define STRATA_DECODE_ATTENTION_WIDE_H

/* Heads of up to this many dimensions (a multiple of WIDE_LANES) take the AVX-512 or AVX2 loops below, where
   there are, written once over the vector vocabulary each defines. */
#define WIDE_HEAD_DIM 256 /* Gemma 3's heads; wider ones (none served yet) take the scalar loops */
#define WIDE_PASS 8 /* vectors of one head's output kept in registers over the tokens: a pass of the value loop */
#if STRATA_AVX512F
#define WIDE_ATTENTION 1
#define WIDE_LANES 16
#define WIDE_QB4 6 /* queries whose value sums a pass keeps in registers: heads of 4 vectors (64 dimensions) */
#define WIDE_QB8 2 /* ... of 8 vectors */
typedef __m512 wide_t;
#define wide_zero _mm512_setzero_ps
#define wide_loadu _mm512_loadu_ps
#define wide_storeu _mm512_storeu_ps
#define wide_set1 _mm512_set1_ps
#define wide_add _mm512_add_ps
#define wide_mul _mm512_mul_ps
#define wide_fmadd _mm512_fmadd_ps
#define WIDE_SLOT(s) (((s) % 4) * 4 + (s) / 4) /* the tile's token whose dot product wide_sum puts in lane s */

static inline wide_t wide_load_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 registers' lane sums as one register, lane i the sum of v[(i % 4) * 4 + i / 4]: 16 dot products reduced
   together in 45 shuffles and adds, where one at a time would take 8 each. */
static inline wide_t wide_sum(const wide_t v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
}
#elif STRATA_AVX2
#define WIDE_ATTENTION 1
#define WIDE_LANES 8
#define WIDE_QB4 3 /* AVX2's 16 registers */
#define WIDE_QB8 1
typedef __m256 wide_t;
#define wide_zero _mm256_setzero_ps
#define wide_loadu _mm256_loadu_ps
#define wide_storeu _mm256_storeu_ps
#define wide_set1 _mm256_set1_ps
#define wide_add _mm256_add_ps
#define wide_mul _mm256_mul_ps
#define wide_fmadd _mm256_fmadd_ps
#define WIDE_SLOT(s) (s)

static inline wide_t wide_load_bf16(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 registers' lane sums as one register, lane i the sum of v[i]: 8 dot products reduced together. */
static inline wide_t wide_sum(const wide_t v[8]) {
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#else
#define WIDE_ATTENTION 0
#define WIDE_LANES 16
#endif

#if WIDE_ATTENTION
/* The vector score and value loops of DEFINE_ATTEND: a tile of WIDE_LANES tokens' key rows found once for all heads;
   each value row read once for up to WIDE_QB4 (WIDE_QB8) queries of its KV head. A query's weights outside its own
   keys are zeros (softmax_rows), so each output is its own keys' sum in token order whatever queries share a pass. */
#define DEFINE_WIDE(NAME, T, LOADW)                                                                           \
    static inline __attribute__((always_inline)) void NAME##_scores_of(                                       \
        const int CHUNKS, const float *q, const T *k_cache, const int32_t *table, int64_t lo, int64_t hi,     \
        int64_t num_q, int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,             \
        int64_t token_stride, float scale, float *scores) {                                                   \
        const int64_t n = hi - lo;                                                                            \
        for (int64_t t0 = lo; t0 < hi; t0 += WIDE_LANES) {                                                    \
            const int count = hi - t0 < WIDE_LANES ? (int)(hi - t0) : WIDE_LANES;                             \
            const T *by_token[WIDE_LANES], *rows[WIDE_LANES];                                                 \
            int64_t block = t0 / block_size, at = t0 % block_size;                                            \
            for (int i = 0; i < count; i++) { /* a division per block, not per token */                       \
                by_token[i] = k_cache + table[block] * block_stride + at * token_stride;                      \
                if (++at == block_size) at = 0, block++;                                                      \
            }                                                                                                 \
            /* past the keys: the first key again, its lanes dropped */                                       \
            for (int i = count; i < WIDE_LANES; i++) by_token[i] = by_token[0];                               \
            for (int s = 0; s < WIDE_LANES; s++) rows[s] = by_token[WIDE_SLOT(s)];                            \
            /* each query's KV head counted along: j / group was a division a query */                        \
            for (int64_t j = 0, head = 0, in_group = 0; j < num_q; j++) {                                     \
                const float *qj = q + j * head_dim;                                                           \
                wide_t acc[WIDE_LANES];                                                                       \
                /* whole, without branches: the sums stay in registers and the tokens' chains overlap */      \
                _Pragma("GCC unroll 16") for (int s = 0; s < WIDE_LANES; s++) {                               \
                    acc[s] = wide_zero();                                                                     \
                    _Pragma("GCC unroll 16") for (int c = 0; c < CHUNKS; c++)                                 \
                        acc[s] = wide_fmadd(wide_loadu(qj + WIDE_LANES * c),                                  \
                                            LOADW(rows[s] + head + WIDE_LANES * c), acc[s]);                  \
                }                                                                                             \
                const wide_t tile = wide_mul(wide_sum(acc), wide_set1(scale));                                \
                if (count == WIDE_LANES) {                                                                    \
                    wide_storeu(scores + j * n + t0 - lo, tile);                                              \
                } else {                                                                                      \
                    float lanes[WIDE_LANES];                                                                  \
                    wide_storeu(lanes, tile);                                                                 \
                    memcpy(scores + j * n + t0 - lo, lanes, sizeof(float) * (size_t)count);                   \
                }                                                                                             \
                if (++in_group == group) in_group = 0, head += head_dim;                                      \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    static void NAME##_scores(const float *q, const T *k_cache, const int32_t *table, int64_t lo, int64_t hi, \
                              int64_t num_q, int64_t group, int64_t head_dim, int64_t block_size,             \
                              int64_t block_stride, int64_t token_stride, float scale, float *scores) {       \
        const int64_t chunks = head_dim / WIDE_LANES;                                                         \
        if (chunks == 4) /* constant head widths: the compiler keeps the sums in registers */                 \
            NAME##_scores_of(4, q, k_cache, table, lo, hi, num_q, group, head_dim, block_size, block_stride,  \
                             token_stride, scale, scores);                                                    \
        else if (chunks == 8)                                                                                 \
            NAME##_scores_of(8, q, k_cache, table, lo, hi, num_q, group, head_dim, block_size, block_stride,  \
                             token_stride, scale, scores);                                                    \
        else                                                                                                  \
            NAME##_scores_of((int)chunks, q, k_cache, table, lo, hi, num_q, group, head_dim, block_size,      \
                             block_stride, token_stride, scale, scores);                                      \
    }                                                                                                         \
    static inline __attribute__((always_inline)) void NAME##_pass(                                            \
        const int PASS, const int QB, const T *v_cache, const int32_t *table, int64_t lo, int64_t first, \
        int64_t last, int64_t head, int64_t block_size, int64_t block_stride, int64_t token_stride,          \
        const float *p, int64_t n, float *out, int64_t head_dim) {                                            \
        /* fixed sizes (QB <= WIDE_QB4, PASS <= WIDE_PASS): o[QB][PASS] was a VLA, kept in memory */          \
        wide_t o[WIDE_QB4][WIDE_PASS];                                                                        \
        _Pragma("GCC unroll 8") for (int b = 0; b < QB; b++)                                                  \
            _Pragma("GCC unroll 8") for (int c = 0; c < PASS; c++) o[b][c] = wide_zero();                     \
        for (int64_t t = first; t < last;) {                                                                  \
            const int64_t at = t % block_size, end = t - at + block_size < last ? t - at + block_size : last; \
            const T *v = v_cache + table[t / block_size] * block_stride + at * token_stride + head;           \
            for (; t < end; t++, v += token_stride) {                                                         \
                wide_t row[WIDE_PASS];                                                                        \
                _Pragma("GCC unroll 8") for (int c = 0; c < PASS; c++) row[c] = LOADW(v + WIDE_LANES * c);    \
                _Pragma("GCC unroll 8") for (int b = 0; b < QB; b++) {                                        \
                    const wide_t weight = wide_set1(p[b * n + t - lo]);                                       \
                    _Pragma("GCC unroll 8") for (int c = 0; c < PASS; c++)                                    \
                        o[b][c] = wide_fmadd(weight, row[c], o[b][c]);                                        \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int b = 0; b < QB; b++)                                                  \
            _Pragma("GCC unroll 8") for (int c = 0; c < PASS; c++)                                            \
                wide_storeu(out + b * head_dim + WIDE_LANES * c, o[b][c]);                                    \
    }                                                                                                         \
    static void NAME##_values(const T *v_cache, const int32_t *table, int64_t lo, int64_t hi, int64_t num_q,  \
                              int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,      \
                              int64_t token_stride, const float *scores, float *out, const int64_t *ranges) { \
        const int64_t n = hi - lo, chunks = head_dim / WIDE_LANES;                                            \
        const int blocked = chunks == 4 ? WIDE_QB4 : chunks % WIDE_PASS == 0 ? WIDE_QB8 : 1;                  \
        for (int64_t j0 = 0; j0 < num_q;) {                                                                   \
            const int64_t end = (j0 / group + 1) * group, left = end - j0;                                    \
            const int qb = left < blocked ? (int)left : blocked;                                              \
            int64_t first = hi, last = lo;                                                                    \
            for (int b = 0; b < qb; b++) {                                                                    \
                const int64_t a = lo + (ranges ? ranges[2 * (j0 + b)] : 0);                                   \
                const int64_t z = lo + (ranges ? ranges[2 * (j0 + b) + 1] : n);                               \
                first = a < first ? a : first, last = z > last ? z : last;                                    \
            }                                                                                                 \
            for (int64_t c0 = 0; c0 < chunks; c0 += WIDE_PASS) {                                              \
                const int64_t head = (j0 / group) * head_dim + WIDE_LANES * c0;                               \
                const int pass = chunks - c0 < WIDE_PASS ? (int)(chunks - c0) : WIDE_PASS;                    \
                const float *p = scores + j0 * n;                                                             \
                float *o = out + j0 * head_dim + WIDE_LANES * c0;                                             \
                if (pass == 4 && blocked == WIDE_QB4)                                                         \
                    switch (qb) { /* constant counts (qb <= WIDE_QB4): the sums stay in registers */          \
                    case 1: NAME##_pass(4, 1, v_cache, table, lo, first, last, head, block_size,              \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    case 2: NAME##_pass(4, 2, v_cache, table, lo, first, last, head, block_size,              \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    case 3: NAME##_pass(4, 3, v_cache, table, lo, first, last, head, block_size,              \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    case 4: NAME##_pass(4, 4, v_cache, table, lo, first, last, head, block_size,              \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    case 5: NAME##_pass(4, 5, v_cache, table, lo, first, last, head, block_size,              \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    default: NAME##_pass(4, 6, v_cache, table, lo, first, last, head, block_size,             \
                                        block_stride, token_stride, p, n, o, head_dim); break;                \
                    }                                                                                         \
                else if (pass == WIDE_PASS && qb == WIDE_QB8)                                                 \
                    NAME##_pass(WIDE_PASS, WIDE_QB8, v_cache, table, lo, first, last, head, block_size,       \
                                block_stride, token_stride, p, n, o, head_dim);                               \
                else if (pass == WIDE_PASS)                                                                   \
                    NAME##_pass(WIDE_PASS, 1, v_cache, table, lo, first, last, head, block_size, block_stride, \
                                token_stride, p, n, o, head_dim);                                             \
                else                                                                                          \
                    NAME##_pass(pass, 1, v_cache, table, lo, first, last, head, block_size, block_stride,  \
                                token_stride, p, n, o, head_dim);                                             \
            }                                                                                                 \
            j0 += qb;                                                                                         \
        }                                                                                                     \
    }
DEFINE_WIDE(attend_f32, float, wide_loadu)
DEFINE_WIDE(attend_bf16, bf16, wide_load_bf16)
#else /* `wide` is 0: never called */
#define attend_f32_scores(...) ((void)0)
#define attend_f32_values(...) ((void)0)
#define attend_bf16_scores(...) ((void)0)
#define attend_bf16_values(...) ((void)0)
#endif

#endif
