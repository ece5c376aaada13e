/* Causal attention of a prompt chunk on CPU (float32), flash style: each task takes one query head's block of
   queries through the keys in blocks, keeping a running maximum and sum per query (an online softmax), so that no
   score matrix is stored and no block past a query block's last key is computed (SDPA's CPU kernel computes whole
   512-key blocks, twice a 512-token prompt's causal work). Built on first use by kernels/cpu/build.py, called from
   kernels/cpu/attention.py; AVX2/FMA or AVX-512 only, elsewhere SDPA serves. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "fast_exp.h"
#include "isa.h"

#if STRATA_AVX2
#if STRATA_AVX512F
#define LANES 16
typedef __m512 vec_t;
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_set1 _mm512_set1_ps
#define vec_add _mm512_add_ps
#define vec_fmadd _mm512_fmadd_ps
#else
#define LANES 8
typedef __m256 vec_t;
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_set1 _mm256_set1_ps
#define vec_add _mm256_add_ps
#define vec_fmadd _mm256_fmadd_ps
#endif

#define NR (2 * LANES) /* keys (scores) or head dimensions (output) of one tile: two registers */
#define MR 6           /* queries of one tile: twelve accumulators */
#define QB 48          /* queries of one task: eight tiles of rows */
#define KB 128         /* keys of one pass: the task's QB x KB scores, 24 KiB, stay in L1 */

/* c[m][0..NR) (+)= sum over k < kc of a[m * lda + k] * b[k * ldb + 0..NR), for the first mr of MR rows. */
static inline __attribute__((always_inline)) void tile(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                       int64_t kc, float *c, int64_t ldc, const int mr,
                                                       const int accumulate) {
    vec_t c00 = vec_zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
          c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define STEP(i)                                          \
    if (mr > i) {                                        \
        const vec_t x = vec_set1(a[i * lda + k]);        \
        c##i##0 = vec_fmadd(x, b0, c##i##0);             \
        c##i##1 = vec_fmadd(x, b1, c##i##1);             \
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const vec_t b0 = vec_load(b + k * ldb), b1 = vec_load(b + k * ldb + LANES);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
#undef STEP
    const vec_t acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int m = 0; m < mr; m++) {
        float *row = c + m * ldc;
        vec_t y0 = acc[m][0], y1 = acc[m][1];
        if (accumulate) {
            y0 = vec_add(vec_load(row), y0);
            y1 = vec_add(vec_load(row + LANES), y1);
        }
        vec_store(row, y0);
        vec_store(row + LANES, y1);
    }
}

#define DEFINE_TILE(MRC)                                                                                        \
    static void tile_##MRC(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kc, float *c,      \
                           int64_t ldc, int accumulate) {                                                       \
        tile(a, lda, b, ldb, kc, c, ldc, MRC, accumulate);                                                      \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int);
static const tile_fn TILES[MR + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

typedef struct {
    const float *q;
    int64_t q_stride;    /* elements between tokens' rows */
    const float *keys_t; /* [kv heads][key panels][head_dim][NR]: keys transposed, zero past the last */
    const float *values; /* [kv heads][keys][head_dim]: each head's values contiguous (rows a qkv output apart
                            fall in one L1 set, and a block's 128 of them thrashed it) */
    int64_t queries, offset, panels, heads, group, head_dim;
    float scale;
    float *out; /* [queries][heads][head_dim] */
    int causal; /* 0: every query sees every key (encoders) */
} problem_t;

/* Scores of rows r0 .. r0 + rows of the block against keys j0 .. j0 + kc (whole panels), into s [QB][KB]. */
static void scores(const problem_t *p, int64_t h, int64_t r0, int64_t rows, int64_t j0, int64_t kc, float *s) {
    const float *keys = p->keys_t + (h / p->group) * p->panels * p->head_dim * NR;
    for (int64_t j = 0; j < kc; j += NR)
        for (int64_t m = 0; m < rows; m += MR) {
            const int mr = rows - m < MR ? (int)(rows - m) : MR;
            TILES[mr](p->q + (r0 + m) * p->q_stride + h * p->head_dim, p->q_stride,
                      keys + (j0 + j) / NR * p->head_dim * NR, NR, p->head_dim, s + m * KB + j, KB, 0);
        }
}

/* Rows r0 .. r0 + rows of query head h (query r sees keys 0 .. offset + r): out = softmax(q k^T scale) v. */
static void task(const problem_t *p, int64_t h, int64_t r0, int64_t rows, float *s, float *acc, float *top,
                 float *total) {
    const int64_t d = p->head_dim, keys = p->offset + p->queries;
    const int64_t last_key = p->causal ? p->offset + r0 + rows : keys; /* keys 0 .. last_key - 1 are seen */
    const float *v = p->values + (h / p->group) * keys * d;
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.f;
    memset(acc, 0, sizeof(float) * (size_t)(rows * d));
    for (int64_t j0 = 0; j0 < last_key; j0 += KB) {
        const int64_t kc = last_key - j0 < KB ? last_key - j0 : KB, panels_kc = (kc + NR - 1) / NR * NR;
        scores(p, h, r0, rows, j0, panels_kc, s);
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * KB;
            int64_t seen = p->causal ? p->offset + r0 + r + 1 - j0 : kc; /* keys of this block row r sees */
            seen = seen < 0 ? 0 : seen > kc ? kc : seen;
            float highest = -INFINITY;
#pragma omp simd reduction(max : highest)
            for (int64_t j = 0; j < seen; j++) highest = sr[j] > highest ? sr[j] : highest;
            const float block_top = seen && highest * p->scale > top[r] ? highest * p->scale : top[r];
            const float rescale = fast_exp(top[r] - block_top), scale = p->scale;
#pragma omp simd
            for (int64_t j = 0; j < seen; j++) sr[j] = sr[j] * scale - block_top;
            fast_exp_in_place(sr, seen);
            for (int64_t j = seen; j < kc; j++) sr[j] = 0.f;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < seen; j++) sum += sr[j];
            top[r] = block_top;
            total[r] = total[r] * rescale + sum;
            if (rescale != 1.f)
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= rescale;
        }
        for (int64_t c = 0; c < d; c += NR)
            for (int64_t m = 0; m < rows; m += MR) {
                const int mr = rows - m < MR ? (int)(rows - m) : MR;
                TILES[mr](s + m * KB, KB, v + j0 * d + c, d, kc, acc + m * d + c, d, 1);
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = p->out + ((r0 + r) * p->heads + h) * d;
        const float inverse = 1.f / total[r];
        for (int64_t i = 0; i < d; i++) o[i] = acc[r * d + i] * inverse;
    }
}
#endif

/* Whether this build has the kernel, and the head sizes it takes (a multiple of this; 0: none). */
int prefill_attention_head_multiple(void) {
#if STRATA_AVX2
    return NR;
#else
    return 0;
#endif
}

/* out [queries, heads, head_dim] = causal attention of queries q [queries, heads, head_dim] (rows q_stride
   apart) over keys / values [offset + queries, kv_heads, head_dim] (rows kv_stride apart): query r sits at
   position offset + r and sees keys 0 .. offset + r; scale (> 0: the running maximum is taken before it
   multiplies) multiplies the scores. Returns 0, -1 when scratch memory ran out, -2 when this
   build or head size is not served. */
int causal_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                             int64_t queries, int64_t offset, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             float scale, float *out, int num_threads) {
#if STRATA_AVX2
    if (head_dim % NR || heads % kv_heads) return -2;
    const int64_t keys = offset + queries, panels = (keys + NR - 1) / NR;
    float *keys_t = aligned_alloc(64, (sizeof(float) * (size_t)(kv_heads * (panels * NR + keys) * head_dim) + 63)
                                          / 64 * 64);
    if (!keys_t) return -1;
    float *values = keys_t + kv_heads * panels * NR * head_dim;
    const problem_t p = {q, q_stride, keys_t, values, queries, offset, panels, heads, heads / kv_heads, head_dim,
                         scale, out, 1};
    const int64_t blocks = (queries + QB - 1) / QB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t hp = 0; hp < kv_heads * panels; hp++) {
            const int64_t h = hp / panels, j0 = hp % panels * NR;
            float *panel = keys_t + hp * head_dim * NR;
            for (int64_t n = 0; n < NR; n++)
                for (int64_t i = 0; i < head_dim; i++)
                    panel[i * NR + n] = j0 + n < keys ? k[(j0 + n) * kv_stride + h * head_dim + i] : 0.f;
        }
#pragma omp for schedule(static)
        for (int64_t hj = 0; hj < kv_heads * keys; hj++)
            memcpy(values + hj * head_dim, v + hj % keys * kv_stride + hj / keys * head_dim,
                   sizeof(float) * (size_t)head_dim);
        float *s = malloc(sizeof(float) * (size_t)(QB * KB + QB * head_dim + 2 * QB));
        if (!s) failed = 1;
        /* Latest query blocks first: they see the most keys, so the threads finish together. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < blocks * heads; t++) {
            const int64_t b = blocks - 1 - t / heads, h = t % heads, r0 = b * QB;
            const int64_t rows = queries - r0 < QB ? queries - r0 : QB;
            float *acc = s + QB * KB, *top = acc + QB * head_dim;
            if (s) task(&p, h, r0, rows, s, acc, top, top + QB);
        }
        free(s);
    }
    free(keys_t);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)queries, (void)offset, (void)heads;
    (void)kv_heads, (void)head_dim, (void)scale, (void)out, (void)num_threads;
    return -2;
#endif
}

/* Bidirectional attention of packed sequences (encoders): sequence i holds tokens starts[i] .. starts[i + 1] - 1
   of q [tokens, heads, head_dim] (rows q_stride apart) and k / v [tokens, kv_heads, head_dim] (rows kv_stride
   apart), and its queries see its own keys only, all of them. No padding: each sequence's keys are transposed
   into panels once, and the tasks are (sequence, query block, head), longest sequences first. out [tokens, heads,
   head_dim]. Returns as causal_prefill_attention does. */
int varlen_bidirectional_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                                   int64_t kv_stride, const int64_t *starts, int64_t num_seqs, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, float scale, float *out, int num_threads) {
#if STRATA_AVX2
    if (head_dim % NR || heads % kv_heads) return -2;
    int64_t total_panels = 0, total_blocks = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        total_panels += (starts[i + 1] - starts[i] + NR - 1) / NR;
        total_blocks += (starts[i + 1] - starts[i] + QB - 1) / QB;
    }
    const int64_t tokens = starts[num_seqs] - starts[0];
    float *keys_t = aligned_alloc(64, (sizeof(float) * (size_t)(kv_heads * (total_panels * NR + tokens) * head_dim)
                                       + 63) / 64 * 64);
    problem_t *problems = malloc(sizeof(problem_t) * (size_t)num_seqs);
    int64_t *blocks = malloc(sizeof(int64_t) * (size_t)(2 * total_blocks)); /* (sequence, first row) */
    if (!keys_t || !problems || !blocks) return free(keys_t), free(problems), free(blocks), -1;
    /* Sequence i's panels [kv_heads][panels][head_dim][NR] and values [kv_heads][len][head_dim] lie as a whole
       prompt's do in causal_prefill_attention, one sequence after another. */
    float *values = keys_t + kv_heads * total_panels * NR * head_dim;
    for (int64_t i = 0, panel = 0, b = 0; i < num_seqs; i++) {
        const int64_t len = starts[i + 1] - starts[i], panels = (len + NR - 1) / NR;
        problems[i] = (problem_t){q + starts[i] * q_stride, q_stride, keys_t + panel * kv_heads * head_dim * NR,
                                  values + (starts[i] - starts[0]) * kv_heads * head_dim, len, 0, panels, heads,
                                  heads / kv_heads, head_dim, scale, out + (starts[i] - starts[0]) * heads * head_dim,
                                  0};
        panel += panels;
        for (int64_t r0 = 0; r0 < len; r0 += QB, b++) blocks[2 * b] = i, blocks[2 * b + 1] = r0;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        for (int64_t i = 0; i < num_seqs; i++) { /* transposed keys and per-head values, as the causal kernel's */
            const problem_t *p = &problems[i];
            const float *ki = k + starts[i] * kv_stride, *vi = v + starts[i] * kv_stride;
#pragma omp for schedule(static) nowait
            for (int64_t hp = 0; hp < kv_heads * p->panels; hp++) {
                const int64_t h = hp / p->panels, j0 = hp % p->panels * NR;
                float *panel = (float *)p->keys_t + hp * head_dim * NR;
                for (int64_t n = 0; n < NR; n++)
                    for (int64_t c = 0; c < head_dim; c++)
                        panel[c * NR + n] = j0 + n < p->queries ? ki[(j0 + n) * kv_stride + h * head_dim + c] : 0.f;
            }
#pragma omp for schedule(static) nowait
            for (int64_t hj = 0; hj < kv_heads * p->queries; hj++)
                memcpy((float *)p->values + hj * head_dim, vi + hj % p->queries * kv_stride + hj / p->queries * head_dim,
                       sizeof(float) * (size_t)head_dim);
        }
#pragma omp barrier
        float *s = malloc(sizeof(float) * (size_t)(QB * KB + QB * head_dim + 2 * QB));
        if (!s) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < total_blocks * heads; t++) {
            const int64_t b = t / heads, h = t % heads;
            const problem_t *p = &problems[blocks[2 * b]];
            const int64_t r0 = blocks[2 * b + 1], rows = p->queries - r0 < QB ? p->queries - r0 : QB;
            float *acc = s + QB * KB, *top = acc + QB * head_dim;
            if (s) task(p, h, r0, rows, s, acc, top, top + QB);
        }
        free(s);
    }
    free(keys_t), free(problems), free(blocks);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)starts, (void)num_seqs, (void)heads;
    (void)kv_heads, (void)head_dim, (void)scale, (void)out, (void)num_threads;
    return -2;
#endif
}

STRATA_ABI_EXPORT(prefill_attention)
