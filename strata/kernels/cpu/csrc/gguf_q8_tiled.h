/* GGUF weights laid out once, at load, for the int8-activation kernels (quantized_activations=int8 on AVX2 builds
   and up), as llama.cpp's repack does: 16 outputs a strip, each group of 32 values as the 8 rows of 64 bytes that an
   AMX int8 tile holds (row p: the values 4p .. 4p + 3 of each output in turn), 4-bit values two rows a byte, a fifth
   (and Q6_K's sixth) bit a 64-bit mask a row (AVX2 builds: Q6_K's two as Q8T_HIGH_PLANES), values unsigned (Q4_0 /
   Q5_0 / Q8_0 / Q6_K: q + 8 / 16 / 128 / 32, the weights' zero taken off through x's sums). The legacy kinds'
   groups end with their 16 outputs' fp16 d (and m): 16 times a block's bytes. A K-quant block's 8 groups follow a
   header of the 16 outputs' fp16 d (and dmin) and their sub-blocks' scales (and mins) as bytes, [sub-block][output].
   One layout serves the VNNI kernels here (vpdpbusd: 16 outputs a register, x's 4 bytes broadcast, any rows of x) and
   the AMX tiles (gguf_q8_tiled_amx.h, which widens it to bytes without the per-product packing), and AVX2's
   (gguf_q8_tiled_avx2.h), with the same integer sums and the same float steps in each: a row of x gets the same bits
   whatever rows share its product, and whichever of them the build has. A unit is what one scale covers (32 values;
   Q6_K's 16).
   Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_TILED_H
#define STRATA_GGUF_Q8_TILED_H

enum { KIND_GGUF_Q8T = 96 }; /* + ggml's type: that GGUF kind in the tile layout, products with x rounded to 8 bits */

/* Q6_K's two high bits on AVX2 builds without AVX-512 (no mask registers): a byte per value of 4 rows, 2 bits a row
   (bits 2 * (p % 4), in the plane of rows p / 4), where the masks would take 12 instructions a row to spread. */
#define Q8T_HIGH_PLANES (STRATA_AVX2 && !STRATA_AVX512VNNI)

/* Rows of x from which a tiled weight's products take the AMX tiles (fewer: the VNNI kernels here). The tiles pay a
   fixed cost per strip (its values widened to bytes, a tile stored per unit), which only many rows repay while the
   weights come from L3 or memory, as a model's do: 2 Xeon threads, [2048 x 1024] weights cycling through 256 MiB, us,
   VNNI against AMX, at 9 rows: Q4_0 117-124 / 155-166, Q4_1 146-163 / 193-196, Q8_0 156-160 / 201-215, Q6_K 168-235
   / 265-279; at 16 rows VNNI's or even (Q4_K 178-207 / 200-226), at 24 about even; from 32 AMX's (one thread, Q4_1
   [3072 x 576]: 32 rows 466-498 / 430-448, 64 rows 877-925 / 732-765). */
#define Q8T_MIN_TILE_ROWS 17

/* Every kind with int8-activation kernels (Q8_EACH_KIND) has this layout. */
static inline int q8t_k_quant(int kind) { return gguf_block_values(kind) == QK_K; }

/* Bytes of a group's values, of a K-quant block's header, and of a group (legacy) or a block (K-quants). */
static inline int64_t q8t_value_bytes(int kind) {
    switch (kind) {
    case KIND_Q8_0: return 512;
    case KIND_Q5_0: case KIND_Q5_1: case KIND_Q5_K: return 320;
    case KIND_Q6_K: return 384;
    default: return 256;
    }
}
static inline int64_t q8t_header_bytes(int kind) { return kind == KIND_Q6_K ? 32 + 256 : 32 + 32 + 128 + 128; }
static inline int64_t q8t_stride(int kind) {
    return q8t_k_quant(kind) ? q8t_header_bytes(kind) + 8 * q8t_value_bytes(kind) : 16 * gguf_block_bytes(kind);
}

/* What the layout's unsigned values exceed the signed ones by: the kind's zero, Q8_0's 128. */
static inline int q8t_zero(int kind) { return kind == KIND_Q8_0 ? 128 : gguf_zero(kind); }

/* A strip's bytes for rows of k values (a whole number of the kind's blocks). */
static inline int64_t q8t_strip_bytes(int kind, int64_t k) { return k / gguf_block_values(kind) * q8t_stride(kind); }

/* Group u's values in a strip. */
static inline const uint8_t *q8t_group(int kind, const uint8_t *strip, int64_t u) {
    if (!q8t_k_quant(kind)) return strip + u * q8t_stride(kind);
    return strip + u / 8 * q8t_stride(kind) + q8t_header_bytes(kind) + u % 8 * q8t_value_bytes(kind);
}

/* Output j's 32 values of group u (unsigned) into the group's rows g. */
static void q8t_put_values(int kind, const int q[32], int j, uint8_t *g) {
    for (int l = 0; l < 32; l++) {
        const int v = q[l] + (kind == KIND_Q8_0 ? 128 : 0), p = l / 4, at = 4 * j + l % 4;
        if (kind == KIND_Q8_0) {
            g[64 * p + at] = (uint8_t)v;
            continue;
        }
        g[64 * (p % 4) + at] |= (uint8_t)((v & 15) << (p >= 4 ? 4 : 0));
        if (kind == KIND_Q6_K && Q8T_HIGH_PLANES) {
            g[256 + 64 * (p / 4) + at] |= (uint8_t)((v >> 4) << 2 * (p % 4));
            continue;
        }
        if (v & 16) g[256 + 8 * p + at / 8] |= (uint8_t)(1u << (at % 8));
        if (v & 32) g[320 + 8 * p + at / 8] |= (uint8_t)(1u << (at % 8));
    }
}

/* Output j's scales of block b (header h): K-quants' fp16 d (dmin) and sub-block scales (mins). */
static void q8t_put_header(int kind, const uint8_t *block, int j, uint8_t *h) {
    if (kind == KIND_Q6_K) {
        memcpy(h + 2 * j, block + 208, 2);
        for (int i = 0; i < 16; i++) h[32 + 16 * i + j] = block[192 + i];
        return;
    }
    memcpy(h + 2 * j, block, 2);
    memcpy(h + 32 + 2 * j, block + 2, 2);
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        k_scale_min(block + 4, i, &sc, &mn);
        h[64 + 16 * i + j] = (uint8_t)sc, h[192 + 16 * i + j] = (uint8_t)mn;
    }
}

/* Outputs n0 .. n0 + 15 of a GGUF weight (rows src_row_bytes apart; rows past n: zeros) into one strip. */
static void q8t_layout_strip(int kind, const uint8_t *src, int64_t src_row_bytes, int64_t n, int64_t k, int64_t n0,
                             uint8_t *strip) {
    const int64_t groups = k / 32, per_block = gguf_block_values(kind), block_bytes = gguf_block_bytes(kind);
    const int64_t value_bytes = q8t_value_bytes(kind);
    memset(strip, 0, (size_t)q8t_strip_bytes(kind, k));
    for (int j = 0; j < 16 && n0 + j < n; j++) {
        for (int64_t u = 0; u < groups; u++) {
            const uint8_t *block = src + (n0 + j) * src_row_bytes + u * 32 / per_block * block_bytes;
            uint8_t *g = (uint8_t *)q8t_group(kind, strip, u);
            int q[32];
            float scale[2], offset[2];
            gguf_run_scalar(kind, block, (int)(u % (per_block / 32)), q, scale, offset);
            q8t_put_values(kind, q, j, g);
            if (q8t_k_quant(kind) && u % 8 == 0) q8t_put_header(kind, block, j, strip + u / 8 * q8t_stride(kind));
            if (q8t_k_quant(kind)) continue;
            memcpy(g + value_bytes + 2 * j, block, 2);
            if (kind == KIND_Q4_1 || kind == KIND_Q5_1) memcpy(g + value_bytes + 32 + 2 * j, block + 2, 2);
        }
    }
}

/* Units (values one scale covers) of a group, and of a block. */
#define Q8T_UNITS(KIND) ((KIND) == KIND_Q6_K ? 2 : 1)
#define Q8T_BLOCK_UNITS(KIND) (gguf_block_values(KIND) / 32 * Q8T_UNITS(KIND))

/* Where unit v's weight factors lie in a strip, the 16 outputs' side by side: fp16 d and (Q4_1 / Q5_1 / K-quants)
   m or dmin; the K-quants' sub-block scale and min bytes (Q6_K's scales signed, no mins); q8t_put_header's places. */
typedef struct {
    const uint8_t *d, *m, *scale, *min;
} q8t_unit_bytes_t;
static inline q8t_unit_bytes_t q8t_unit_bytes(const int KIND, const uint8_t *strip, int64_t v) {
    if (!q8t_k_quant(KIND)) {
        const uint8_t *d = strip + v * q8t_stride(KIND) + q8t_value_bytes(KIND);
        return (q8t_unit_bytes_t){d, d + 32, NULL, NULL};
    }
    const uint8_t *h = strip + v / Q8T_BLOCK_UNITS(KIND) * q8t_stride(KIND);
    const int64_t i = v % Q8T_BLOCK_UNITS(KIND);
    if (KIND == KIND_Q6_K) return (q8t_unit_bytes_t){h, NULL, h + 32 + 16 * i, NULL};
    return (q8t_unit_bytes_t){h, h + 32, h + 64 + 16 * i, h + 192 + 16 * i};
}

/* Group u's lines (at g; a K-quant block's header with its first group) asked for 4 KiB ahead. */
static inline __attribute__((always_inline)) void q8t_prefetch(const int KIND, const uint8_t *g, int64_t u) {
    if (!q8t_k_quant(KIND)) prefetch_ahead(g, q8t_stride(KIND));
    else prefetch_ahead(g - (u % 8 == 0 ? q8t_header_bytes(KIND) : 0),
                        q8t_value_bytes(KIND) + (u % 8 == 0 ? q8t_header_bytes(KIND) : 0));
}

/* x's 4 bytes at q as one int32 (the lane a broadcast puts them in). */
static inline int32_t q8t_quad(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return v;
}

/* Where row x's integer sum of unit v starts: minus the weights' zero times x's sum over the unit. */
static inline int32_t q8t_start(const int KIND, const q8_x_t *x, int64_t v) {
    if (KIND == KIND_Q6_K) return -q8t_zero(KIND) * x->sum16[v]; /* units of 16 */
    return -q8t_zero(KIND) * x->sum32[v];
}

/* Where q8t_add finds row x's factors of unit v: x's d, and what the weights' offset meets (Q8_1's s, or the sum). */
static inline const float *q8t_dx(const int KIND, const q8_x_t *x, int64_t v) {
    return q8t_k_quant(KIND) ? NULL : x->d + v;
}
static inline const float *q8t_ox(const int KIND, const q8_x_t *x, int64_t v) {
    if (!gguf_has_offsets(KIND)) return NULL;
    return q8t_k_quant(KIND) ? x->sum32_f + v : x->s + v;
}

#if STRATA_AVX512VNNI
static inline __mmask64 q8t_mask(const uint8_t *p) {
    uint64_t bits;
    memcpy(&bits, p, sizeof bits);
    return _cvtu64_mask64(bits);
}

/* The 8 tile rows of a group's values (unsigned bytes; row p: values 4p .. 4p + 3 of each output). */
static inline __attribute__((always_inline)) void q8t_values(const int KIND, const uint8_t *g, __m512i w[8]) {
    if (KIND == KIND_Q8_0) {
        for (int p = 0; p < 8; p++) w[p] = _mm512_loadu_si512((const void *)(g + 64 * p));
        return;
    }
    const __m512i low = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(g + 64 * p));
        w[p] = _mm512_and_si512(v, low), w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    for (int bit = 4; bit < 6; bit++) { /* the fifth bits (Q5_*, Q6_K) and sixth (Q6_K), a mask a row */
        if (q8t_value_bytes(KIND) < 256 + 64 * (bit - 3)) break;
        const __m512i add = _mm512_set1_epi8((char)(1 << bit));
        for (int p = 0; p < 8; p++)
            w[p] = _mm512_mask_add_epi8(w[p], q8t_mask(g + 256 + 64 * (bit - 4) + 8 * p), w[p], add);
    }
}

/* Unit v's weight factors for 16 outputs: the scale its sums take (legacy: d; K-quants: d * sub-block scale) and
   the offset (Q4_1 / Q5_1: m; Q4_K / Q5_K: dmin * sub-block min). */
static inline __attribute__((always_inline)) void q8t_unit(const int KIND, const uint8_t *strip, int64_t v,
                                                           __m512 *scale, __m512 *offset) {
    const q8t_unit_bytes_t f = q8t_unit_bytes(KIND, strip, v);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)f.d));
    const __m512 m = gguf_has_offsets(KIND) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)f.m))
                                            : _mm512_setzero_ps();
    if (!q8t_k_quant(KIND)) {
        *scale = d, *offset = m;
        return;
    }
    const __m128i sc = _mm_loadu_si128((const __m128i *)f.scale);
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(KIND == KIND_Q6_K ? _mm512_cvtepi8_epi32(sc)
                                                                    : _mm512_cvtepu8_epi32(sc)));
    *offset = KIND == KIND_Q6_K ? m : _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                        _mm_loadu_si128((const __m128i *)f.min))));
}

/* A row's exact sum of unit v into acc: legacy kinds times the weights' d and x's d of the block (*dx), and their m
   times x's s (*ox); K-quants times the weights' scale, less their offset times x's sum over the unit (*ox), x's d
   applied once a block (q8t_flush). */
static inline __attribute__((always_inline)) __m512 q8t_add(const int KIND, __m512i sum, __m512 scale, __m512 offset,
                                                           const float *dx, const float *ox, __m512 acc) {
    if (!q8t_k_quant(KIND)) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(*dx)), acc);
        return gguf_has_offsets(KIND) ? _mm512_fmadd_ps(offset, _mm512_set1_ps(*ox), acc) : acc;
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
    return gguf_has_offsets(KIND) ? _mm512_fnmadd_ps(offset, _mm512_set1_ps(*ox), acc) : acc;
}

/* After a K-quant block's last unit: its sums times x's d of the block into total, acc zeroed. */
static inline __attribute__((always_inline)) void q8t_flush(float d, __m512 *acc, __m512 *total) {
    *total = _mm512_fmadd_ps(*acc, _mm512_set1_ps(d), *total);
    *acc = _mm512_setzero_ps();
}

/* Rows of x one pass over a strip serves at most: Q8V_ROWS, or 9 together (a verification step's token and 8 drafts),
   where passes of 8 and 1 made each group's values twice (one core, 9 rows of [576 x 1536]: 5-15% faster). */
#define Q8T_MAX_ROWS 9

/* R rows of x (xs) times one strip, every group: out[r], 16 outputs each. */
static inline __attribute__((always_inline)) void q8t_rows(const int KIND, const int R, const uint8_t *strip,
                                                           int64_t groups, const q8_x_t *xs, __m512 out[]) {
    const int units = Q8T_UNITS(KIND), quads = 8 / units;
    __m512 acc[Q8T_MAX_ROWS], total[Q8T_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = total[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < groups; u++) {
        const uint8_t *g = q8t_group(KIND, strip, u);
        q8t_prefetch(KIND, g, u);
        __m512i w[8];
        q8t_values(KIND, g, w);
        __m512 scale[2], offset[2];
        for (int s = 0; s < units; s++) q8t_unit(KIND, strip, u * units + s, scale + s, offset + s);
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const q8_x_t *x = xs + r;
            for (int s = 0; s < units; s++) {
                const int64_t v = u * units + s;
                __m512i sum = _mm512_set1_epi32(q8t_start(KIND, x, v));
                for (int p = s * quads; p < (s + 1) * quads; p++)
                    sum = _mm512_dpbusd_epi32(sum, w[p], _mm512_set1_epi32(q8t_quad(x->q + 32 * u + 4 * p)));
                acc[r] = q8t_add(KIND, sum, scale[s], offset[s], q8t_dx(KIND, x, v), q8t_ox(KIND, x, v), acc[r]);
            }
            if (q8t_k_quant(KIND) && u % 8 == 7) q8t_flush(x->d[u / 8], acc + r, total + r);
        }
    }
    for (int r = 0; r < R; r++) out[r] = q8t_k_quant(KIND) ? total[r] : acc[r];
}

/* count (Q8T_MAX_ROWS, Q8V_ROWS or a power of two below it) rows of x times one strip. */
static void q8t_rows_any(int kind, int count, const uint8_t *strip, int64_t groups, const q8_x_t *xs, __m512 out[]) {
#define Q8T_COUNTS(K)                                                                                              \
    case K:                                                                                                        \
        if (count == 9) q8t_rows(K, 9, strip, groups, xs, out);                                                    \
        else if (count == 8) q8t_rows(K, 8, strip, groups, xs, out);                                               \
        else if (count == 4) q8t_rows(K, 4, strip, groups, xs, out);                                               \
        else if (count == 2) q8t_rows(K, 2, strip, groups, xs, out);                                               \
        else q8t_rows(K, 1, strip, groups, xs, out);                                                               \
        break;
    switch (kind) { Q8_EACH_KIND(Q8T_COUNTS) }
#undef Q8T_COUNTS
}

/* out[m_total, n] = rounded rows xs times a tiled weight's transpose (+ bias): strips shared among the threads, each
   read once for every Q8V_ROWS rows of x (all 9 of 9). */
static void q8t_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                         int num_threads) {
    const int64_t strips = (w->n + 15) / 16, groups = w->k / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (strips * w->row_bytes * m_total >= (1 << 16))
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t n0 = 16 * strip, width = w->n - n0 < 16 ? w->n - n0 : 16;
        const __mmask16 valid = (__mmask16)((1u << width) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
        for (int64_t m = 0; m < m_total;) {
            int count = m_total - m == Q8T_MAX_ROWS ? Q8T_MAX_ROWS : Q8V_ROWS;
            while (count > m_total - m) count /= 2;
            __m512 y[Q8T_MAX_ROWS];
            q8t_rows_any(w->kind, count, w->data + strip * w->row_bytes, groups, xs + m, y);
            for (int r = 0; r < count; r++, m++)
                _mm512_mask_storeu_ps(out + m * w->n + n0, valid, _mm512_add_ps(y[r], b));
        }
    }
}
#elif STRATA_AVX2
#include "gguf_q8_tiled_avx2.h"
#endif

#endif
