/* LoRA's shrink and expand for a decode step's few rows on CPU (float32): each row whose slot is not -1 adds
   scale * B (A x) of its slot's adapter to its base product in place. Rows are grouped by slot, so each adapter's A
   and B are read once a step however many rows use it; a fused layer's column blocks (q/k/v, gate/up) each expand
   into their own outputs only (strata/layers/lora.py's layout, with B kept transposed so that the expand streams
   contiguous outputs). Built on first use by kernels/cpu/build.py; called from decode_layer.c (through kernels_t)
   and strata/kernels/cpu/lora.py. */
#include <stdint.h>
#include <stdlib.h>

#include "abi.h"
#include "isa.h"

/* One linear layer's adapter slots: A [slots, width, in] (column block p at rows [p rank, (p + 1) rank)), B^T
   [slots, width, out]; block p's B columns reach outputs [block_rows[2p], block_rows[2p + 1]). Per slot: its
   adapter's rank, the rows of A in use (0: the slot adds nothing here) and its scale. */
typedef struct {
    const float *a, *bt;
    int64_t in_features, out_features, width, blocks, slots;
    const int64_t *block_rows, *ranks, *widths;
    const float *scales;
} lora_t;

#define GROUP 16            /* rows of one slot shrunk together: each A row is read once for all of them */
#define SPLIT 64            /* outputs of one expand task (16 tasks in 1024 outputs) */
#define THREADED_FLOATS 65536 /* the A and B floats a call reads from which it shares them among threads */

#if STRATA_AVX512F
#define VW 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(f) _mm512_set1_ps(f)
#define VSUM(v) _mm512_reduce_add_ps(v)
#elif STRATA_AVX2
#define VW 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(f) _mm256_set1_ps(f)
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define VW 1
typedef float vec;
#define VZERO() 0.f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VSET1(f) (f)
#define VSUM(v) (v)
#endif

/* out[r] = a . x[r] over k for N rows at once (their accumulators stay in registers while a streams by). */
#define DEFINE_DOTS(N)                                                                                         \
    static void dots_##N(const float *a, const float *const *x, int64_t k, float *out) {                      \
        vec acc[N];                                                                                            \
        for (int r = 0; r < N; r++) acc[r] = VZERO();                                                          \
        int64_t i = 0;                                                                                         \
        for (; i + VW <= k; i += VW) {                                                                         \
            const vec av = VLOAD(a + i);                                                                       \
            for (int r = 0; r < N; r++) acc[r] = VFMA(av, VLOAD(x[r] + i), acc[r]);                            \
        }                                                                                                      \
        for (int r = 0; r < N; r++) {                                                                          \
            float sum = VSUM(acc[r]);                                                                          \
            for (int64_t j = i; j < k; j++) sum += a[j] * x[r][j];                                             \
            out[r] = sum;                                                                                      \
        }                                                                                                      \
    }
DEFINE_DOTS(1)
DEFINE_DOTS(2)
DEFINE_DOTS(3)
DEFINE_DOTS(4)

/* t[r * stride] = scale * (a . x[r]) for the n rows of a group, four at a time. */
static void shrink_row(const float *a, const float *const *x, int n, int64_t k, float scale, float *t,
                       int64_t stride) {
    float out[4];
    for (int r0 = 0; r0 < n; r0 += 4) {
        const int m = n - r0 < 4 ? n - r0 : 4;
        if (m == 4) dots_4(a, x + r0, k, out);
        else if (m == 3) dots_3(a, x + r0, k, out);
        else if (m == 2) dots_2(a, x + r0, k, out);
        else dots_1(a, x + r0, k, out);
        for (int r = 0; r < m; r++) t[(r0 + r) * stride] = scale * out[r];
    }
}

/* y[j0, j1) += sum_c t[c] * bt[c][j0, j1) (bt's rows ld apart): four vectors of outputs at a time. */
static void expand_row(const float *t, const float *bt, int64_t ld, int64_t cols, int64_t j0, int64_t j1,
                       float *y) {
    int64_t j = j0;
    for (; j + 4 * VW <= j1; j += 4 * VW) {
        vec a0 = VLOAD(y + j), a1 = VLOAD(y + j + VW), a2 = VLOAD(y + j + 2 * VW), a3 = VLOAD(y + j + 3 * VW);
        for (int64_t c = 0; c < cols; c++) {
            const vec tc = VSET1(t[c]);
            const float *b = bt + c * ld + j;
            a0 = VFMA(tc, VLOAD(b), a0);
            a1 = VFMA(tc, VLOAD(b + VW), a1);
            a2 = VFMA(tc, VLOAD(b + 2 * VW), a2);
            a3 = VFMA(tc, VLOAD(b + 3 * VW), a3);
        }
        VSTORE(y + j, a0);
        VSTORE(y + j + VW, a1);
        VSTORE(y + j + 2 * VW, a2);
        VSTORE(y + j + 3 * VW, a3);
    }
    for (; j + VW <= j1; j += VW) {
        vec acc = VLOAD(y + j);
        for (int64_t c = 0; c < cols; c++) acc = VFMA(VSET1(t[c]), VLOAD(bt + c * ld + j), acc);
        VSTORE(y + j, acc);
    }
    for (; j < j1; j++) {
        float sum = y[j];
        for (int64_t c = 0; c < cols; c++) sum += t[c] * bt[c * ld + j];
        y[j] = sum;
    }
}

/* Up to GROUP rows of one slot, and their shrunk rows: t [n, width] (scale * x A^T). */
typedef struct {
    int64_t slot, n, idx[GROUP];
    float *t;
} group_t;

/* Each used slot's rows, GROUP at a time, each group's t carved from `t` (n x the slot's width floats); returns
   how many groups. */
static int64_t group_rows(const lora_t *l, const int64_t *row_slots, int64_t rows, float *t, group_t *groups) {
    int64_t count = 0;
    for (int64_t r0 = 0; r0 < rows; r0++) {
        const int64_t slot = row_slots[r0];
        int seen = slot < 0 || l->widths[slot] == 0;
        for (int64_t r = 0; r < r0 && !seen; r++) seen = row_slots[r] == slot;
        if (seen) continue;
        group_t *g = NULL;
        for (int64_t r = r0; r < rows; r++) {
            if (row_slots[r] != slot) continue;
            if (!g || g->n == GROUP) {
                g = groups + count++;
                g->slot = slot, g->n = 0, g->t = t;
            }
            g->idx[g->n++] = r;
            t += l->widths[slot];
        }
    }
    return count;
}

/* The outputs [j0, j1) of every group: each column block's t columns times its B rows, for the block's outputs in
   the range. */
static void expand_range(const lora_t *l, const group_t *groups, int64_t count, int64_t j0, int64_t j1, float *y) {
    const int64_t out = l->out_features;
    for (int64_t g = 0; g < count; g++) {
        const int64_t slot = groups[g].slot, width = l->widths[slot], rank = l->ranks[slot];
        const float *bt = l->bt + slot * l->width * out;
        for (int64_t p = 0; p < l->blocks; p++) {
            const int64_t c0 = l->blocks == 1 ? 0 : p * rank;
            const int64_t cols = l->blocks == 1 ? width : (width - c0 < rank ? width - c0 : rank);
            const int64_t first = l->block_rows[2 * p] > j0 ? l->block_rows[2 * p] : j0;
            const int64_t end = l->block_rows[2 * p + 1] < j1 ? l->block_rows[2 * p + 1] : j1;
            if (cols <= 0 || end <= first) continue;
            for (int64_t r = 0; r < groups[g].n; r++)
                expand_row(groups[g].t + r * width + c0, bt + c0 * out, out, cols, first, end,
                           y + groups[g].idx[r] * out);
        }
    }
}

/* y [rows, out] += each row's adapter delta of x [rows, in]; row_slots[r] is row r's slot (-1: none). Rows are
   grouped by slot: every group's shrink (each A row read once for the group's rows), then the expand of every
   output range, in one parallel region with one barrier between the two (when the slots' weights are many enough
   to share among the threads). Returns 0, -1 when the scratch cannot be allocated, -2 for a slot past the
   layer's. */
int lora_apply(const lora_t *l, const int64_t *row_slots, int64_t rows, const float *x, float *y, int threads) {
    for (int64_t r = 0; r < rows; r++)
        if (row_slots[r] >= l->slots) return -2;
    float *t = malloc((size_t)((rows > 0 ? rows : 1) * (l->width > 0 ? l->width : 1)) * sizeof(float));
    group_t *groups = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(group_t));
    if (!t || !groups) {
        free(t);
        free(groups);
        return -1;
    }
    const int64_t count = group_rows(l, row_slots, rows, t, groups), in = l->in_features, out = l->out_features;
    int64_t shrinks = 0, floats = 0;
    for (int64_t g = 0; g < count; g++) {
        shrinks += l->widths[groups[g].slot];
        floats += l->widths[groups[g].slot] * in + l->ranks[groups[g].slot] * out;
    }
    const int64_t tasks = (out + SPLIT - 1) / SPLIT;
#pragma omp parallel if (threads > 1 && floats >= THREADED_FLOATS) num_threads(threads)
    {
        /* Task s: row w of group g's A (the groups' A rows one after the other). */
#pragma omp for schedule(static)
        for (int64_t s = 0; s < shrinks; s++) {
            int64_t g = 0, w = s;
            while (w >= l->widths[groups[g].slot]) w -= l->widths[groups[g++].slot];
            const group_t *grp = groups + g;
            const float *xs[GROUP];
            for (int64_t r = 0; r < grp->n; r++) xs[r] = x + grp->idx[r] * in;
            const int64_t width = l->widths[grp->slot];
            shrink_row(l->a + (grp->slot * l->width + w) * in, xs, (int)grp->n, in, l->scales[grp->slot],
                       grp->t + w, width);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t j0 = task * SPLIT, j1 = j0 + SPLIT < out ? j0 + SPLIT : out;
            expand_range(l, groups, count, j0, j1, y);
        }
    }
    free(t);
    free(groups);
    return 0;
}

#define FIELD STRATA_ABI_FIELD
STRATA_ABI_EXPORT(lora,
    STRATA_ABI_TYPE(lora_t) FIELD(lora_t, a) FIELD(lora_t, bt) FIELD(lora_t, in_features) FIELD(lora_t, out_features)
    FIELD(lora_t, width) FIELD(lora_t, blocks) FIELD(lora_t, slots) FIELD(lora_t, block_rows) FIELD(lora_t, ranks)
    FIELD(lora_t, widths) FIELD(lora_t, scales))
