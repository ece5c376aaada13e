/* Decode attention read in place from the paged KV cache (CPU, float32): one query token per sequence.
   Built on first use by strata/native.py, called from strata/layers/cpu_attention.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline void add_scaled(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* One sequence's KV heads [h0, h0 + num_kv) and their query heads attend keys [lo, hi). Whole token rows
   (all those heads at once) are read in cache order: a row per head would jump a page per token and leave
   the hardware prefetcher idle. `scores` holds num_kv * group * (hi - lo) floats. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t lo,
                   int64_t hi, int64_t num_kv, int64_t group, int64_t head_dim, int64_t block_size,
                   int64_t block_stride, int64_t token_stride, float scale, float *scores, float *out) {
    const int64_t n = hi - lo, num_q = num_kv * group;
    for (int64_t t = lo; t < hi; t++) {
        const float *k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t j = 0; j < num_q; j++)
            scores[j * n + t - lo] = scale * dot(q + j * head_dim, k + (j / group) * head_dim, head_dim);
    }
    for (int64_t j = 0; j < num_q; j++) {
        float *s = scores + j * n, top = s[0], total = 0.f;
        for (int64_t i = 1; i < n; i++) top = s[i] > top ? s[i] : top;
        for (int64_t i = 0; i < n; i++) {
            s[i] = expf(s[i] - top);
            total += s[i];
        }
        for (int64_t i = 0; i < n; i++) s[i] /= total;
    }
    for (int64_t d = 0; d < num_q * head_dim; d++) out[d] = 0.f;
    for (int64_t t = lo; t < hi; t++) {
        const float *v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t j = 0; j < num_q; j++)
            add_scaled(out + j * head_dim, scores[j * n + t - lo], v + (j / group) * head_dim, head_dim);
    }
}

/* q, out: [num_seqs, num_heads, head_dim]; caches: [blocks, block_size, num_kv_heads, head_dim];
   block_tables: [num_seqs, max_blocks]; sequence s attends keys first_keys[s] .. seq_lens[s] - 1.
   Work items are (sequence, slice of KV heads): whole sequences when there are enough of them to share
   among the threads, thinner slices for small batches. Returns 0, or -1 when scratch memory ran out. */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                           const int32_t *first_keys, const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale, float *out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    int64_t slices = (4 * num_threads + num_seqs - 1) / num_seqs;
    slices = slices > num_kv_heads ? num_kv_heads : slices;
    const int64_t per_slice = (num_kv_heads + slices - 1) / slices;
    slices = (num_kv_heads + per_slice - 1) / per_slice;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t capacity = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * slices; item++) {
            const int64_t s = item / slices, h0 = item % slices * per_slice;
            const int64_t num_kv = h0 + per_slice > num_kv_heads ? num_kv_heads - h0 : per_slice;
            const int64_t lo = first_keys[s], hi = seq_lens[s], need = num_kv * group * (hi - lo);
            if (need > capacity) {
                free(scores);
                capacity = need;
                scores = malloc(capacity * sizeof(float));
                if (scores == NULL) {
                    capacity = 0;
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
            }
            const int64_t head = (s * num_heads + h0 * group) * head_dim;
            attend(q + head, k_cache + h0 * head_dim, v_cache + h0 * head_dim, block_tables + s * max_blocks, lo,
                   hi, num_kv, group, head_dim, block_size, block_stride, token_stride, scale, scores, out + head);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
