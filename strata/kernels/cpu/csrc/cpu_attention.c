/* Decode attention read in place from the paged KV cache (CPU, float32 or bfloat16 with float32 math): one
   query token per sequence, or a request's consecutive rows of a verification step read together
   (decode_attention_runs.h). Built on first use by strata/kernels/cpu/build.py, called through
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

/* The largest of s[0 .. n) (n >= 1), NaNs after the first value passed over (s[0] a NaN: NaN). */
static inline float largest(const float *s, int64_t n) {
    float top = s[0];
    int64_t i = 1;
#if STRATA_AVX512F
    __m512 tops = _mm512_set1_ps(top);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(s + i);
        tops = _mm512_mask_mov_ps(tops, _mm512_cmp_ps_mask(v, tops, _CMP_GT_OQ), v);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, tops);
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
#endif
    for (; i < n; i++) top = s[i] > top ? s[i] : top;
    return top;
}

/* Each query head's scores (`width` of them from `scores`) as softmax weights: soft-capped first when softcap > 0;
   a head's sink logit (sinks, else NULL) joins its softmax as an extra column whose weight is dropped (gpt-oss).
   With `stats` (else NULL), each head's largest score and its sum of exponentials go to stats[2j], stats[2j + 1]:
   a slice of the keys, normalized on its own, that split_merge later weighs against the other slices. With
   `ranges` (else NULL), query j's keys are scores ranges[2j] .. ranges[2j + 1] - 1 of its row, the rest weigh 0. */
static void softmax_rows(float *scores, int64_t width, int64_t num_q, float softcap, const float *sinks,
                         float *stats, const int64_t *ranges) {
    for (int64_t j = 0; j < num_q; j++) {
        const int64_t a = ranges ? ranges[2 * j] : 0, b = ranges ? ranges[2 * j + 1] : width, n = b - a;
        float *s = scores + j * width + a;
        if (ranges) { /* this query's keys only: the others weigh nothing */
            memset(scores + j * width, 0, sizeof(float) * (size_t)a);
            memset(scores + j * width + b, 0, sizeof(float) * (size_t)(width - b));
        }
        if (softcap > 0.f) soft_cap(s, n, softcap);
        float top = largest(s, n), total = 0.f;
        if (sinks && sinks[j] > top) top = sinks[j];
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) s[i] -= top;
        fast_exp_in_place(s, n);
        _Pragma("omp simd reduction(+ : total)") for (int64_t i = 0; i < n; i++) total += s[i];
        if (sinks) total += fast_exp(sinks[j] - top);
        if (stats) stats[2 * j] = top, stats[2 * j + 1] = total;
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) s[i] /= total;
    }
}

#include "decode_attention_wide.h"

/* One sequence's KV heads [h0, h0 + num_kv) and their query heads attend keys [lo, hi). Whole token rows
   (all those heads at once) are read in cache order: a row per head would jump a page per token and leave
   the hardware prefetcher idle. `scores` holds num_kv * group * (hi - lo) floats; q and out are float32.
   With AVX-512 (AVX2) and heads of at most WIDE_HEAD_DIM dimensions, scores come 16 (8) tokens at a time (their dot
   products reduced together) and each head's output stays in registers over the tokens, WIDE_PASS vectors a pass. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                                          \
    static void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t lo,     \
                     int64_t hi, int64_t num_kv, int64_t group, int64_t head_dim, int64_t block_size,          \
                     int64_t block_stride, int64_t token_stride, float scale, float softcap,                  \
                     const float *sinks, float *scores, float *out, float *stats, const int64_t *ranges) {    \
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
        softmax_rows(scores, n, num_q, softcap, sinks, stats, ranges);                                        \
        if (wide) {                                                                                           \
            NAME##_values(v_cache, table, lo, hi, num_q, group, head_dim, block_size, block_stride,           \
                          token_stride, scores, out, ranges);                                                 \
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

#include "decode_attention_runs.h"

/* q, out: [num_seqs, num_heads, head_dim]; caches: [blocks, block_size, num_kv_heads, head_dim]. `mode` says the
   dtypes: 0, all float32; 1, all bfloat16; 2, bfloat16 caches with float32 q, out and new keys and values (a float32
   model's cache under kv_cache_dtype=bfloat16: the new rows are rounded as torch rounds them on a cache write).
   block_tables: [num_seqs, max_blocks]; sequence s attends keys first_keys[s] .. seq_lens[s] - 1. Work items are
   (run of rows, slice of KV heads): a run is one row, or a request's consecutive rows of a verification step, which
   read each key once for all of them (decode_attention_runs.h); whole runs when there are enough of them to share
   among the threads, thinner slices for small batches, and slices of the keys too when even that leaves threads
   idle (key_splits). With new_k / new_v (else NULL), the step's keys and values (num_seqs rows of
   num_kv_heads * head_dim values, rows `new_stride` elements apart) are first written to the cache at `slots`, so
   that a decode step's write and read are one call. softcap > 0 (else 0) soft-caps the scores; sinks (else NULL):
   float32 [num_heads], one extra softmax logit per query head. Returns 0, or -1 when scratch memory ran out. */
int scored_decode_attention(const void *q, void *k_cache, void *v_cache, const int32_t *block_tables,
                            const int32_t *first_keys, const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            float scale, void *out, int num_threads, int mode, const void *new_k,
                            const void *new_v, int64_t new_stride, const int64_t *slots, float softcap,
                            const float *sinks) {
    const int64_t token_stride = num_kv_heads * head_dim;
    if (new_k && mode == 2) {
        for (int64_t s = 0; s < num_seqs; s++) {
            bf16 *k = (bf16 *)k_cache + slots[s] * token_stride, *v = (bf16 *)v_cache + slots[s] * token_stride;
            const float *nk = (const float *)new_k + s * new_stride, *nv = (const float *)new_v + s * new_stride;
            for (int64_t i = 0; i < token_stride; i++) k[i] = f32_to_bf16(nk[i]), v[i] = f32_to_bf16(nv[i]);
        }
    } else if (new_k) {
        const size_t size = mode == 1 ? 2 : 4, row = (size_t)token_stride * size;
        for (int64_t s = 0; s < num_seqs; s++) {
            memcpy((char *)k_cache + slots[s] * row, (const char *)new_k + s * new_stride * size, row);
            memcpy((char *)v_cache + slots[s] * row, (const char *)new_v + s * new_stride * size, row);
        }
    }
    int64_t *run_first = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (run_first == NULL) return -1;
    const int64_t runs = find_runs(block_tables, seq_lens, num_seqs, max_blocks, block_size, run_first);
    int64_t slices = (4 * num_threads + runs - 1) / runs;
    slices = slices > num_kv_heads ? num_kv_heads : slices;
    const int64_t per_slice = (num_kv_heads + slices - 1) / slices;
    slices = (num_kv_heads + per_slice - 1) / per_slice;
    const int64_t splits = key_splits(runs * slices, first_keys, seq_lens, num_seqs, num_threads);
    float *partial = NULL; /* splits > 1: each split's float32 output [num_seqs, splits, num_heads, head_dim] */
    if (splits > 1) {
        partial = malloc(sizeof(float) * (size_t)(num_seqs * splits * num_heads * (head_dim + 2)));
        if (partial == NULL) {
            free(run_first);
            return -1;
        }
    }
    const decode_args_t args = {q, k_cache, v_cache, block_tables, first_keys, seq_lens, num_heads,
                                num_heads / num_kv_heads, head_dim, block_size, max_blocks,
                                block_size * token_stride, token_stride, splits, scale, softcap, sinks, out, partial,
                                /* then each split's (top score, sum of exponentials) of every head */
                                partial ? partial + num_seqs * splits * num_heads * head_dim : NULL, mode};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t capacity = 0;
        float *scratch = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < runs * slices * splits; item++) {
            const int64_t run = item / (slices * splits), h0 = item / splits % slices * per_slice;
            const int64_t s = run_first[run], rows = run_first[run + 1] - s;
            const int64_t num_kv = h0 + per_slice > num_kv_heads ? num_kv_heads - h0 : per_slice;
            const int64_t need = run_scratch_floats(&args, s, rows, num_kv, item % splits);
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
            attend_run(&args, s, rows, h0, num_kv, item % splits, scratch);
        }
        free(scratch);
        if (partial) { /* the omp for above ended on a barrier: every split is in */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < num_seqs * num_heads; row++)
                split_merge(partial, args.stats, row / num_heads, row % num_heads, splits, num_heads, head_dim, sinks,
                            mode == 1, out);
        }
    }
    free(partial);
    free(run_first);
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
