/* weight_gemm on AMX tiles (Intel Sapphire Rapids and later), for weights whose values are exact in bfloat16 once
   their scales and offsets are set aside: bfloat16, FP8, int4 / int8 with integral zero points, and GGUF Q4_0,
   Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K. x stays float32: each value is cut into three bfloat16 pieces whose
   sum is exactly that value (8 + 8 + 8 significant bits), so every product of a piece by a weight value is exact
   and the tiles sum them in float32 as an FMA GEMM sums its products. A group of values that share a scale (a GGUF
   run of 32 or Q6_K's 16, an int4 / int8 group, four runs of an unscaled or per-channel kind) is summed in the
   tiles, then scaled (and its offset times the group's sum of x added) in float32 with AVX-512, while the next
   group's tile products run. One tile product costs as much as sixteen AVX-512 FMAs and does 512 of them, so three
   pieces still leave a few times float32's rate. */
#ifndef STRATA_GEMM_AMX_H
#define STRATA_GEMM_AMX_H

#include "isa.h"
#if STRATA_AMX
#include "amx_tiles.h"
#endif

enum { GEMM_FMA = 0, GEMM_AMX = 1 };

#if STRATA_AMX
#define RUN 32     /* values of K in one tile product: 16 pairs */
#define PIECES 3   /* bfloat16 pieces of a float32 x */
#define TILE 512   /* bfloat16 values of one tile: 16 rows of 64 bytes */
#define RUNS_MAX 32 /* runs of K of one panel: a task's 8 strips are 256 KiB of tiles, in L2 */
#define GROUP_RUNS 4 /* runs summed in the tiles before an unscaled group is added up: 24 KiB of x's pieces, in L1 */

/* Tiles 0-3 sums (m-block i, strip j at 2i + j), 4-5 x's pieces of two m-blocks, 6-7 the weights of two strips:
   all 16 rows of 64 bytes, or for halves products over 16 values of K (Q6_K's scale groups): x's tiles 16 rows of
   32 bytes, the weights' 8 rows (pairs) of 64. Loaded by each thread (the configuration is per thread). */
static void configure_tiles(int halves) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.bytes_per_row[t] = 64;
    if (halves) c.bytes_per_row[4] = c.bytes_per_row[5] = 32, c.rows[6] = c.rows[7] = 8;
    _tile_loadconfig(&c);
}

/* Whether the AMX path reads this weight: kinds with values exact in bfloat16, and zero points that are integers. */
static int amx_reads(const weights_t *w) {
    switch (w->kind) {
    case KIND_BF16: case KIND_FP8: case KIND_Q4_0: case KIND_Q4_1: case KIND_Q5_0: case KIND_Q5_1: case KIND_Q8_0:
    case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K:
        return 1;
    case KIND_INT4: case KIND_INT8:
        if (w->group_size % RUN) return 0;
        if (w->zeros)
            for (int64_t i = 0; i < w->n * w->groups; i++)
                if (w->zeros[i] != rintf(w->zeros[i])) return 0;
        return 1;
    default: return 0;
    }
}

/* Whether the AMX path reads weights of this kind (int4 / int8: those with integral zero points). */
static int amx_reads_kind(int kind) {
    const weights_t probe = {NULL, 0, 0, 0, 2, RUN, NULL, NULL, kind};
    return kind >= 0 && kind < KIND_GGUF + 32 && amx_reads(&probe);
}


/* Kinds with two scales a run (one per 16 values): each half of a run is a tile product of its own. */
static inline int halves_of(int kind) { return kind == KIND_Q6_K ? 2 : 1; }

/* Runs of K summed in the tiles before they are scaled: a GGUF run; for int4 / int8 groups, the most runs up to
   GROUP_RUNS that divide a group (so none straddles two scales); else (unscaled, or one scale a row) GROUP_RUNS. */
static inline int64_t runs_per_group(const weights_t *w) {
    if (w->kind >= KIND_GGUF) return 1;
    if ((w->kind != KIND_INT4 && w->kind != KIND_INT8) || w->groups == 1) return GROUP_RUNS;
    int64_t runs = GROUP_RUNS;
    while ((w->group_size / RUN) % runs) runs--;
    return runs;
}

#include "amx_weight_tiles.h"

/* x [m_total, k] as tiles [block of 16 rows][run][piece][16 rows][32] (zeros past m_total and k): piece 0 is x with
   its low 16 bits cleared, piece 1 the same of what is left, piece 2 the rest (at most 8 significant bits, exact).
   sums [rows up to a multiple of 16][runs]: each run's sum of x (zeros past m_total), for the offsets. */
static void split_rows(const float *x, int64_t m_total, int64_t k, int64_t runs, uint16_t *pieces, float *sums,
                       int num_threads) {
    const int64_t blocks = (m_total + 15) / 16;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t run = 0; run < runs; run++) {
            uint16_t *dst = pieces + (b * runs + run) * PIECES * TILE;
            for (int i = 0; i < 16; i++) {
                const int64_t m = b * 16 + i;
                __m512 sum = _mm512_setzero_ps();
                for (int h = 0; h < 2; h++) {
                    const int64_t k0 = run * RUN + 16 * h;
                    const __mmask16 valid = m >= m_total || k0 >= k ? 0 : k - k0 >= 16 ? 0xffff
                                                                          : (__mmask16)((1u << (k - k0)) - 1);
                    __m512 v = _mm512_maskz_loadu_ps(valid, x + m * k + k0);
                    sum = _mm512_add_ps(sum, v);
                    for (int p = 0; p < PIECES; p++) {
                        const __m512i top = _mm512_and_si512(_mm512_castps_si512(v), high);
                        _mm256_storeu_si256((__m256i *)(dst + p * TILE + i * 32 + 16 * h),
                                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(top, 16)));
                        v = _mm512_sub_ps(v, _mm512_castsi512_ps(top));
                    }
                }
                if (sums) sums[m * runs + run] = _mm512_reduce_add_ps(sum);
            }
        }
}

/* The tile sums of one group of runs for one or two m-blocks (pieces a, the next block's at a + a_block) times one
   or two strips (tiles b, the next strip's at b + b_strip), left in tiles 2i + j. Configured for halves, the same
   loads read 16 values of K from each row of x's pieces and 8 pairs from the weights' tiles. */
static inline __attribute__((always_inline)) void group_product(const uint16_t *a, int64_t a_block,
                                                                const uint16_t *b, int64_t b_strip, int64_t runs,
                                                                const int TWO_M, const int TWO_N) {
    _tile_zero(0);
    if (TWO_N) _tile_zero(1);
    if (TWO_M) _tile_zero(2);
    if (TWO_M && TWO_N) _tile_zero(3);
    for (int64_t r = 0; r < runs; r++) {
        _tile_loadd(6, b + r * TILE, 64);
        if (TWO_N) _tile_loadd(7, b + b_strip + r * TILE, 64);
        for (int p = 0; p < PIECES; p++) {
            _tile_loadd(4, a + (r * PIECES + p) * TILE, 64);
            if (TWO_M) _tile_loadd(5, a + a_block + (r * PIECES + p) * TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (TWO_N) _tile_dpbf16ps(1, 4, 7);
            if (TWO_M) _tile_dpbf16ps(2, 5, 6);
            if (TWO_M && TWO_N) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

static inline void store_sums(int two_m, int two_n, float t[4][16][16]) {
    _tile_stored(0, t[0], 64);
    if (two_n) _tile_stored(1, t[1], 64);
    if (two_m) _tile_stored(2, t[2], 64);
    if (two_m && two_n) _tile_stored(3, t[3], 64);
}

/* acc[i][0..16) += t[i] * scales (+ sums[i * sum_stride] * offsets) for the 16 rows of one tile; scales NULL: the
   plain sums. */
static inline void add_tile(const float t[16][16], float *acc, int64_t acc_stride, const float *scales,
                            const float *offsets, const float *sums, int64_t sum_stride) {
    if (!scales) {
        for (int i = 0; i < 16; i++) {
            float *row = acc + i * acc_stride;
            _mm512_store_ps(row, _mm512_add_ps(_mm512_load_ps(t[i]), _mm512_load_ps(row)));
        }
        return;
    }
    const __m512 s = _mm512_loadu_ps(scales);
    for (int i = 0; i < 16; i++) {
        __m512 y = _mm512_fmadd_ps(_mm512_load_ps(t[i]), s, _mm512_load_ps(acc + i * acc_stride));
        if (sums) y = _mm512_fmadd_ps(_mm512_set1_ps(sums[i * sum_stride]), _mm512_loadu_ps(offsets), y);
        _mm512_store_ps(acc + i * acc_stride, y);
    }
}

/* One group's stored tile sums, waiting to be scaled into acc while the next group's tile products run. */
typedef struct {
    int live, two_m, two_n;
    float *acc;                   /* the first strip's first row */
    const float *scales, *offsets; /* the first strip's; the second's panel_runs * 32 (16) on; scales NULL: unscaled */
    const float *sums;            /* the group's sums of x, rows sum_stride apart, or NULL */
    int64_t panel_runs, sum_stride;
} pending_t;

static inline void add_pending(pending_t *q, const float t[4][16][16]) {
    for (int j = 0; j < 1 + q->two_n; j++)
        for (int i = 0; i < 1 + q->two_m; i++)
            add_tile(t[2 * i + j], q->acc + i * 16 * NC + j * 16, NC, q->scales ? q->scales + j * q->panel_runs * 32
                                                                               : NULL,
                     q->offsets + j * q->panel_runs * 16, q->sums ? q->sums + i * 16 * q->sum_stride : NULL,
                     q->sum_stride);
    q->live = 0;
}

typedef struct {
    const weights_t *w;
    const uint16_t *pieces; /* split_rows' tiles */
    const float *sums;      /* split_rows' run sums, or NULL */
    int64_t m_total, runs;
    const float *bias;
    float *out;
} amx_product_t;

/* Outputs n0 .. n1 (whole strips but the last) of every row of x, panel by panel along K; tiles, scales and
   offsets: this thread's scratch for a panel of the task's strips; acc: [32][NC] for two m-blocks. */
static void amx_task(const amx_product_t *p, int64_t n0, int64_t n1, uint16_t *tiles, float *scales,
                     float *offsets, float *acc) {
    const weights_t *w = p->w;
    const int64_t strips = (n1 - n0 + 15) / 16, blocks = (p->m_total + 15) / 16, group = runs_per_group(w);
    /* panels of whole groups, as even as they come: a short last panel would cost another pass over the output */
    const int64_t panels = (p->runs + RUNS_MAX / group * group - 1) / (RUNS_MAX / group * group);
    const int64_t panel = ((p->runs + panels - 1) / panels + group - 1) / group * group;
    const int unscaled = w->kind == KIND_BF16, halves = halves_of(w->kind);
    _Alignas(64) float t[2][4][16][16]; /* one group's sums stored while the group before them is added */
    int cur = 0;
    pending_t pending = {0};
    for (int64_t run0 = 0; run0 < p->runs; run0 += panel) {
        const int64_t runs = p->runs - run0 < panel ? p->runs - run0 : panel;
        for (int64_t s = 0; s < strips; s++)
            pack_strip_any(w, n0 + 16 * s, run0, runs, tiles + s * runs * TILE, scales + s * runs * 32,
                           offsets + s * runs * 16);
        for (int64_t b = 0; b < blocks; b += 2) {
            const int two_m = b + 1 < blocks;
            memset(acc, 0, sizeof(float) * 32 * NC);
            for (int64_t g = 0; g < runs; g += group) {
                const int64_t g_runs = runs - g < group ? runs - g : group;
                const uint16_t *a = p->pieces + (b * p->runs + run0 + g) * PIECES * TILE;
                const int64_t a_block = p->runs * PIECES * TILE;
                const float *sums = p->sums ? p->sums + b * 16 * p->runs + run0 + g : NULL;
                for (int64_t s = 0; s < strips; s += 2) {
                    const int two_n = s + 1 < strips;
                    for (int h = 0; h < halves; h++) { /* half h: values 16h.. of x's runs, pairs 8h.. of tiles */
                        const uint16_t *ah = a + 16 * h, *bt = tiles + (s * runs + g) * TILE + TILE / 2 * h;
                        if (two_m && two_n) group_product(ah, a_block, bt, runs * TILE, g_runs, 1, 1);
                        else if (two_m) group_product(ah, a_block, bt, runs * TILE, g_runs, 1, 0);
                        else if (two_n) group_product(ah, a_block, bt, runs * TILE, g_runs, 0, 1);
                        else group_product(ah, a_block, bt, runs * TILE, g_runs, 0, 0);
                        if (pending.live) add_pending(&pending, t[cur ^ 1]); /* meanwhile, on the vector units */
                        store_sums(two_m, two_n, t[cur]);
                        pending = (pending_t){1, two_m, two_n, acc + s * 16,
                                              unscaled ? NULL : scales + (s * runs + g) * 32 + 16 * h,
                                              offsets + (s * runs + g) * 16, sums, runs, p->runs};
                        cur ^= 1;
                    }
                }
            }
            if (pending.live) add_pending(&pending, t[cur ^ 1]);
            const int last = run0 + runs == p->runs;
            for (int64_t i = 0; i < 32 && b * 16 + i < p->m_total; i++) {
                float *row = p->out + (b * 16 + i) * w->n + n0;
                for (int64_t c = 0; c < n1 - n0; c += 16) {
                    const __mmask16 valid = n1 - n0 - c >= 16 ? 0xffff : (__mmask16)((1u << (n1 - n0 - c)) - 1);
                    __m512 y = _mm512_load_ps(acc + i * NC + c);
                    if (run0 > 0) y = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, row + c), y);
                    if (last && p->bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(valid, p->bias + n0 + c));
                    _mm512_mask_storeu_ps(row + c, valid, y);
                }
            }
        }
    }
}

/* out = x times the weight's transpose (+ bias) on AMX tiles, tasks of whole strips (per_task outputs) shared among
   the threads. Returns 0, or -1 when scratch memory ran out. */
static int amx_gemm(const float *x, int64_t m_total, const weights_t *w, const float *bias, float *out,
                    int64_t per_task, int num_threads) {
    const int64_t runs = (w->k + RUN - 1) / RUN, blocks = (m_total + 15) / 16;
    const int64_t tasks = (w->n + per_task - 1) / per_task;
    uint16_t *pieces = aligned_alloc(64, sizeof(uint16_t) * (size_t)(blocks * runs * PIECES * TILE));
    float *sums = gguf_has_offsets(w->kind) ? malloc(sizeof(float) * (size_t)(blocks * 16 * runs)) : NULL;
    if (!pieces || (gguf_has_offsets(w->kind) && !sums)) {
        free(pieces), free(sums);
        return -1;
    }
    split_rows(x, m_total, w->k, runs, pieces, sums, num_threads);
    const amx_product_t p = {w, pieces, sums, m_total, runs, bias, out};
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t strip_runs = (size_t)(NC / 16) * RUNS_MAX;
        uint16_t *tiles = aligned_alloc(64, sizeof(uint16_t) * strip_runs * TILE);
        float *scratch = aligned_alloc(64, sizeof(float) * (strip_runs * 48 + 32 * NC));
        if (!tiles || !scratch) failed = 1;
        else configure_tiles(halves_of(w->kind) == 2);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = t * per_task, n1 = n0 + per_task < w->n ? n0 + per_task : w->n;
            if (!failed) amx_task(&p, n0, n1, tiles, scratch, scratch + strip_runs * 32, scratch + strip_runs * 48);
        }
        if (tiles && scratch) _tile_release();
        free(tiles), free(scratch);
    }
    free(pieces), free(sums);
    return failed ? -1 : 0;
}
#endif

#endif
