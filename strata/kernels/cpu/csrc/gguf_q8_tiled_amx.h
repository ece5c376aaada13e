/* Products with a weight in the tile layout (gguf_q8_tiled.h) on AMX's int8 tiles, from Q8T_MIN_TILE_ROWS rows of x:
   x's signed q (16 rows by one unit: 32 values, Q6_K's 16) against the layout's unsigned values (tdpbsud), a strip's
   4- to 6-bit values widened to bytes once per strip, Q8_0's read where they lie. Each unit's exact sums then take the
   same steps as in the VNNI kernels (q8t_start, q8t_add, q8t_flush), so a row's output has the same bits through
   either. Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_TILED_AMX_H
#define STRATA_GGUF_Q8_TILED_AMX_H
#include "amx_tiles.h"

/* Tiles: 0 and 1 sums (units in turn), 2 / 4 x's 16 rows of a unit, 3 / 5 the strip's values of it. */
static void q8t_configure(int unit) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = 16, c.bytes_per_row[t] = 64;
    c.bytes_per_row[2] = c.bytes_per_row[4] = (uint16_t)unit;
    c.rows[3] = c.rows[5] = (uint8_t)(unit / 4);
    _tile_loadconfig(&c);
}

/* Unit v's tile rows of the strip as bytes: where they lie (Q8_0), else widened into `widened` [groups][512]. */
static inline __attribute__((always_inline)) const uint8_t *q8t_unit_values(const int KIND, const uint8_t *strip,
                                                                           int64_t v, const uint8_t *widened) {
    if (KIND == KIND_Q8_0) return q8t_group(KIND, strip, v);
    return widened + 512 * (v / Q8T_UNITS(KIND)) + 256 * (v % Q8T_UNITS(KIND));
}

/* A strip's 4-, 5- and 6-bit values widened to one byte each, once for all its rows of x. */
static inline __attribute__((always_inline)) void q8t_widen(const int KIND, const uint8_t *strip, int64_t groups,
                                                            uint8_t *widened) {
    if (KIND == KIND_Q8_0) return;
    for (int64_t u = 0; u < groups; u++) {
        __m512i w[8];
        q8t_values(KIND, q8t_group(KIND, strip, u), w);
        for (int p = 0; p < 8; p++) _mm512_store_si512(widened + 512 * u + 64 * p, w[p]);
    }
}

/* Unit v's sums (buffer t, rows of 16 outputs) into the first `rows` rows of acc, as q8t_rows takes them; after a
   K-quant block's last unit, into total. */
static inline __attribute__((always_inline)) void q8t_tile_add(const int KIND, const int32_t t[16][16],
                                                               const uint8_t *strip, int64_t v, const q8_x_t *xs,
                                                               int rows, __m512 acc[16], __m512 total[16]) {
    __m512 scale, offset;
    q8t_unit(KIND, strip, v, &scale, &offset);
    const int flush = q8t_k_quant(KIND) && (v + 1) % Q8T_BLOCK_UNITS(KIND) == 0;
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        if (i >= rows) break;
        const __m512i sum = _mm512_add_epi32(_mm512_load_si512((const void *)t[i]),
                                             _mm512_set1_epi32(q8t_start(KIND, xs + i, v)));
        acc[i] = q8t_add(KIND, sum, scale, offset, xs + i, v, acc[i]);
        if (flush) q8t_flush(xs + i, v / Q8T_BLOCK_UNITS(KIND), acc + i, total + i);
    }
}

/* Unit v's tile product into sums tile C: x's rows (tile A) against the strip's values (tile B). */
#define Q8T_ISSUE(C, A, B, v)                                                                                      \
    do {                                                                                                           \
        _tile_loadd(A, xq + unit * (v), stride);                                                                  \
        _tile_loadd(B, q8t_unit_values(KIND, strip, v, widened), 64);                                             \
        _tile_zero(C);                                                                                             \
        _tile_dpbsud(C, A, B);                                                                                     \
    } while (0)

/* Rows xs[0 .. rows) (rows <= 16; their q `stride` bytes apart from xq, the tile's other rows zeros) times one
   strip, every unit, into out. Two sums tiles in turn: a unit's product runs while the one before it is stored and
   added. */
static inline __attribute__((always_inline)) void q8t_tile_rows(const int KIND, const uint8_t *strip,
                                                                const uint8_t *widened, int64_t units,
                                                                const int8_t *xq, int64_t stride, const q8_x_t *xs,
                                                                int rows, __m512 out[16]) {
    const int unit = 32 / Q8T_UNITS(KIND);
    _Alignas(64) int32_t t[2][16][16];
    __m512 acc[16], total[16];
    for (int i = 0; i < 16; i++) acc[i] = total[i] = _mm512_setzero_ps();
    Q8T_ISSUE(0, 2, 3, 0);
    for (int64_t v = 0; v < units; v += 2) {
        if (v + 1 < units) Q8T_ISSUE(1, 4, 5, v + 1);
        _tile_stored(0, t[0], 64);
        if (v > 0) q8t_tile_add(KIND, (const int32_t(*)[16])t[1], strip, v - 1, xs, rows, acc, total);
        if (v + 2 < units) Q8T_ISSUE(0, 2, 3, v + 2);
        if (v + 1 < units) _tile_stored(1, t[1], 64);
        q8t_tile_add(KIND, (const int32_t(*)[16])t[0], strip, v, xs, rows, acc, total);
    }
    if (units % 2 == 0) q8t_tile_add(KIND, (const int32_t(*)[16])t[1], strip, units - 1, xs, rows, acc, total);
    for (int i = 0; i < 16; i++) out[i] = q8t_k_quant(KIND) ? total[i] : acc[i];
}
#undef Q8T_ISSUE

static inline __attribute__((always_inline)) void q8t_tile_strip(const int KIND, const weights_t *w, int64_t strip,
                                                                 const q8_x_t *xs, int64_t m_total, int64_t stride,
                                                                 const float *bias, uint8_t *widened, float *out) {
    const int64_t groups = w->k / 32, n0 = 16 * strip, width = w->n - n0 < 16 ? w->n - n0 : 16;
    const __mmask16 valid = (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    const uint8_t *values = w->data + strip * w->row_bytes;
    q8t_widen(KIND, values, groups, widened);
    for (int64_t m0 = 0; m0 < m_total; m0 += 16) {
        const int rows = m_total - m0 < 16 ? (int)(m_total - m0) : 16;
        __m512 y[16];
        q8t_tile_rows(KIND, values, widened, groups * Q8T_UNITS(KIND), xs[0].q + m0 * stride, stride, xs + m0, rows,
                      y);
        for (int i = 0; i < rows; i++) _mm512_mask_storeu_ps(out + (m0 + i) * w->n + n0, valid, _mm512_add_ps(y[i], b));
    }
}

/* out[m_total, n] = rounded rows xs (q8_prepare's, padded with zero rows to a multiple of 16, `stride` bytes
   apart) times a tiled weight's transpose (+ bias) on the tiles, strips shared among the threads. Returns 0, or -1
   when scratch memory ran out. */
static int q8t_tile_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, int64_t stride, const float *bias,
                             float *out, int num_threads) {
    const int64_t strips = (w->n + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *widened = aligned_alloc(64, (size_t)(w->k / 32 * 512));
        if (widened) q8t_configure(w->kind == KIND_Q6_K ? 16 : 32);
        else failed = 1;
#pragma omp for schedule(static)
        for (int64_t strip = 0; strip < strips; strip++) {
            if (failed) continue;
            switch (w->kind) { /* constant kinds, so each unit's steps inline */
#define Q8T_STRIP(K) case K: q8t_tile_strip(K, w, strip, xs, m_total, stride, bias, widened, out); break;
            Q8T_EACH_KIND(Q8T_STRIP)
#undef Q8T_STRIP
            }
        }
        if (widened) _tile_release();
        free(widened);
    }
    return failed ? -1 : 0;
}

#endif
