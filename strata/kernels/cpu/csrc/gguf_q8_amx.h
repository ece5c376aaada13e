/* GGUF products with x rounded to 8 bits on AMX's int8 tiles (tdpbusd; Sapphire Rapids and later), for prefill-sized
   batches: x + 128 (unsigned) against the weights' signed values (q less the kind's whole offset: Q4_0's 8, Q5_0's
   16, Q6_K's 32), 16 rows of x by 16 outputs by one scale group of K (32 values; Q6_K's 16) a tile product, exact
   int32 sums. Each product's sums, less 128 times the weights' own sums, take the group's scales in float32 with
   AVX-512 (the weight's d * scale times x's d; the mins' offset times x's s or sums times d) while the next group's
   tile product runs. Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_AMX_H
#define STRATA_GGUF_Q8_AMX_H
#include "amx_tiles.h"

#define Q8X_MIN_ROWS 32 /* rows of x from which the tiles take a product (fewer: the VNNI kernels) */

/* One strip of 16 weight rows packed for the tiles, per scale group u (a run of 32 values; Q6_K: each 16): the
   signed values [u][K quads of the group][16 rows][4], each row's scale, 128 times its values' sum, and its offset
   (the mins: Q4_1 / Q5_1's m, the K-quants' -dmin * mn; zero for the others). */
typedef struct {
    int8_t *values;
    float *scale, *offset;
    int32_t *sum128;
} q8x_strip_t;

/* Weight rows n0 .. n0 + 15 (rows past n: zeros) packed into s, two runs of 32 a transpose. */
static inline __attribute__((always_inline)) void q8x_pack(const int KIND, const weights_t *w, int64_t n0,
                                                           int64_t runs, q8x_strip_t *s) {
    const int64_t per_block = gguf_block_values(KIND), bytes = gguf_block_bytes(KIND);
    const int minus = KIND == KIND_Q4_0 ? 8 : KIND == KIND_Q5_0 ? 16 : KIND == KIND_Q6_K ? 32 : 0;
    const int halves = KIND == KIND_Q6_K, offsets = KIND == KIND_Q4_1 || KIND == KIND_Q5_1 ||
                                                      KIND == KIND_Q4_K || KIND == KIND_Q5_K;
    for (int64_t r0 = 0; r0 < runs; r0 += 2) {
        __m512i rows[16];
        for (int j = 0; j < 16; j++) {
            __m256i v[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int64_t run = r0; run < r0 + 2 && run < runs; run++) {
                float scale[2] = {0.f, 0.f}, offset[2] = {0.f, 0.f};
                int32_t sums[2] = {0, 0};
                if (n0 + j < w->n) {
                    __m128i q[2];
                    const uint8_t *row = w->data + (n0 + j) * w->row_bytes;
                    gguf_run_bytes(KIND, row + run * 32 / per_block * bytes, (int)(run % (per_block / 32)), q, scale,
                                   offset);
                    for (int i = 0; i < 2; i++) {
                        q[i] = _mm_sub_epi8(q[i], _mm_set1_epi8((char)minus));
                        const __m128i sad = _mm_sad_epu8(_mm_xor_si128(q[i], _mm_set1_epi8((char)0x80)),
                                                         _mm_setzero_si128()); /* sum of q + 128 per 8 */
                        sums[i] = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
                    }
                    v[run - r0] = _mm256_set_m128i(q[1], q[0]);
                }
                if (halves)
                    for (int i = 0; i < 2; i++) s->scale[(2 * run + i) * 16 + j] = scale[i],
                                                s->sum128[(2 * run + i) * 16 + j] = 128 * sums[i];
                else
                    s->scale[run * 16 + j] = scale[0], s->sum128[run * 16 + j] = 128 * (sums[0] + sums[1]),
                    s->offset[run * 16 + j] = offsets ? offset[0] : 0.f;
            }
            rows[j] = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
        }
        transpose16(rows); /* row j held row j's 16 quads of two runs; now row p holds quad p of the 16 rows */
        for (int p = 0; p < 16; p++) _mm512_store_si512(s->values + (r0 * 8 + p) * 64, rows[p]);
    }
}

static void q8x_pack_any(const weights_t *w, int64_t n0, int64_t runs, q8x_strip_t *s) {
    switch (w->kind) { /* constant kinds, so each run's extraction inlines */
#define Q8X_PACK(K) case K: q8x_pack(K, w, n0, runs, s); break;
    Q8X_PACK(KIND_Q4_0) Q8X_PACK(KIND_Q4_1) Q8X_PACK(KIND_Q5_0) Q8X_PACK(KIND_Q5_1) Q8X_PACK(KIND_Q8_0)
    Q8X_PACK(KIND_Q4_K) Q8X_PACK(KIND_Q5_K) Q8X_PACK(KIND_Q6_K)
#undef Q8X_PACK
    }
}

/* acc[i] += (t[i] - sum128) * scale * dx[i] (+ offset * tx[i]) for the 16 rows of one group's tile sums. */
static inline __attribute__((always_inline)) void q8x_add(const int32_t t[16][16], const q8x_strip_t *s, int64_t u,
                                                          const float *dx, const float *tx, __m512 acc[16]) {
    const __m512 scale = _mm512_load_ps(s->scale + 16 * u);
    const __m512i sum128 = _mm512_load_si512((const void *)(s->sum128 + 16 * u));
    for (int i = 0; i < 16; i++) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void *)t[i]), sum128));
        acc[i] = _mm512_fmadd_ps(sums, _mm512_mul_ps(scale, _mm512_set1_ps(dx[i])), acc[i]);
    }
    if (tx) {
        const __m512 offset = _mm512_load_ps(s->offset + 16 * u);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(tx[i]), acc[i]);
    }
}

/* Tiles: 0 and 1 sums (groups taken in turn), 2 / 4 x's 16 rows of a group, 3 / 5 the strip's values for it. */
static void q8x_configure(int group) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = 16, c.bytes_per_row[t] = 64;
    c.bytes_per_row[2] = c.bytes_per_row[4] = (uint16_t)group;
    c.rows[3] = c.rows[5] = (uint8_t)(group / 4);
    _tile_loadconfig(&c);
}

/* Rows m0 .. m0 + 15 of x (their q + 128 at uq, rows `stride` bytes apart) times one packed strip, every group:
   acc[16], rows of 16 outputs. dx, tx: [groups][16] x's scales and mins' factors for these rows (tx NULL: none).
   Two tile sums in flight: group u + 1's product runs while group u's sums are scaled. */
static void q8x_strip_rows(const uint8_t *uq, int64_t stride, int64_t groups, int group, const q8x_strip_t *s,
                           const float *dx, const float *tx, __m512 acc[16]) {
    _Alignas(64) int32_t t[2][16][16];
    const int64_t tile_bytes = 16 * group;
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    _tile_loadd(2, uq, stride);
    _tile_loadd(3, s->values, 64);
    _tile_zero(0);
    _tile_dpbusd(0, 2, 3);
    for (int64_t u = 0; u < groups; u += 2) {
        if (u + 1 < groups) {
            _tile_loadd(4, uq + (u + 1) * group, stride);
            _tile_loadd(5, s->values + (u + 1) * tile_bytes, 64);
            _tile_zero(1);
            _tile_dpbusd(1, 4, 5);
        }
        _tile_stored(0, t[0], 64);
        if (u + 2 < groups) {
            _tile_loadd(2, uq + (u + 2) * group, stride);
            _tile_loadd(3, s->values + (u + 2) * tile_bytes, 64);
            _tile_zero(0);
            _tile_dpbusd(0, 2, 3);
        }
        q8x_add(t[0], s, u, dx + 16 * u, tx ? tx + 16 * u : NULL, acc);
        if (u + 1 < groups) {
            _tile_stored(1, t[1], 64);
            q8x_add(t[1], s, u + 1, dx + 16 * (u + 1), tx ? tx + 16 * (u + 1) : NULL, acc);
        }
    }
}

/* x's per-group factors for rows m (groups of `group` values): dx[m / 16][u][m % 16] its d, tx the mins' factor
   (Q8_1's s for Q4_1 / Q5_1, d times the run's sum for the K-quants); rows past m_total zero. */
static void q8x_row_factors(const q8_x_t *xs, int64_t m_total, int64_t m_pad, int64_t groups, int group,
                            int per_block, float *dx, float *tx) {
    for (int64_t m = 0; m < m_pad; m++)
        for (int64_t u = 0; u < groups; u++) {
            const int64_t at = (m / 16 * groups + u) * 16 + m % 16, first = u * group;
            const int live = m < m_total;
            dx[at] = live ? xs[m].d[first / per_block] : 0.f;
            if (!tx) continue;
            tx[at] = !live ? 0.f : per_block == 32 ? xs[m].s[first / 32]
                                                    : xs[m].sum16_d[first / 16] + xs[m].sum16_d[first / 16 + 1];
        }
}

/* out[m_total, n] = rounded rows xs (q8_prepare's, padded with zero rows to a multiple of 16, `stride` bytes
   apart) times a GGUF weight's transpose (+ bias) on the tiles, strips of 16 outputs shared among the threads.
   Returns 0, or -1 when scratch memory ran out. */
static int q8x_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, int64_t stride, const float *bias,
                        float *out, int num_threads) {
    const int group = w->kind == KIND_Q6_K ? 16 : 32, per_block = (int)(gguf_block_values(w->kind) == 32 ? 32 : 256);
    const int64_t runs = w->k / 32, groups = w->k / group, m_pad = (m_total + 15) / 16 * 16;
    const int offsets = w->kind == KIND_Q4_1 || w->kind == KIND_Q5_1 || w->kind == KIND_Q4_K || w->kind == KIND_Q5_K;
    float *dx = aligned_alloc(64, sizeof(float) * (size_t)(m_pad * groups * (offsets ? 2 : 1)));
    if (!dx) return -1;
    float *tx = offsets ? dx + m_pad * groups : NULL;
    q8x_row_factors(xs, m_total, m_pad, groups, group, per_block, dx, tx);
    const int64_t strips = (w->n + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t even_runs = (runs + 1) / 2 * 2;
        q8x_strip_t s = {aligned_alloc(64, (size_t)(even_runs * 512)),
                         aligned_alloc(64, sizeof(float) * (size_t)(groups * 32)), NULL,
                         aligned_alloc(64, sizeof(int32_t) * (size_t)(groups * 16))};
        if (s.values && s.scale && s.sum128) s.offset = s.scale + groups * 16, q8x_configure(group);
        else failed = 1;
#pragma omp for schedule(static)
        for (int64_t strip = 0; strip < strips; strip++) {
            if (failed) continue;
            const int64_t n0 = 16 * strip, width = w->n - n0 < 16 ? w->n - n0 : 16;
            const __mmask16 valid = (__mmask16)((1u << width) - 1);
            q8x_pack_any(w, n0, runs, &s);
            for (int64_t m0 = 0; m0 < m_pad; m0 += 16) {
                __m512 acc[16];
                q8x_strip_rows(xs[0].uq + m0 * stride, stride, groups, group, &s, dx + m0 * groups,
                               tx ? tx + m0 * groups : NULL, acc);
                const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
                for (int64_t i = 0; i < 16 && m0 + i < m_total; i++)
                    _mm512_mask_storeu_ps(out + (m0 + i) * w->n + n0, valid, _mm512_add_ps(acc[i], b));
            }
        }
        if (!failed) _tile_release();
        free(s.values), free(s.scale), free(s.sum128);
    }
    free(dx);
    return failed ? -1 : 0;
}

#endif
