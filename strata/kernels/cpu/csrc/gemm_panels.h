/* How the GEMM (weight_gemm.c) lays out its operands: weight panels [kc][16], each output's values widened to float32
   once a call (int8, int4 and the quantized GGUF kinds transposed as bytes first, other kinds widened row by row,
   then transposed as floats), and x in blocks of 6 rows. Included by weight_gemm.c after its tile sizes. */
#ifndef STRATA_GEMM_PANELS_H
#define STRATA_GEMM_PANELS_H
#include "isa.h"

#if STRATA_AVX2
/* Blocks of row r from value k0 (a multiple of 32) until `end` into dst, group by group: for a quantized KIND
   (q - zero) * scale, as the reference dequantizes. */
static inline __attribute__((always_inline)) void widen_blocks(const weights_t *w, int64_t r, int64_t k0,
                                                               int64_t end, const int KIND, float *dst) {
    const uint8_t *row = w->data + r * w->row_bytes;
    for (int64_t i = 0; i < end;) {
        const int64_t g = scaled(KIND) ? (k0 + i) / w->group_size : 0;
        const int64_t group_end = scaled(KIND) ? (g + 1) * w->group_size - k0 : end;
        const int64_t stop = group_end < end ? group_end : end;
        const __m256 scale = _mm256_set1_ps(scaled(KIND) ? w->scales[r * w->groups + g] : 1.f);
        const __m256 zero = _mm256_set1_ps(scaled(KIND) ? zero_point(w, r, g) : 0.f);
        for (; i < stop; i += BLOCK) {
            __m256 v[4];
            load_block(KIND, row, (k0 + i) / BLOCK, v);
            for (int j = 0; j < 4; j++)
                v[j] = scaled(KIND) ? _mm256_mul_ps(_mm256_sub_ps(v[j], zero), scale) : v[j];
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(dst + i + 8 * j, v[j]);
        }
    }
}
#endif

/* Values k0 .. k0 + kc of weight row r (kc <= KC) as float32 into dst, then zeros up to a multiple of 8.
   Quantized rows are padded to whole blocks in memory; bfloat16 rows are not, so their last block goes one by one. */
static void widen_row(const weights_t *w, int64_t r, int64_t k0, int64_t kc, float *dst) {
    const int quantized = scaled(w->kind);
    int64_t i = 0;
    /* GGUF blocks (plain C builds; AVX2 takes pack_strip_gguf): whole runs of 32, K is whole blocks, KC a multiple */
    if (gguf_block_values(w->kind)) {
        gguf_row_floats(w->kind, w->data + r * w->row_bytes, k0, kc, dst);
        return;
    }
#if STRATA_AVX2
    i = quantized ? (kc + BLOCK - 1) / BLOCK * BLOCK : kc / BLOCK * BLOCK;
    switch (w->kind) { /* constant kinds, so each load inlines */
    case KIND_F32: widen_blocks(w, r, k0, i, KIND_F32, dst); break;
    case KIND_F16: widen_blocks(w, r, k0, i, KIND_F16, dst); break;
    case KIND_BF16: widen_blocks(w, r, k0, i, KIND_BF16, dst); break;
    case KIND_INT4: widen_blocks(w, r, k0, i, KIND_INT4, dst); break;
    case KIND_FP8: widen_blocks(w, r, k0, i, KIND_FP8, dst); break;
    default: widen_blocks(w, r, k0, i, KIND_INT8, dst);
    }
#endif
    const uint8_t *row = w->data + r * w->row_bytes;
    for (; i < kc; i++) {
        const int64_t k = k0 + i;
        float v = load_value(w, row, k);
        if (quantized) v = (v - zero_point(w, r, k / w->group_size)) * w->scales[r * w->groups + k / w->group_size];
        dst[i] = v;
    }
    for (i = kc; i % 8; i++) dst[i] = 0.f;
}

#if STRATA_AVX2
/* Block b of an int8 or int4 row as its 32 unsigned values, in order (int4's bytes 0-15 hold values 0-15 in their
   low nibbles, 16-31 in their high ones). */
static inline __m256i block_values(const int KIND, const uint8_t *row, int64_t b) {
    if (KIND == KIND_INT8) return _mm256_loadu_si256((const __m256i *)(row + b * BLOCK));
    const __m128i q = _mm_loadu_si128((const __m128i *)(row + b * (BLOCK / 2))), nibble = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nibble), _mm_and_si128(q, nibble));
}

/* One value of K of 16 outputs, u's 16 bytes, dequantized into dst[0..16) as (q - zero) * scale, each output's. */
static inline void widen_outputs(__m128i u, const __m256 zero[2], const __m256 scale[2], float *dst) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(u, u)));
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_sub_ps(lo, zero[0]), scale[0]));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_sub_ps(hi, zero[1]), scale[1]));
}

/* t[r]: 32 byte values of row r of 16 (values 0-15 in the low 128-bit lane, 16-31 in the high one) -> t[j]: value j
   of the 16 rows (high lane: value j + 16), through byte, word, dword and qword interleaves. */
static inline __attribute__((always_inline)) void transpose_bytes16(__m256i t[NR]) {
    __m256i u[NR];
    /* in each 128-bit lane (values 0-15, 16-31): bytes of rows 2p, 2p + 1, then words of 4 rows, dwords of 8,
       qwords of 16; u[8h + 4l + 2m + o] ends holding value 8h + 4l + 2m + o of the 16 rows (high lane: + 16) */
    for (int p = 0; p < 8; p++) {
        u[2 * p] = _mm256_unpacklo_epi8(t[2 * p], t[2 * p + 1]);
        u[2 * p + 1] = _mm256_unpackhi_epi8(t[2 * p], t[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) /* rows 4q .. 4q + 3; u[4q + h] holds values 8h .. 8h + 7 of rows 4q, 4q + 1 */
        for (int h = 0; h < 2; h++) {
            t[4 * q + 2 * h] = _mm256_unpacklo_epi16(u[4 * q + h], u[4 * q + 2 + h]);
            t[4 * q + 2 * h + 1] = _mm256_unpackhi_epi16(u[4 * q + h], u[4 * q + 2 + h]);
        }
    /* t[4q + 2h + l]: values 8h + 4l .. + 3 of rows 4q .. 4q + 3 */
    for (int e = 0; e < 2; e++) /* rows 8e .. 8e + 7 from row quads 2e, 2e + 1 */
        for (int hl = 0; hl < 4; hl++) {
            u[8 * e + 2 * hl] = _mm256_unpacklo_epi32(t[8 * e + hl], t[8 * e + 4 + hl]);
            u[8 * e + 2 * hl + 1] = _mm256_unpackhi_epi32(t[8 * e + hl], t[8 * e + 4 + hl]);
        }
    /* u[8e + 2(2h + l) + m]: values 8h + 4l + 2m, + 1 of rows 8e .. 8e + 7 */
    for (int v = 0; v < 8; v++) {
        t[2 * v] = _mm256_unpacklo_epi64(u[v], u[8 + v]);
        t[2 * v + 1] = _mm256_unpackhi_epi64(u[v], u[8 + v]);
    }
}

/* pack_strip for int8 and int4: the 16 rows' bytes are transposed before they are widened (a quarter of the data
   a transpose of floats moves, in four rounds of byte, word, dword and qword interleaves), then each value of K
   widens its 16 outputs at once, each with its own row's scale and zero point. Rows past n read row n - 1 with
   scale 0. */
static inline __attribute__((always_inline)) void pack_strip_bytes(const weights_t *w, int64_t n0, int64_t k0,
                                                                  int64_t kc, const int KIND, float *panel) {
    const uint8_t *row[NR];
    for (int r = 0; r < NR; r++) row[r] = w->data + (n0 + r < w->n ? n0 + r : w->n - 1) * w->row_bytes;
    __m256 zero[2], scale[2];
    int64_t group = -1;
    for (int64_t i = 0; i < kc; i += BLOCK) {
        const int64_t b = (k0 + i) / BLOCK, g = (k0 + i) / w->group_size;
        if (g != group) { /* each output's scale and zero point of this group */
            float z[NR], sc[NR];
            for (int r = 0; r < NR; r++) {
                const int live = n0 + r < w->n;
                sc[r] = live ? w->scales[(n0 + r) * w->groups + g] : 0.f;
                z[r] = live ? zero_point(w, n0 + r, g) : 0.f;
            }
            for (int h = 0; h < 2; h++) {
                scale[h] = _mm256_loadu_ps(sc + 8 * h);
                zero[h] = _mm256_loadu_ps(z + 8 * h);
            }
            group = g;
        }
        __m256i t[NR];
        for (int r = 0; r < NR; r++) t[r] = block_values(KIND, row[r], b);
        transpose_bytes16(t);
        /* t[2v + o]: value 2v + o (v = 4h + 2l + m) of the 16 rows, high lane value 2v + o + 16 */
        for (int j = 0; j < 16; j++) {
            widen_outputs(_mm256_castsi256_si128(t[j]), zero, scale, panel + (i + j) * NR);
            widen_outputs(_mm256_extracti128_si256(t[j], 1), zero, scale, panel + (i + j + 16) * NR);
        }
    }
}

/* pack_strip for the GGUF kinds, as for int8 and int4: each run of 32 values of the 16 rows is extracted as bytes
   with its per-16-value scale and offset (gguf_run_bytes), transposed, and each value of K widened for its 16
   outputs as q * scale + offset, each row's: the values the row-by-row widening gives. Rows past n read row n - 1
   with scale and offset 0. */
static inline __attribute__((always_inline)) void pack_strip_gguf(const weights_t *w, int64_t n0, int64_t k0,
                                                                 int64_t kc, const int KIND, float *panel) {
    const int64_t per_block = gguf_block_values(KIND), block_bytes = gguf_block_bytes(KIND);
    const uint8_t *row[NR];
    for (int r = 0; r < NR; r++) row[r] = w->data + (n0 + r < w->n ? n0 + r : w->n - 1) * w->row_bytes;
    for (int64_t i = 0; i < kc; i += 32) {
        const int64_t k = k0 + i, block = k / per_block * block_bytes;
        const int run = (int)(k % per_block / 32);
        float scale[2][NR], offset[2][NR]; /* [half of the run][row] */
        __m256i t[NR];
        for (int r = 0; r < NR; r++) {
            __m128i q[2];
            float sc[2], off[2];
            gguf_run_bytes(KIND, row[r] + block, run, q, sc, off);
            t[r] = _mm256_set_m128i(q[1], q[0]);
            const int live = n0 + r < w->n;
            for (int h = 0; h < 2; h++) scale[h][r] = live ? sc[h] : 0.f, offset[h][r] = live ? off[h] : 0.f;
        }
        transpose_bytes16(t);
        const int is_signed = KIND == KIND_Q8_0;
        for (int h = 0; h < 2; h++) { /* values 16h .. 16h + 15 of the run: lane h of each t[j] */
            const __m256 sc[2] = {_mm256_loadu_ps(scale[h]), _mm256_loadu_ps(scale[h] + 8)};
            const __m256 off[2] = {_mm256_loadu_ps(offset[h]), _mm256_loadu_ps(offset[h] + 8)};
            for (int j = 0; j < 16; j++) {
                const __m128i u = h ? _mm256_extracti128_si256(t[j], 1) : _mm256_castsi256_si128(t[j]);
                for (int e = 0; e < 2; e++) { /* rows 8e .. 8e + 7 */
                    const __m128i part = e ? _mm_srli_si128(u, 8) : u;
                    const __m256i q = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
                    _mm256_storeu_ps(panel + (i + 16 * h + j) * NR + 8 * e,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc[e], off[e]));
                }
            }
        }
    }
}
#endif

/* Outputs n0 .. n0 + 16 (zeros past n) for values k0 .. k0 + kc as a panel [kc][16] (rows up to a multiple of 8
   written: KC is one), through rows [16][KC]. */
static void pack_strip(const weights_t *w, int64_t n0, int64_t k0, int64_t kc, float *rows, float *panel) {
#if STRATA_AVX2
    switch (w->kind) { /* constant kinds, so each extraction inlines */
    case KIND_INT8: pack_strip_bytes(w, n0, k0, kc, KIND_INT8, panel); return;
    case KIND_INT4: pack_strip_bytes(w, n0, k0, kc, KIND_INT4, panel); return;
    case KIND_Q4_0: pack_strip_gguf(w, n0, k0, kc, KIND_Q4_0, panel); return;
    case KIND_Q4_1: pack_strip_gguf(w, n0, k0, kc, KIND_Q4_1, panel); return;
    case KIND_Q5_0: pack_strip_gguf(w, n0, k0, kc, KIND_Q5_0, panel); return;
    case KIND_Q5_1: pack_strip_gguf(w, n0, k0, kc, KIND_Q5_1, panel); return;
    case KIND_Q8_0: pack_strip_gguf(w, n0, k0, kc, KIND_Q8_0, panel); return;
    case KIND_Q4_K: pack_strip_gguf(w, n0, k0, kc, KIND_Q4_K, panel); return;
    case KIND_Q5_K: pack_strip_gguf(w, n0, k0, kc, KIND_Q5_K, panel); return;
    case KIND_Q6_K: pack_strip_gguf(w, n0, k0, kc, KIND_Q6_K, panel); return;
    default: break;
    }
#endif
    for (int r = 0; r < NR; r++) {
        if (n0 + r < w->n) widen_row(w, n0 + r, k0, kc, rows + r * KC);
        else memset(rows + r * KC, 0, sizeof(float) * KC);
    }
#if STRATA_AVX2
    for (int64_t k = 0; k < kc; k += 8)
        for (int half = 0; half < 2; half++) { /* an 8 x 8 transpose; the loads already pair rows r and r + 4 */
            const float *src = rows + half * 8 * KC + k;
            __m256 r[8], t[8];
            for (int j = 0; j < 4; j++) {
                r[j] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(src + j * KC)),
                                            _mm_loadu_ps(src + (j + 4) * KC), 1);
                r[j + 4] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(src + j * KC + 4)),
                                                _mm_loadu_ps(src + (j + 4) * KC + 4), 1);
            }
            /* r[j]: values 0-3 of rows j, j + 4; r[j + 4]: values 4-7 */
            for (int h = 0; h < 8; h += 4) {
                t[h] = _mm256_unpacklo_ps(r[h], r[h + 1]);
                t[h + 1] = _mm256_unpackhi_ps(r[h], r[h + 1]);
                t[h + 2] = _mm256_unpacklo_ps(r[h + 2], r[h + 3]);
                t[h + 3] = _mm256_unpackhi_ps(r[h + 2], r[h + 3]);
            }
            for (int h = 0; h < 8; h += 4) {
                const __m256 out[4] = {_mm256_shuffle_ps(t[h], t[h + 2], 0x44), _mm256_shuffle_ps(t[h], t[h + 2], 0xEE),
                                       _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44),
                                       _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE)};
                for (int j = 0; j < 4; j++) /* value k + h + j of the 8 rows (past kc: zeros the kernel never reads) */
                    _mm256_storeu_ps(panel + (k + h + j) * NR + half * 8, out[j]);
            }
        }
#else
    for (int64_t k = 0; k < kc; k++)
        for (int r = 0; r < NR; r++) panel[k * NR + r] = rows[r * KC + k];
#endif
}

/* x [m_total, k] as blocks of 6 rows [k][6] (rows past m_total: zeros): the kernel's broadcasts then read one
   stream, not six rows far apart. */
static void pack_rows(const float *x, int64_t m_total, int64_t k, int64_t block, float *xp) {
    float *dst = xp + block * k * MR;
    for (int64_t kk = 0; kk < k; kk++)
        for (int i = 0; i < MR; i++) {
            const int64_t m = block * MR + i;
            dst[kk * MR + i] = m < m_total ? x[m * k + kk] : 0.f;
        }
}

#endif
