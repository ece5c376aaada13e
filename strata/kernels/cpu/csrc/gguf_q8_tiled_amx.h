/* Products with a weight in the tile layout (gguf_q8_tiled.h) on AMX's int8 tiles, from Q8T_MIN_TILE_ROWS rows of x:
   x + 128 (16 rows by one unit: 32 values, Q6_K's 16) against a strip's values widened to signed bytes once per
   strip (tdpbusd), the sums starting from -128 times the weights' own: the same integers as the VNNI kernels' (whose
   sums start from minus the weights' zero times x's), which then take the same float steps (q8t_add, q8t_flush), so
   a row's output has the same bits through either. Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_TILED_AMX_H
#define STRATA_GGUF_Q8_TILED_AMX_H
#include "amx_tiles.h"

/* Tiles: 0 and 1 sums (units in turn), 2 / 4 x's 16 rows of a unit, 3 / 5 the strip's values of it. */
static void q8t_configure(int unit, int rows) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = (uint8_t)rows, c.bytes_per_row[t] = 64;
    c.bytes_per_row[2] = c.bytes_per_row[4] = (uint16_t)unit;
    c.rows[3] = c.rows[5] = (uint8_t)(unit / 4);
    _tile_loadconfig(&c);
}

/* A strip's values widened to signed bytes, less the kind's zero (so that sums of x + 128 against them start from
   -128 times their own sum and come out as VNNI's: q8t_start), once for all its rows of x: widened [groups][512],
   and where each unit's sums start, starts [units][16]. */
static inline __attribute__((always_inline)) void q8t_widen(const int KIND, const uint8_t *strip, int64_t groups,
                                                            uint8_t *widened, int32_t *starts) {
    const __m512i zero = _mm512_set1_epi8((char)q8t_zero(KIND)), one = _mm512_set1_epi8(1);
    const int units = Q8T_UNITS(KIND), quads = 8 / units;
    for (int64_t u = 0; u < groups; u++) {
        __m512i w[8];
        q8t_values(KIND, q8t_group(KIND, strip, u), w);
        for (int s = 0; s < units; s++) {
            __m512i sum = _mm512_setzero_si512();
            for (int p = s * quads; p < (s + 1) * quads; p++) {
                w[p] = _mm512_sub_epi8(w[p], zero);
                _mm512_store_si512(widened + 512 * u + 64 * p, w[p]);
                sum = _mm512_dpbusd_epi32(sum, one, w[p]);
            }
            _mm512_store_si512(starts + 16 * (u * units + s), _mm512_sub_epi32(_mm512_setzero_si512(),
                                                                               _mm512_slli_epi32(sum, 7)));
        }
    }
}

/* x's factors for the tiles, per tile of 16 rows, unit and row: d (legacy kinds: of the unit's block; K-quants: of
   each block, [tile][block][16]) and what the weights' offset meets (q8t_ox), rows past m_total zeros. */
typedef struct {
    float *d, *o;
} q8t_factors_t;

static int q8t_gather_factors(int kind, const q8_x_t *xs, int64_t m_total, int64_t units, q8t_factors_t *f) {
    const int64_t tiles = (m_total + 15) / 16, per_tile = q8t_k_quant(kind) ? units / Q8T_BLOCK_UNITS(kind) : units;
    f->d = calloc((size_t)(tiles * 16 * (per_tile + units)), sizeof(float));
    if (!f->d) return -1;
    f->o = f->d + tiles * 16 * per_tile;
    for (int64_t m = 0; m < m_total; m++) {
        const int64_t tile = m / 16, i = m % 16;
        for (int64_t v = 0; v < per_tile; v++) f->d[(tile * per_tile + v) * 16 + i] = xs[m].d[v];
        if (gguf_has_offsets(kind))
            for (int64_t v = 0; v < units; v++) f->o[(tile * units + v) * 16 + i] = *q8t_ox(kind, xs + m, v);
    }
    return 0;
}

/* Unit v's sums (buffer t, rows of 16 outputs) into the first `rows` rows of acc, as q8t_rows takes them; after a
   K-quant block's last unit, into total. d, o: this tile of rows' factors (q8t_factors_t). */
static inline __attribute__((always_inline)) void q8t_tile_add(const int KIND, const int32_t t[16][16],
                                                               const uint8_t *strip, int64_t v, const float *d,
                                                               const float *o, int rows, __m512 acc[16],
                                                               __m512 total[16]) {
    __m512 scale, offset;
    q8t_unit(KIND, strip, v, &scale, &offset);
    const int64_t block = v / Q8T_BLOCK_UNITS(KIND);
    const int flush = q8t_k_quant(KIND) && (v + 1) % Q8T_BLOCK_UNITS(KIND) == 0;
    const float *dv = d + 16 * (q8t_k_quant(KIND) ? block : v), *ov = o + 16 * v;
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        if (i >= rows) break;
        acc[i] = q8t_add(KIND, _mm512_load_si512((const void *)t[i]), scale, offset, dv + i, ov + i, acc[i]);
        if (flush) q8t_flush(dv[i], acc + i, total + i);
    }
}

/* Unit v's tile product into sums tile C, which starts from the unit's `starts`: x + 128's rows (tile A) against
   the strip's signed values (tile B). */
#define Q8T_ISSUE(C, A, B, v)                                                                                      \
    do {                                                                                                           \
        _tile_loadd(A, uq + unit * (v), stride);                                                                  \
        _tile_loadd(B, widened + 512 * ((v) / Q8T_UNITS(KIND)) + 256 * ((v) % Q8T_UNITS(KIND)), 64);               \
        _tile_loadd(C, starts + 16 * (v), 0);                                                                     \
        _tile_dpbusd(C, A, B);                                                                                     \
    } while (0)

/* Rows xs[0 .. rows) (rows <= 16; their q + 128 `stride` bytes apart from uq, the tile's other rows zeros) times
   one strip, every unit, into out. Two sums tiles in turn: a unit's product runs while the one before it is stored
   and added. */
static inline __attribute__((always_inline)) void q8t_tile_rows(const int KIND, const uint8_t *strip,
                                                                const uint8_t *widened, const int32_t *starts,
                                                                int64_t units, const uint8_t *uq, int64_t stride,
                                                                const float *d, const float *o, int rows,
                                                                __m512 out[16]) {
    const int unit = 32 / Q8T_UNITS(KIND);
    _Alignas(64) int32_t t[2][16][16];
    __m512 acc[16], total[16];
    for (int i = 0; i < 16; i++) acc[i] = total[i] = _mm512_setzero_ps();
    Q8T_ISSUE(0, 2, 3, 0);
    for (int64_t v = 0; v < units; v += 2) {
        if (v + 1 < units) Q8T_ISSUE(1, 4, 5, v + 1);
        _tile_stored(0, t[0], 64);
        if (v > 0) q8t_tile_add(KIND, (const int32_t(*)[16])t[1], strip, v - 1, d, o, rows, acc, total);
        if (v + 2 < units) Q8T_ISSUE(0, 2, 3, v + 2);
        if (v + 1 < units) _tile_stored(1, t[1], 64);
        q8t_tile_add(KIND, (const int32_t(*)[16])t[0], strip, v, d, o, rows, acc, total);
    }
    if (units % 2 == 0) q8t_tile_add(KIND, (const int32_t(*)[16])t[1], strip, units - 1, d, o, rows, acc, total);
    for (int i = 0; i < 16; i++) out[i] = q8t_k_quant(KIND) ? total[i] : acc[i];
}
#undef Q8T_ISSUE

static inline __attribute__((always_inline)) void q8t_tile_strip(const int KIND, const weights_t *w, int64_t strip,
                                                                 const q8_x_t *xs, int64_t m_total, int64_t stride,
                                                                 const float *bias, const q8t_factors_t *f,
                                                                 uint8_t *widened, int32_t *starts, float *out) {
    const int64_t groups = w->k / 32, units = groups * Q8T_UNITS(KIND), n0 = 16 * strip;
    const int64_t per_tile = q8t_k_quant(KIND) ? units / Q8T_BLOCK_UNITS(KIND) : units;
    const int64_t width = w->n - n0 < 16 ? w->n - n0 : 16;
    const __mmask16 valid = (__mmask16)((1u << width) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    const uint8_t *values = w->data + strip * w->row_bytes;
    q8t_widen(KIND, values, groups, widened, starts);
    for (int64_t m0 = 0; m0 < m_total; m0 += 16) {
        const int rows = m_total - m0 < 16 ? (int)(m_total - m0) : 16;
        __m512 y[16];
        q8t_tile_rows(KIND, values, widened, starts, units, xs[0].uq + m0 * stride, stride, f->d + m0 * per_tile,
                      f->o + m0 * units, rows, y);
        for (int i = 0; i < rows; i++) _mm512_mask_storeu_ps(out + (m0 + i) * w->n + n0, valid, _mm512_add_ps(y[i], b));
    }
}

/* out[m_total, n] = rounded rows xs (q8_prepare's, padded with zero rows to a multiple of 16, `stride` bytes
   apart) times a tiled weight's transpose (+ bias) on the tiles, strips shared among the threads. Returns 0, or -1
   when scratch memory ran out. */
static int q8t_tile_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, int64_t stride, const float *bias,
                             float *out, int num_threads) {
    const int64_t strips = (w->n + 15) / 16;
    q8t_factors_t f;
    if (q8t_gather_factors(w->kind, xs, m_total, w->k / 32 * Q8T_UNITS(w->kind), &f)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *widened = aligned_alloc(64, (size_t)(w->k / 32 * (512 + 2 * 64)));
        int32_t *starts = widened ? (int32_t *)(widened + w->k / 32 * 512) : NULL;
        if (widened) q8t_configure(w->kind == KIND_Q6_K ? 16 : 32, m_total < 16 ? (int)m_total : 16);
        else failed = 1;
#pragma omp for schedule(static)
        for (int64_t strip = 0; strip < strips; strip++) {
            if (failed) continue;
            switch (w->kind) { /* constant kinds, so each unit's steps inline */
#define Q8T_STRIP(K) case K: q8t_tile_strip(K, w, strip, xs, m_total, stride, bias, &f, widened, starts, out); break;
            Q8_EACH_KIND(Q8T_STRIP)
#undef Q8T_STRIP
            }
        }
        if (widened) _tile_release();
        free(widened);
    }
    free(f.d);
    return failed ? -1 : 0;
}

#endif
