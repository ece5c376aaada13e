/* GGUF products with x rounded to 8 bits on AMX's int8 tiles (tdpbusd; Sapphire Rapids and later), for prefill-sized
   batches: x + 128 (unsigned) against the weights' signed values (q less the kind's whole offset: Q4_0's 8, Q5_0's
   16, Q6_K's 32), 16 rows of x by 16 outputs by one scale group of K (32 values; Q6_K's 16) a tile product, exact
   int32 sums that start from -128 times the weights' own. They take the group's scales in float32 with AVX-512 (the
   weight's d * scale times x's d; the mins' offset times x's s, or for the K-quants times x's sum, with x's d applied
   once a block) while the next group's tile product runs. Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_AMX_H
#define STRATA_GGUF_Q8_AMX_H
#include "amx_tiles.h"

/* Rows of x from which the tiles take a product (fewer: the VNNI kernels): the legacy kinds' values cost little to
   pack, the K-quants' more, and their VNNI kernels are quicker (one Sapphire Rapids core, 1536 x 768: Q4_1 at 8 rows
   176 us on the tiles, 219 with VNNI; Q6_K 280 and 160; at 16 rows both kinds are quicker on the tiles). */
static inline int q8x_min_rows(int kind) { return gguf_block_values(kind) == 32 ? 8 : 16; }

/* One strip of 16 weight rows packed for the tiles, per scale group u (a run of 32 values; Q6_K: each 16): the
   signed values [u][K quads of the group][16 rows][4], each row's scale, -128 times its values' sum (where the tile
   sums of x + 128 start, to be x's alone), and its offset (the mins: Q4_1 / Q5_1's m, the K-quants' -dmin * mn; zero
   for the others). */
typedef struct {
    int8_t *values;
    float *scale, *offset;
    int32_t *start;
} q8x_strip_t;

/* Row n's 64 values from value 64 i (runs 2i and 2i + 1; signed, as the tiles take them) and their groups' scales
   and offsets (scale[g], offset[g] for each group g of the 64 values: 2 runs, or Q6_K's 4 sixteens). */
static inline __attribute__((always_inline)) __m512i q8x_values(const int KIND, const uint8_t *row, int64_t i,
                                                                float *scale, float *offset) {
    const int64_t per_block = gguf_block_values(KIND), bytes = gguf_block_bytes(KIND);
    const uint8_t *block = row + 64 * i / per_block * bytes;
    if (per_block == 32) {
        const uint8_t *next = block + bytes;
        scale[0] = half_at(block), scale[1] = half_at(next);
        if (KIND == KIND_Q4_1 || KIND == KIND_Q5_1) offset[0] = half_at(block + 2), offset[1] = half_at(next + 2);
        return q8v_legacy_values(KIND, block);
    }
    const int quarter = (int)(i % 4);
    if (KIND == KIND_Q6_K) {
        const float d = half_at(block + 208);
        for (int g = 0; g < 4; g++) scale[g] = d * (float)(int8_t)block[192 + 4 * quarter + g];
        return q8v_q6k_values(block, quarter);
    }
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int g = 0; g < 2; g++) {
        int sc, mn;
        k_scale_min(block + 4, 2 * quarter + g, &sc, &mn);
        scale[g] = d * (float)sc, offset[g] = -(dmin * (float)mn);
    }
    return q8v_q45k_values(KIND, block, quarter);
}

/* Weight rows n0 .. n0 + 15 (rows past n: zeros) packed into s, 64 values of each row a transpose (a legacy row's
   odd last block alone). */
static inline __attribute__((always_inline)) void q8x_pack(const int KIND, const weights_t *w, int64_t n0,
                                                           int64_t runs, q8x_strip_t *s) {
    const int group = KIND == KIND_Q6_K ? 16 : 32, per64 = 64 / group;
    const __m512i one = _mm512_set1_epi8(1);
    for (int64_t i = 0; i < (runs + 1) / 2; i++) {
        const int lone = gguf_block_values(KIND) == 32 && 2 * i + 1 == runs; /* run 2i is a legacy row's last */
        __m512i rows[16];
        for (int j = 0; j < 16; j++) {
            float scale[4] = {0.f, 0.f, 0.f, 0.f}, offset[4] = {0.f, 0.f, 0.f, 0.f};
            rows[j] = _mm512_setzero_si512();
            if (n0 + j < w->n && !lone) {
                rows[j] = q8x_values(KIND, w->data + (n0 + j) * w->row_bytes, i, scale, offset);
            } else if (n0 + j < w->n) { /* the lone block as the second of a pair whose first is zeros */
                const int64_t bytes = gguf_block_bytes(KIND);
                uint8_t pair[2 * 34] = {0}; /* 34: the largest legacy block (Q8_0) */
                memcpy(pair + bytes, w->data + (n0 + j) * w->row_bytes + 2 * i * bytes, (size_t)bytes);
                rows[j] = q8x_values(KIND, pair, 0, scale, offset);
                rows[j] = _mm512_shuffle_i64x2(rows[j], rows[j], _MM_SHUFFLE(3, 2, 3, 2));
                scale[0] = scale[1], offset[0] = offset[1];
            }
            for (int g = 0; g < per64 && i * per64 + g < runs * (32 / group); g++)
                s->scale[(i * per64 + g) * 16 + j] = scale[g], s->offset[(i * per64 + g) * 16 + j] = offset[g];
        }
        transpose16(rows); /* row j held row j's 16 quads; now row p holds quad p of the 16 rows */
        for (int p = 0; p < 16; p++) _mm512_store_si512(s->values + (16 * i + p) * 64, rows[p]);
        for (int g = 0; g < per64 && i * per64 + g < runs * (32 / group); g++) { /* each row's sum of the group */
            __m512i sum = _mm512_setzero_si512();
            for (int p = g * group / 4; p < (g + 1) * group / 4; p++) sum = _mm512_dpbusd_epi32(sum, one, rows[p]);
            _mm512_store_si512(s->start + (i * per64 + g) * 16,
                               _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
        }
    }
}

static void q8x_pack_any(const weights_t *w, int64_t n0, int64_t runs, q8x_strip_t *s) {
    switch (w->kind) { /* constant kinds, so each run's extraction inlines */
#define Q8X_PACK(K) case K: q8x_pack(K, w, n0, runs, s); break;
    Q8_EACH_KIND(Q8X_PACK)
#undef Q8X_PACK
    }
}

/* One group's tile sums into the first `rows` rows of acc: legacy kinds (PER_BLOCK 32) acc[i] += t[i] * scale * dx[i]
   (+ offset * tx[i]); K-quants (256), whose x shares one d over the groups of a block, acc[i] += t[i] * scale (+ offset
   * tx[i], x's sum over the group), x's d applied once a block (q8x_flush). */
static inline __attribute__((always_inline)) void q8x_add(const int PER_BLOCK, const int32_t t[16][16],
                                                          const q8x_strip_t *s, int64_t u, const float *dx,
                                                          const float *tx, int rows, __m512 acc[16]) {
    const __m512 scale = _mm512_load_ps(s->scale + 16 * u), offset = _mm512_load_ps(s->offset + 16 * u);
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        if (i >= rows) break;
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)t[i]));
        acc[i] = _mm512_fmadd_ps(sums, PER_BLOCK == 32 ? _mm512_mul_ps(scale, _mm512_set1_ps(dx[i])) : scale, acc[i]);
        if (tx) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(tx[i]), acc[i]);
    }
}

/* A K-quant block's sums (acc, zeroed) times x's d per row into total. */
static inline __attribute__((always_inline)) void q8x_flush(const float *dx, int rows, __m512 acc[16],
                                                            float total[16][16]) {
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        if (i >= rows) break;
        _mm512_store_ps(total[i], _mm512_fmadd_ps(acc[i], _mm512_set1_ps(dx[i]), _mm512_load_ps(total[i])));
        acc[i] = _mm512_setzero_ps();
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

/* Group u's tile product into sums tile C (x's tile A, the strip's tile B), its sums starting from the strip's. */
#define Q8X_ISSUE(C, A, B, u)                                                                                      \
    do {                                                                                                           \
        _tile_loadd(A, uq + (u) * group, stride);                                                                 \
        _tile_loadd(B, s->values + (u) * 16 * group, 64);                                                         \
        _tile_loadd(C, s->start + 16 * (u), 0);                                                                   \
        _tile_dpbusd(C, A, B);                                                                                     \
    } while (0)

/* Group u's tile sums (stored in buffer T) into acc; a K-quant block's last group flushes them into total. */
#define Q8X_ADD(T, u)                                                                                              \
    do {                                                                                                           \
        q8x_add(PER_BLOCK, t[T], s, u, dx + 16 * (u), tx ? tx + 16 * (u) : NULL, rows, acc);                      \
        if (PER_BLOCK == 256 && ((u) + 1) % (256 / group) == 0) q8x_flush(dx + 16 * (u), rows, acc, total);         \
    } while (0)

/* Rows m0 .. m0 + rows - 1 (rows <= 16; the tile's other rows zeros) of x (their q + 128 at uq, rows `stride` bytes
   apart) times one packed strip, every group: total[16][16], rows of 16 outputs. dx, tx: [groups][16] x's scales
   and mins' factors for these rows (tx NULL: none). Two tile sums in turn: a group's product runs while the one
   before it is stored and the one before that is scaled, so that the vector units never wait on the tiles. */
static inline __attribute__((always_inline)) void q8x_strip_rows(const int PER_BLOCK, const uint8_t *uq,
                                                                 int64_t stride, int64_t groups, int group,
                                                                 const q8x_strip_t *s, const float *dx,
                                                                 const float *tx, int rows, float total[16][16]) {
    _Alignas(64) int32_t t[2][16][16];
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps(), _mm512_store_ps(total[i], acc[i]);
    Q8X_ISSUE(0, 2, 3, 0);
    for (int64_t u = 0; u < groups; u += 2) {
        if (u + 1 < groups) Q8X_ISSUE(1, 4, 5, u + 1);
        _tile_stored(0, t[0], 64);
        if (u > 0) Q8X_ADD(1, u - 1);
        if (u + 2 < groups) Q8X_ISSUE(0, 2, 3, u + 2);
        if (u + 1 < groups) _tile_stored(1, t[1], 64);
        Q8X_ADD(0, u);
    }
    if (groups % 2 == 0) Q8X_ADD(1, groups - 1);
    if (PER_BLOCK == 32)
        for (int i = 0; i < 16; i++) _mm512_store_ps(total[i], acc[i]);
}
#undef Q8X_ADD
#undef Q8X_ISSUE

/* x's per-group factors for rows m (groups of `group` values): dx[m / 16][u][m % 16] its d, tx the mins' factor
   (Q8_1's s for Q4_1 / Q5_1, the run's sum of q for the K-quants, whose d applies once a block); rows past m_total
   zero. */
static void q8x_row_factors(const q8_x_t *xs, int64_t m_total, int64_t m_pad, int64_t groups, int group,
                            int per_block, float *dx, float *tx) {
    for (int64_t m = 0; m < m_pad; m++)
        for (int64_t u = 0; u < groups; u++) {
            const int64_t at = (m / 16 * groups + u) * 16 + m % 16, first = u * group;
            const int live = m < m_total;
            dx[at] = live ? xs[m].d[first / per_block] : 0.f;
            if (!tx) continue;
            tx[at] = !live ? 0.f : per_block == 32 ? xs[m].s[first / 32]
                                                    : (float)(xs[m].sum16[first / 16] + xs[m].sum16[first / 16 + 1]);
        }
}

/* out[m_total, n] = rounded rows xs (q8_prepare's, padded with zero rows to a multiple of 16, `stride` bytes
   apart) times a GGUF weight's transpose (+ bias) on the tiles, strips of 16 outputs shared among the threads.
   Returns 0, or -1 when scratch memory ran out. */
static int q8x_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, int64_t stride, const float *bias,
                        float *out, int num_threads) {
    const int group = w->kind == KIND_Q6_K ? 16 : 32, per_block = (int)gguf_block_values(w->kind);
    const int64_t runs = w->k / 32, groups = w->k / group, m_pad = (m_total + 15) / 16 * 16;
    const int offsets = gguf_has_offsets(w->kind);
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
        if (s.values && s.scale && s.start) s.offset = s.scale + groups * 16, q8x_configure(group);
        else failed = 1;
#pragma omp for schedule(static)
        for (int64_t strip = 0; strip < strips; strip++) {
            if (failed) continue;
            const int64_t n0 = 16 * strip, width = w->n - n0 < 16 ? w->n - n0 : 16;
            const __mmask16 valid = (__mmask16)((1u << width) - 1);
            q8x_pack_any(w, n0, runs, &s);
            for (int64_t m0 = 0; m0 < m_pad; m0 += 16) {
                _Alignas(64) float total[16][16];
                const int rows = m_total - m0 < 16 ? (int)(m_total - m0) : 16;
                const uint8_t *uq = xs[0].uq + m0 * stride;
                const float *dx_rows = dx + m0 * groups, *tx_rows = tx ? tx + m0 * groups : NULL;
                if (per_block == 32) q8x_strip_rows(32, uq, stride, groups, group, &s, dx_rows, tx_rows, rows, total);
                else q8x_strip_rows(256, uq, stride, groups, group, &s, dx_rows, tx_rows, rows, total);
                const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
                for (int64_t i = 0; i < rows; i++)
                    _mm512_mask_storeu_ps(out + (m0 + i) * w->n + n0, valid, _mm512_add_ps(_mm512_load_ps(total[i]), b));
            }
        }
        if (!failed) _tile_release();
        free(s.values), free(s.scale), free(s.start);
    }
    free(dx);
    return failed ? -1 : 0;
}

#endif
