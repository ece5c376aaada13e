/* Decode attention read in place from the paged KV cache (CPU, float32 or bfloat16 with float32 math): one
   query token per sequence. Built on first use by strata/kernels/cpu/build.py, called through
   strata/kernels/cpu/attention.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "bf16.h"
#include "fast_exp.h"
#include "isa.h"

typedef uint16_t bf16;

/* Soft-capping (Gemma 2) of one head's n scores: s = cap * tanh(s / cap). Applied only when a layer has a cap,
   as a pass of its own, so that uncapped layers keep the plain score loop. */
static void soft_cap(float *s, int64_t n, float cap) {
    const float inverse = 1.f / cap;
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] * inverse);
}

/* Each query head's scores (n of them from `scores`) as softmax weights: soft-capped first when softcap > 0; a
   head's sink logit (sinks, else NULL) joins its softmax as an extra column whose weight is dropped (gpt-oss).
   With `stats` (else NULL), each head's largest score and its sum of exponentials go to stats[2j], stats[2j + 1]:
   a slice of the keys, normalized on its own, that split_merge later weighs against the other slices. */
static void softmax_rows(float *scores, int64_t n, int64_t num_q, float softcap, const float *sinks, float *stats) {
    for (int64_t j = 0; j < num_q; j++) {
        float *s = scores + j * n;
        if (softcap > 0.f) soft_cap(s, n, softcap);
        float top = s[0], total = 0.f;
        for (int64_t i = 1; i < n; i++) top = s[i] > top ? s[i] : top;
        if (sinks && sinks[j] > top) top = sinks[j];
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) s[i] -= top;
        fast_exp_in_place(s, n);
        _Pragma("omp simd reduction(+ : total)") for (int64_t i = 0; i < n; i++) total += s[i];
        if (sinks) total += fast_exp(sinks[j] - top);
        if (stats) stats[2 * j] = top, stats[2 * j + 1] = total;
        for (int64_t i = 0; i < n; i++) s[i] /= total;
    }
}

/* Heads of up to this many dimensions (a multiple of WIDE_LANES) take the AVX-512 or AVX2 loops below, where
   there are, written once over the vector vocabulary each defines. */
#define WIDE_HEAD_DIM 256 /* Gemma 3's heads; wider ones (none served yet) take the scalar loops */
#define WIDE_PASS 8 /* vectors of one head's output kept in registers over the tokens: a pass of the value loop */
#if STRATA_AVX512F
#define WIDE_ATTENTION 1
#define WIDE_LANES 16
#define WIDE_CHAINS 2 /* even and odd tokens' output sums: twice the chains of FMAs */
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
#define WIDE_CHAINS 1 /* WIDE_PASS sums already fill half of AVX2's 16 registers */
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

/* One sequence's KV heads [h0, h0 + num_kv) and their query heads attend keys [lo, hi). Whole token rows
   (all those heads at once) are read in cache order: a row per head would jump a page per token and leave
   the hardware prefetcher idle. `scores` holds num_kv * group * (hi - lo) floats; q and out are float32.
   With AVX-512 (AVX2) and heads of at most WIDE_HEAD_DIM dimensions, scores come 16 (8) tokens at a time (their dot
   products reduced together) and each head's output stays in registers over the tokens, WIDE_PASS vectors a pass. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                                          \
    static void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t lo,     \
                     int64_t hi, int64_t num_kv, int64_t group, int64_t head_dim, int64_t block_size,          \
                     int64_t block_stride, int64_t token_stride, float scale, float softcap,                  \
                     const float *sinks, float *scores, float *out, float *stats) {                           \
        const int64_t n = hi - lo, num_q = num_kv * group;                                                    \
        const int wide = WIDE_ATTENTION && head_dim % WIDE_LANES == 0 && head_dim <= WIDE_HEAD_DIM;           \
        if (wide)                                                                                             \
            NAME##_scores(q, k_cache, table, lo, hi, num_q, group, head_dim, block_size, block_stride,        \
                          token_stride, scale, scores);                                                       \
        else                                                                                                  \
            for (int64_t t = lo; t < hi; t++) {                                                               \
                const T *k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride; \
                for (int64_t j = 0; j < num_q; j++) {                                                         \
                    const float *qj = q + j * head_dim;                                                       \
                    const T *kj = k + (j / group) * head_dim;                                                 \
                    float acc = 0.f;                                                                          \
                    _Pragma("omp simd reduction(+ : acc)") for (int64_t d = 0; d < head_dim; d++)             \
                        acc += qj[d] * LOAD(kj[d]);                                                           \
                    scores[j * n + t - lo] = scale * acc;                                                     \
                }                                                                                             \
            }                                                                                                 \
        softmax_rows(scores, n, num_q, softcap, sinks, stats);                                                \
        if (wide) {                                                                                           \
            NAME##_values(v_cache, table, lo, hi, num_q, group, head_dim, block_size, block_stride,           \
                          token_stride, scores, out);                                                         \
            return;                                                                                           \
        }                                                                                                     \
        for (int64_t d = 0; d < num_q * head_dim; d++) out[d] = 0.f;                                          \
        for (int64_t t = lo; t < hi; t++) {                                                                   \
            const T *v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;   \
            for (int64_t j = 0; j < num_q; j++) {                                                             \
                float *oj = out + j * head_dim;                                                               \
                const T *vj = v + (j / group) * head_dim;                                                     \
                const float p = scores[j * n + t - lo];                                                       \
                _Pragma("omp simd") for (int64_t d = 0; d < head_dim; d++) oj[d] += p * LOAD(vj[d]);          \
            }                                                                                                 \
        }                                                                                                     \
    }

#if WIDE_ATTENTION
/* The vector score and value loops of DEFINE_ATTEND: a tile of WIDE_LANES tokens' key rows found once for all heads. */
#define DEFINE_WIDE(NAME, T, LOADW)                                                                           \
    static void NAME##_scores(const float *q, const T *k_cache, const int32_t *table, int64_t lo, int64_t hi,  \
                              int64_t num_q, int64_t group, int64_t head_dim, int64_t block_size,             \
                              int64_t block_stride, int64_t token_stride, float scale, float *scores) {       \
        const int64_t n = hi - lo, chunks = head_dim / WIDE_LANES;                                            \
        for (int64_t t0 = lo; t0 < hi; t0 += WIDE_LANES) {                                                    \
            const int count = hi - t0 < WIDE_LANES ? (int)(hi - t0) : WIDE_LANES;                             \
            const T *rows[WIDE_LANES];                                                                        \
            for (int s = 0; s < WIDE_LANES; s++) {                                                            \
                const int64_t t = t0 + WIDE_SLOT(s);                                                          \
                rows[s] = t < hi ? k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride \
                                 : NULL;                                                                      \
            }                                                                                                 \
            for (int64_t j = 0; j < num_q; j++) {                                                             \
                const float *qj = q + j * head_dim;                                                           \
                const int64_t head = (j / group) * head_dim;                                                  \
                wide_t acc[WIDE_LANES];                                                                       \
                for (int s = 0; s < WIDE_LANES; s++) {                                                        \
                    acc[s] = wide_zero();                                                                     \
                    if (rows[s])                                                                              \
                        for (int64_t c = 0; c < chunks; c++)                                                  \
                            acc[s] = wide_fmadd(wide_loadu(qj + WIDE_LANES * c),                              \
                                                LOADW(rows[s] + head + WIDE_LANES * c), acc[s]);              \
                }                                                                                             \
                float lanes[WIDE_LANES];                                                                      \
                wide_storeu(lanes, wide_mul(wide_sum(acc), wide_set1(scale)));                                \
                memcpy(scores + j * n + t0 - lo, lanes, sizeof(float) * (size_t)count);                       \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    static void NAME##_values(const T *v_cache, const int32_t *table, int64_t lo, int64_t hi, int64_t num_q,   \
                              int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,      \
                              int64_t token_stride, const float *scores, float *out) {                        \
        const int64_t n = hi - lo, chunks = head_dim / WIDE_LANES;                                            \
        for (int64_t j = 0; j < num_q; j++) {                                                                 \
            const float *p = scores + j * n;                                                                  \
            for (int64_t c0 = 0; c0 < chunks; c0 += WIDE_PASS) {                                              \
                const int64_t head = (j / group) * head_dim + WIDE_LANES * c0;                                \
                const int pass = chunks - c0 < WIDE_PASS ? (int)(chunks - c0) : WIDE_PASS;                    \
                wide_t o[WIDE_CHAINS][WIDE_PASS];                                                             \
                for (int k = 0; k < WIDE_CHAINS; k++)                                                         \
                    for (int c = 0; c < WIDE_PASS; c++) o[k][c] = wide_zero();                                \
                for (int64_t t = lo; t < hi; t++) {                                                           \
                    const T *v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride \
                                 + head;                                                                      \
                    const wide_t weight = wide_set1(p[t - lo]);                                               \
                    for (int c = 0; c < pass; c++)                                                            \
                        o[t % WIDE_CHAINS][c] = wide_fmadd(weight, LOADW(v + WIDE_LANES * c), o[t % WIDE_CHAINS][c]); \
                }                                                                                             \
                for (int c = 0; c < pass; c++) {                                                              \
                    wide_t sum = o[0][c];                                                                     \
                    for (int k = 1; k < WIDE_CHAINS; k++) sum = wide_add(sum, o[k][c]);                       \
                    wide_storeu(out + j * head_dim + WIDE_LANES * (c0 + c), sum);                             \
                }                                                                                             \
            }                                                                                                 \
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

#define LOAD_F32(x) (x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16, bf16, bf16_to_f32)

/* How many slices of their keys the sequences' attention is cut into: one, unless there are fewer work items
   (sequence, KV heads) than twice the threads, as in batch-1 decode of a model with one or two KV heads (Gemma 3
   270M: one), where the other threads would idle through the whole attention. A slice keeps at least
   MIN_SPLIT_KEYS keys, so that short contexts, where the merge would cost what it saves, take one. */
#define MIN_SPLIT_KEYS 128
#define MAX_SPLITS 16
static int64_t key_splits(int64_t items, const int32_t *first_keys, const int32_t *seq_lens, int64_t num_seqs,
                          int num_threads) {
    if (items >= 2 * num_threads) return 1;
    int64_t fewest = seq_lens[0] - first_keys[0];
    for (int64_t s = 1; s < num_seqs; s++)
        fewest = seq_lens[s] - first_keys[s] < fewest ? seq_lens[s] - first_keys[s] : fewest;
    int64_t splits = (2 * num_threads + items - 1) / items;
    splits = splits > fewest / MIN_SPLIT_KEYS ? fewest / MIN_SPLIT_KEYS : splits;
    return splits > MAX_SPLITS ? MAX_SPLITS : splits < 1 ? 1 : splits;
}

/* Query head j of sequence s from its key slices: each slice's output was normalized by its own sum of
   exponentials (relative to its own top score); weighing each by that sum at the common top gives the softmax over
   all the keys (and the head's sink logit, if any, joins the denominator here). */
static void split_merge(const float *partial, const float *stats, int64_t s, int64_t j, int64_t splits,
                        int64_t num_heads, int64_t head_dim, const float *sinks, int is_bf16, void *out) {
    float top = -INFINITY, weight[MAX_SPLITS], total = 0.f;
    for (int64_t p = 0; p < splits; p++) {
        const float slice_top = stats[2 * ((s * splits + p) * num_heads + j)];
        top = slice_top > top ? slice_top : top;
    }
    if (sinks && sinks[j] > top) top = sinks[j];
    for (int64_t p = 0; p < splits; p++) {
        const float *st = stats + 2 * ((s * splits + p) * num_heads + j);
        weight[p] = st[1] * expf(st[0] - top);
        total += weight[p];
    }
    if (sinks) total += expf(sinks[j] - top);
    for (int64_t d = 0; d < head_dim; d++) {
        float sum = 0.f;
        for (int64_t p = 0; p < splits; p++)
            sum += weight[p] * partial[((s * splits + p) * num_heads + j) * head_dim + d];
        const int64_t at = (s * num_heads + j) * head_dim + d;
        if (is_bf16)
            ((bf16 *)out)[at] = f32_to_bf16(sum / total);
        else
            ((float *)out)[at] = sum / total;
    }
}

/* q, out: [num_seqs, num_heads, head_dim]; caches: [blocks, block_size, num_kv_heads, head_dim]. `mode` says the
   dtypes: 0, all float32; 1, all bfloat16; 2, bfloat16 caches with float32 q, out and new keys and values (a float32
   model's cache under kv_cache_dtype=bfloat16: the new rows are rounded as torch rounds them on a cache write).
   block_tables: [num_seqs, max_blocks]; sequence s attends keys first_keys[s] .. seq_lens[s] - 1. Work items are
   (sequence, slice of KV heads): whole sequences when there are enough of them to share among the threads, thinner
   slices for small batches, and slices of the keys too when even that leaves threads idle (key_splits).
   With new_k / new_v (else NULL), the step's keys and values (num_seqs rows of num_kv_heads * head_dim values,
   rows `new_stride` elements apart) are first written to the cache at `slots`, so that a decode step's write
   and read are one call. softcap > 0 (else 0) soft-caps the scores; sinks (else NULL): float32 [num_heads], one
   extra softmax logit per query head. Returns 0, or -1 when scratch memory ran out. */
int scored_decode_attention(const void *q, void *k_cache, void *v_cache, const int32_t *block_tables,
                            const int32_t *first_keys, const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            float scale, void *out, int num_threads, int mode, const void *new_k,
                            const void *new_v, int64_t new_stride, const int64_t *slots, float softcap,
                            const float *sinks) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int is_bf16 = mode == 1, bf16_cache = mode != 0;
    if (new_k && mode == 2) {
        for (int64_t s = 0; s < num_seqs; s++) {
            bf16 *k = (bf16 *)k_cache + slots[s] * token_stride, *v = (bf16 *)v_cache + slots[s] * token_stride;
            const float *nk = (const float *)new_k + s * new_stride, *nv = (const float *)new_v + s * new_stride;
            for (int64_t i = 0; i < token_stride; i++) k[i] = f32_to_bf16(nk[i]), v[i] = f32_to_bf16(nv[i]);
        }
    } else if (new_k) {
        const size_t size = is_bf16 ? 2 : 4, row = (size_t)token_stride * size;
        for (int64_t s = 0; s < num_seqs; s++) {
            memcpy((char *)k_cache + slots[s] * row, (const char *)new_k + s * new_stride * size, row);
            memcpy((char *)v_cache + slots[s] * row, (const char *)new_v + s * new_stride * size, row);
        }
    }
    int64_t slices = (4 * num_threads + num_seqs - 1) / num_seqs;
    slices = slices > num_kv_heads ? num_kv_heads : slices;
    const int64_t per_slice = (num_kv_heads + slices - 1) / slices;
    slices = (num_kv_heads + per_slice - 1) / per_slice;
    const int64_t splits = key_splits(num_seqs * slices, first_keys, seq_lens, num_seqs, num_threads);
    float *partial = NULL; /* splits > 1: each split's float32 output [num_seqs, splits, num_heads, head_dim] */
    if (splits > 1) {
        partial = malloc(sizeof(float) * (size_t)(num_seqs * splits * num_heads * (head_dim + 2)));
        if (partial == NULL) return -1;
    }
    /* then each split's (top score, sum of exponentials) of every head */
    float *stats = partial ? partial + num_seqs * splits * num_heads * head_dim : NULL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t capacity = 0;
        float *scratch = NULL; /* scores, then (bfloat16 only) q and out in float32 */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * slices * splits; item++) {
            const int64_t s = item / (slices * splits), h0 = item / splits % slices * per_slice, part = item % splits;
            const int64_t num_kv = h0 + per_slice > num_kv_heads ? num_kv_heads - h0 : per_slice;
            const int64_t first = first_keys[s], keys = seq_lens[s] - first, width = num_kv * group * head_dim;
            const int64_t lo = first + keys * part / splits, hi = first + keys * (part + 1) / splits;
            const int64_t need = num_kv * group * (hi - lo) + (is_bf16 ? 2 * width : 0);
            if (need > capacity) {
                free(scratch);
                capacity = need;
                scratch = malloc(capacity * sizeof(float));
                if (scratch == NULL) {
                    capacity = 0;
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
            }
            const int64_t head = (s * num_heads + h0 * group) * head_dim, kv = h0 * head_dim;
            const int64_t row = (s * splits + part) * num_heads + h0 * group;
            float *split_out = partial ? partial + row * head_dim : NULL;
            float *split_stats = partial ? stats + 2 * row : NULL;
            const int32_t *table = block_tables + s * max_blocks;
            /* a split sequence's sinks join at the merge */
            const float *head_sinks = sinks && !partial ? sinks + h0 * group : NULL;
            if (!is_bf16) {
                float *dest = split_out ? split_out : (float *)out + head;
                if (bf16_cache)
                    attend_bf16((const float *)q + head, (const bf16 *)k_cache + kv, (const bf16 *)v_cache + kv,
                                table, lo, hi, num_kv, group, head_dim, block_size, block_stride, token_stride, scale,
                                softcap, head_sinks, scratch, dest, split_stats);
                else
                    attend_f32((const float *)q + head, (const float *)k_cache + kv, (const float *)v_cache + kv,
                               table, lo, hi, num_kv, group, head_dim, block_size, block_stride, token_stride, scale,
                               softcap, head_sinks, scratch, dest, split_stats);
                continue;
            }
            float *q32 = scratch + (need - 2 * width), *out32 = split_out ? split_out : q32 + width;
            for (int64_t i = 0; i < width; i++) q32[i] = bf16_to_f32(((const bf16 *)q)[head + i]);
            attend_bf16(q32, (const bf16 *)k_cache + kv, (const bf16 *)v_cache + kv, table, lo, hi, num_kv, group,
                        head_dim, block_size, block_stride, token_stride, scale, softcap, head_sinks, scratch, out32,
                        split_stats);
            if (!split_out)
                for (int64_t i = 0; i < width; i++) ((bf16 *)out)[head + i] = f32_to_bf16(out32[i]);
        }
        free(scratch);
        if (partial) { /* the omp for above ended on a barrier: every split is in */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < num_seqs * num_heads; row++)
                split_merge(partial, stats, row / num_heads, row % num_heads, splits, num_heads, head_dim, sinks,
                            is_bf16, out);
        }
    }
    free(partial);
    return failed ? -1 : 0;
}

/* Zero blocks `blocks[0..n_blocks)` ([block_bytes] each) of every cache: the caches' fresh blocks of a step in one
   call instead of an index_fill_ per layer and cache. */
void zero_blocks(void *const *caches, int64_t n_caches, const int64_t *blocks, int64_t n_blocks,
                 int64_t block_bytes) {
    for (int64_t c = 0; c < n_caches; c++)
        for (int64_t b = 0; b < n_blocks; b++)
            memset((char *)caches[c] + blocks[b] * block_bytes, 0, (size_t)block_bytes);
}

STRATA_ABI_EXPORT(cpu_attention)
