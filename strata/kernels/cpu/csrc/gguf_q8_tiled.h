/* GGUF weights laid out once, at load, for the int8-activation kernels (quantized_activations=int8 on AVX-512 VNNI
   builds), as llama.cpp's repack does: 16 outputs a strip, each group of 32 values as the 8 rows of 64 bytes that an
   AMX int8 tile holds (row p: the values 4p .. 4p + 3 of each output in turn), the 4-bit kinds two rows a byte, the
   5-bit kinds' fifth bits a 64-bit mask a row, values unsigned (Q4_0 / Q5_0 / Q8_0: q + 8 / 16 / 128, the
   weights' own zero taken off through x's sum); then the 16 outputs' fp16 d (and m). A group takes 16 times the
   bytes of one block. One layout serves the VNNI kernels here (vpdpbusd: 16 outputs a register, x's 4 bytes
   broadcast, any rows of x) and the AMX tiles (gguf_q8_amx.h, which widens it to the tile's bytes without the
   per-product packing), with the same integer sums and the same float steps in both: a row of x gets the same bits
   whatever rows share its product. Included by gguf_q8.h. */
#ifndef STRATA_GGUF_Q8_TILED_H
#define STRATA_GGUF_Q8_TILED_H

enum { KIND_GGUF_Q8T = 96 }; /* + ggml's type: that GGUF kind in the tile layout, products with x rounded to 8 bits */

/* Rows of x from which a tiled weight's products take the AMX tiles (fewer: the VNNI kernels here). */
#define Q8T_MIN_TILE_ROWS 8

#define Q8T_EACH_KIND(M) M(KIND_Q4_0) M(KIND_Q4_1) M(KIND_Q5_0) M(KIND_Q5_1) M(KIND_Q8_0)

static inline int q8t_has_layout(int kind) {
    switch (kind) {
#define Q8T_CASE(K) case K:
    Q8T_EACH_KIND(Q8T_CASE) return 1;
#undef Q8T_CASE
    default: return 0;
    }
}

/* A group's bytes: its values, then d [16] (fp16), then m [16] for Q4_1 / Q5_1. */
static inline int64_t q8t_group_bytes(int kind) { return 16 * gguf_block_bytes(kind); }
static inline int64_t q8t_value_bytes(int kind) {
    return kind == KIND_Q8_0 ? 512 : kind == KIND_Q5_0 || kind == KIND_Q5_1 ? 320 : 256;
}
static inline int q8t_zero(int kind) { /* what the stored values exceed the signed ones by */
    return kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : kind == KIND_Q8_0 ? 128 : 0;
}

/* A strip's bytes for rows of k values (a whole number of 32-value blocks). */
static inline int64_t q8t_strip_bytes(int kind, int64_t k) { return k / 32 * q8t_group_bytes(kind); }

/* Outputs n0 .. n0 + 15 of a GGUF weight (rows src_row_bytes apart; rows past n: zeros) into one strip. */
static void q8t_layout_strip(int kind, const uint8_t *src, int64_t src_row_bytes, int64_t n, int64_t k, int64_t n0,
                           uint8_t *strip) {
    const int64_t groups = k / 32, group_bytes = q8t_group_bytes(kind), value_bytes = q8t_value_bytes(kind);
    const int64_t block_bytes = gguf_block_bytes(kind);
    const int with_min = kind == KIND_Q4_1 || kind == KIND_Q5_1;
    memset(strip, 0, (size_t)(groups * group_bytes));
    for (int64_t j = 0; j < 16 && n0 + j < n; j++) {
        for (int64_t u = 0; u < groups; u++) {
            const uint8_t *block = src + (n0 + j) * src_row_bytes + u * block_bytes;
            uint8_t *g = strip + u * group_bytes;
            int q[32];
            float scale[2], offset[2];
            gguf_run_scalar(kind, block, 0, q, scale, offset);
            for (int l = 0; l < 32; l++) {
                const int v = kind == KIND_Q8_0 ? q[l] + 128 : q[l], p = l / 4, at = 4 * (int)j + l % 4;
                if (kind == KIND_Q8_0) {
                    g[64 * p + at] = (uint8_t)v;
                    continue;
                }
                g[64 * (p % 4) + at] |= (uint8_t)((v & 15) << (p >= 4 ? 4 : 0));
                if (v & 16) g[256 + 8 * p + at / 8] |= (uint8_t)(1u << (at % 8));
            }
            memcpy(g + value_bytes + 2 * j, block, 2);
            if (with_min) memcpy(g + value_bytes + 32 + 2 * j, block + 2, 2);
        }
    }
}

#if STRATA_AVX512VNNI
static inline int32_t q8t_quad(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return v;
}

/* The 8 tile rows of group g's values (unsigned bytes; row p: values 4p .. 4p + 3 of each output). */
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
    if (KIND == KIND_Q5_0 || KIND == KIND_Q5_1) {
        const __m512i fifth = _mm512_set1_epi8(16);
        for (int p = 0; p < 8; p++) {
            uint64_t bits;
            memcpy(&bits, g + 256 + 8 * p, sizeof bits);
            w[p] = _mm512_mask_add_epi8(w[p], _cvtu64_mask64(bits), w[p], fifth);
        }
    }
}

/* R rows of x (xs) times one strip, every group: acc[r], 16 outputs each. Per group and row, the integer sum starts
   from minus the weights' zero times x's sum and meets the 8 tile rows; then d * x's d (and m * x's s), in the order
   the AMX tiles' q8x_add takes them. */
static inline __attribute__((always_inline)) void q8t_rows(const int KIND, const int R, const uint8_t *strip,
                                                           int64_t groups, const q8_x_t *xs, __m512 acc[]) {
    const int64_t group_bytes = q8t_group_bytes(KIND), value_bytes = q8t_value_bytes(KIND);
    const int zero = q8t_zero(KIND), with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < groups; u++) {
        const uint8_t *g = strip + u * group_bytes;
        __m512i w[8];
        q8t_values(KIND, g, w);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + value_bytes)));
        const __m512 m = with_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + value_bytes + 32)))
                                  : _mm512_setzero_ps();
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const q8_x_t *x = xs + r;
            __m512i sum = zero ? _mm512_set1_epi32(-zero * (x->sum16[2 * u] + x->sum16[2 * u + 1]))
                               : _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int p = 0; p < 8; p++) sum = _mm512_dpbusd_epi32(sum, w[p], _mm512_set1_epi32(q8t_quad(x->q + 32 * u + 4 * p)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x->d[u])), acc[r]);
            if (with_min) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->s[u]), acc[r]);
        }
    }
}

/* count (Q8V_ROWS or a power of two below it) rows of x times one strip. */
static void q8t_rows_any(int kind, int count, const uint8_t *strip, int64_t groups, const q8_x_t *xs, __m512 acc[]) {
#define Q8T_COUNTS(K)                                                                                              \
    case K:                                                                                                        \
        if (count == 8) q8t_rows(K, 8, strip, groups, xs, acc);                                                    \
        else if (count == 4) q8t_rows(K, 4, strip, groups, xs, acc);                                               \
        else if (count == 2) q8t_rows(K, 2, strip, groups, xs, acc);                                               \
        else q8t_rows(K, 1, strip, groups, xs, acc);                                                               \
        break;
    switch (kind) { Q8T_EACH_KIND(Q8T_COUNTS) }
#undef Q8T_COUNTS
}

/* out[m_total, n] = rounded rows xs times a tiled weight's transpose (+ bias): strips shared among the threads, each
   read once for every Q8V_ROWS rows of x. */
static void q8t_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                         int num_threads) {
    const int64_t strips = (w->n + 15) / 16, groups = w->k / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (strips * w->row_bytes * m_total >= (1 << 16))
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t n0 = 16 * strip, width = w->n - n0 < 16 ? w->n - n0 : 16;
        const __mmask16 valid = (__mmask16)((1u << width) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
        for (int64_t m = 0; m < m_total;) {
            int count = Q8V_ROWS;
            while (count > m_total - m) count /= 2;
            __m512 acc[Q8V_ROWS];
            q8t_rows_any(w->kind, count, w->data + strip * w->row_bytes, groups, xs + m, acc);
            for (int r = 0; r < count; r++, m++) _mm512_mask_storeu_ps(out + m * w->n + n0, valid, _mm512_add_ps(acc[r], b));
        }
    }
}
#endif

#endif
