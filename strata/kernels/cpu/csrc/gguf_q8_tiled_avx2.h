/* Products with a weight in the tile layout (gguf_q8_tiled.h) on AVX2 builds without AVX-512 VNNI: 8 outputs a
   register (half a strip a pass), the unsigned values against x's 4 bytes broadcast by vpmaddubsw into int16 pairs,
   which add up over as many rows of a group as int16 holds (q8t_span: all 8 of 4-bit values, 4 of 5-bit, 2 of
   Q6_K's 6-bit; Q8_0's bytes as two 4-bit halves) before one vpmaddwd makes them int32: two instructions a row of x
   per 32 products where a vpmaddwd after each vpmaddubsw takes three (llama.cpp's AVX2 dot products, and
   gguf_q8_avx2.h's on the blocks); AVX-VNNI's 256-bit vpdpbusd where the build has it. From Q8T_WIDEN_ROWS rows of
   x each strip's values are made bytes once (Q6_K's signed, Q8T_SIGNED_WIDE), and its units' factors floats, for all
   of their passes. The same integer sums as the VNNI kernels and, lane by lane, the same float steps, so a row gets
   their bits, alone or among any rows. Included by gguf_q8_tiled.h. */
#ifndef STRATA_GGUF_Q8_TILED_AVX2_H
#define STRATA_GGUF_Q8_TILED_AVX2_H

#define Q8T_AVX2_ROWS 2 /* rows of x one pass over a half strip serves (4 ran 5-20% slower: registers) */
#define Q8T_WIDEN_ROWS 8 /* rows of x from which each strip's values are made once, as bytes, for all of them */

/* Rows of a group whose vpmaddubsw pairs add up in int16 (x's q within +-128): 8 * 2 * 15 * 128 = 30720 for 4-bit
   values (and each half of Q8_0's), 4 * 2 * 31 * 128 = 31744 for 5-bit, 2 * 2 * 63 * 128 = 32256 for Q6_K's (and
   2 * 2 * 32 * 255 = 32640 for its signed values against x's unsigned bytes, Q8T_SIGNED_WIDE). */
static inline int q8t_span(int kind) {
    return q8t_value_bytes(kind) == 320 ? 4 : kind == KIND_Q6_K ? 2 : 8;
}

/* Row p of group g's unsigned values (values 4p .. 4p + 3 of outputs 8 * half .. 8 * half + 7). */
static inline __attribute__((always_inline)) __m256i q8t_row8(const int KIND, const uint8_t *g, int p, int half) {
    if (KIND == KIND_Q8_0) return _mm256_loadu_si256((const __m256i *)(g + 64 * p + 32 * half));
    __m256i v = _mm256_loadu_si256((const __m256i *)(g + 64 * (p % 4) + 32 * half));
    v = _mm256_and_si256(p >= 4 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    if (KIND == KIND_Q6_K) { /* the high bits' plane (Q8T_HIGH_PLANES): row p's to bits 4-5 */
        __m256i high = _mm256_loadu_si256((const __m256i *)(g + 256 + 64 * (p / 4) + 32 * half));
        const int at = 2 * (p % 4);
        high = at < 4 ? _mm256_slli_epi16(high, 4 - at) : at > 4 ? _mm256_srli_epi16(high, at - 4) : high;
        return _mm256_or_si256(v, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    }
    if (q8t_value_bytes(KIND) == 320) v = _mm256_or_si256(v, q8a_fifth_bits(g + 256 + 8 * p + 4 * half));
    return v;
}

/* 8 fp16 values at p as float32 (exact either way; F16C is x86-64-v3's, not AVX2's). */
static inline __m256 q8t_halves8(const uint8_t *p) {
#if STRATA_F16C
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = f16_to_f32(half_bits(p + 2 * i));
    return _mm256_loadu_ps(f);
#endif
}

/* q8t_unit's factors for the half strip's 8 outputs. */
static inline __attribute__((always_inline)) void q8t_unit8(const int KIND, const uint8_t *strip, int64_t v, int half,
                                                            __m256 *scale, __m256 *offset) {
    const q8t_unit_bytes_t f = q8t_unit_bytes(KIND, strip, v);
    const __m256 d = q8t_halves8(f.d + 16 * half);
    const __m256 m = gguf_has_offsets(KIND) ? q8t_halves8(f.m + 16 * half) : _mm256_setzero_ps();
    if (!q8t_k_quant(KIND)) {
        *scale = d, *offset = m;
        return;
    }
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(f.scale + 8 * half));
    *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(KIND == KIND_Q6_K ? _mm256_cvtepi8_epi32(sc)
                                                                    : _mm256_cvtepu8_epi32(sc)));
    *offset = KIND == KIND_Q6_K ? m : _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                        _mm_loadl_epi64((const __m128i *)(f.min + 8 * half)))));
}

/* q8t_add for 8 outputs: the same steps, lane by lane. */
static inline __attribute__((always_inline)) __m256 q8t_add8(const int KIND, __m256i sum, __m256 scale, __m256 offset,
                                                            const float *dx, const float *ox, __m256 acc) {
    if (!q8t_k_quant(KIND)) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(*dx)), acc);
        return gguf_has_offsets(KIND) ? _mm256_fmadd_ps(offset, _mm256_set1_ps(*ox), acc) : acc;
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc);
    return gguf_has_offsets(KIND) ? _mm256_fnmadd_ps(offset, _mm256_set1_ps(*ox), acc) : acc;
}

/* A strip's values as bytes, [half][group][row][32] (Q8_0's without AVX-VNNI: [row][low 4 bits, high 4 bits][32],
   a row's two in one line), and its units' factors, [half][unit][scale, offset][8]: made once for all the passes of
   many rows of x (q8t_rows8 reads them where `wide` is given). Each half's bytes lie together, so a pass over half a
   strip keeps only its own lines in L1: at K = 2816 a half's values and factors take 34 KB where both halves' lines
   took 56 KB (one core, 512 rows, [1024 x 2816]: Q6_K 31.0 -> 26.3 ms, Q4_K 24.7 -> 21.1, Q4_0 28.5 -> 22.9). */
#define Q8T_WIDE_BYTES(KIND) ((KIND) == KIND_Q8_0 && !STRATA_AVXVNNI ? 1024 : 512) /* a group's */
typedef struct {
    uint8_t *values;
    float *factors;
} q8t_wide_t;

/* Row p of group u's values for one half of the strip. */
static inline uint8_t *q8t_wide_values(const int KIND, const q8t_wide_t *wide, int64_t groups, int64_t u, int p,
                                       int half) {
    const int64_t bytes = Q8T_WIDE_BYTES(KIND) / 2;
    return wide->values + (half * groups + u) * bytes + bytes / 8 * p;
}

/* Unit v's scale (then its offset) for one half of the strip. */
static inline float *q8t_wide_factors(const int KIND, const q8t_wide_t *wide, int64_t groups, int64_t v, int half) {
    return wide->factors + (half * groups * Q8T_UNITS(KIND) + v) * 16;
}

/* Q6_K's bytes made once (without AVX-VNNI) are its signed values, q - 32, against x's unsigned bytes (q + 128):
   the zero's integer (x's sum over the unit, shifted) then comes from the weights' side, once per unit and output
   for all the rows, together with the bias that turns the int32 sum into a float by one float subtraction instead
   of vcvtdq2ps (exact: |sum| <= 16 * 32 * 128 < 2^22). Two instructions fewer per unit and row on ports 0/1, and
   the same integers and float steps: Llama 250M's 4 products at 512 rows, one core, 93-99 -> 88-93 ms. */
#define Q8T_SIGNED_WIDE(KIND) ((KIND) == KIND_Q6_K && !STRATA_AVXVNNI)
#define Q8T_FLOAT_BIAS 0x4B400000 /* 1.5 * 2^23's bits: as float, 12582912 + i for the int32 added to them */

/* What a Q6_K unit's sum of x's unsigned bytes times the signed values, Σ (x + 128)(q - 32), less gives the signed
   sum plus Q8T_FLOAT_BIAS: 128 Σ (q - 32) over the unit's 16 values of each output, less the bias; from the unit's
   4 rows of unsigned values. */
static inline __m256i q8t_signed_start8(const __m256i rows[4]) {
    const __m256i bytes = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(rows[p], bytes),
                                                                               ones));
    const __m256i signed_sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * q8t_zero(KIND_Q6_K)));
    return _mm256_sub_epi32(_mm256_slli_epi32(signed_sum, 7), _mm256_set1_epi32(Q8T_FLOAT_BIAS));
}

/* q8t_add8's step for a Q6_K unit summed from its signed values: the sum less q8t_signed_start8's int32, as float
   (its bits less the bias's), times the scale, into acc. */
static inline __attribute__((always_inline)) __m256 q8t_add_signed8(__m256i sum, __m256 scale, __m256i start,
                                                                   __m256 acc) {
    const __m256 biased = _mm256_castsi256_ps(_mm256_sub_epi32(sum, start));
    return _mm256_fmadd_ps(_mm256_sub_ps(biased, _mm256_castsi256_ps(_mm256_set1_epi32(Q8T_FLOAT_BIAS))), scale, acc);
}

static inline __attribute__((always_inline)) void q8t_widen8(const int KIND, const uint8_t *strip, int64_t groups,
                                                             const q8t_wide_t *wide) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t u = 0; u < groups; u++) {
        const uint8_t *g = q8t_group(KIND, strip, u);
        __m256i rows[2][8];
        for (int p = 0; p < 8; p++)
            for (int half = 0; half < 2; half++) {
                const __m256i w = rows[half][p] = q8t_row8(KIND, g, p, half);
                uint8_t *at = q8t_wide_values(KIND, wide, groups, u, p, half);
                if (Q8T_SIGNED_WIDE(KIND)) {
                    _mm256_store_si256((__m256i *)at, _mm256_sub_epi8(w, _mm256_set1_epi8((char)q8t_zero(KIND))));
                    continue;
                }
                if (KIND != KIND_Q8_0 || STRATA_AVXVNNI) {
                    _mm256_store_si256((__m256i *)at, w);
                    continue;
                }
                _mm256_store_si256((__m256i *)at, _mm256_and_si256(w, low));
                _mm256_store_si256((__m256i *)(at + 32), _mm256_and_si256(_mm256_srli_epi16(w, 4), low));
            }
        if (Q8T_SIGNED_WIDE(KIND)) /* in the offset's place: Q6_K has none */
            for (int s = 0; s < 2; s++)
                for (int half = 0; half < 2; half++)
                    _mm256_store_si256((__m256i *)(q8t_wide_factors(KIND, wide, groups, 2 * u + s, half) + 8),
                                       q8t_signed_start8(rows[half] + 4 * s));
    }
    for (int64_t v = 0; v < groups * Q8T_UNITS(KIND); v++)
        for (int half = 0; half < 2; half++) {
            __m256 scale, offset;
            q8t_unit8(KIND, strip, v, half, &scale, &offset);
            _mm256_store_ps(q8t_wide_factors(KIND, wide, groups, v, half), scale);
            if (!Q8T_SIGNED_WIDE(KIND)) _mm256_store_ps(q8t_wide_factors(KIND, wide, groups, v, half) + 8, offset);
        }
}

/* sum plus q8t_start's integer: x's sum broadcast from memory and shifted, as every zero is a power of two, where
   q8t_start's scalar took two port-5 moves a row and unit (Q6_K and Q5_0 at 64 rows 6-8% faster). */
static inline __attribute__((always_inline)) __m256i q8t_add_start8(const int KIND, __m256i sum, const q8_x_t *x,
                                                                   int64_t v) {
    const int zero = q8t_zero(KIND);
    if (zero == 0) return sum;
    const __m256i x_sum = _mm256_set1_epi32(KIND == KIND_Q6_K ? x->sum16[v] : x->sum32[v]);
    return _mm256_sub_epi32(sum, _mm256_slli_epi32(x_sum, __builtin_ctz((unsigned)zero)));
}

/* Row p of group u against R rows of x: vpmaddubsw's int16 pairs added to pairs[r] (Q8_0: its low 4 bits' there,
   its high 4 bits' to high[r]). */
static inline __attribute__((always_inline)) void q8t_pairs8(const int KIND, const int R, const int WIDE,
                                                             const q8t_wide_t *wide, const uint8_t *g, int64_t groups,
                                                             int64_t u, int p, int half, const q8_x_t *xs,
                                                             __m256i pairs[], __m256i high[]) {
    const __m256i low = _mm256_set1_epi8(15);
    const uint8_t *at = WIDE ? q8t_wide_values(KIND, wide, groups, u, p, half) : NULL;
    __m256i w = WIDE ? _mm256_load_si256((const __m256i *)at) : q8t_row8(KIND, g, p, half);
    if (WIDE && Q8T_SIGNED_WIDE(KIND)) /* held for both rows: as each vpmaddubsw's memory operand, read twice (7%
                                          slower) */
        __asm__("" : "+x"(w));
    __m256i w_high = _mm256_setzero_si256();
    if (KIND == KIND_Q8_0 && WIDE) w_high = _mm256_load_si256((const __m256i *)(at + 32));
    else if (KIND == KIND_Q8_0) w_high = _mm256_and_si256(_mm256_srli_epi16(w, 4), low), w = _mm256_and_si256(w, low);
    for (int r = 0; r < R; r++) {
        if (WIDE && Q8T_SIGNED_WIDE(KIND)) {
            const __m256i x = _mm256_set1_epi32(q8t_quad((const int8_t *)xs[r].uq + 32 * u + 4 * p));
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(x, w));
            continue;
        }
        const __m256i x = _mm256_set1_epi32(q8t_quad(xs[r].q + 32 * u + 4 * p));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(w, x));
        if (KIND == KIND_Q8_0) high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(w_high, x));
    }
}

/* R rows of x (xs) times half a strip, every group: out[r], 8 outputs each; WIDE: the strip's values and factors
   from `wide`. */
static inline __attribute__((always_inline)) void q8t_rows8(const int KIND, const int R, const int WIDE,
                                                            const uint8_t *strip, int64_t groups, int half,
                                                            const q8t_wide_t *wide, const q8_x_t *xs, __m256 out[]) {
    const int units = Q8T_UNITS(KIND), quads = 8 / units, span = q8t_span(KIND);
    const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    __m256 acc[Q8T_AVX2_ROWS];
    _Alignas(32) float total[Q8T_AVX2_ROWS][8] = {{0.f}}; /* K-quants' sums of whole blocks: memory, not registers */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < groups; u++) {
        const uint8_t *g = q8t_group(KIND, strip, u);
        if (!WIDE) { /* half of the next strip a pass: its second pass reads this one from cache, and DRAM idled
                        through it when each pass asked for its own lines ahead (Q6_K decode 63 -> 92 tokens/s) */
            const int64_t strip_bytes = q8t_strip_bytes(KIND, 32 * groups), part = strip_bytes / (2 * groups);
            prefetch_lines(strip + strip_bytes + (half * groups + u) * part, part + 64);
        }
        for (int s = 0; s < units; s++) {
            const int64_t v = u * units + s;
            __m256 scale, offset;
            if (WIDE) scale = _mm256_load_ps(q8t_wide_factors(KIND, wide, groups, v, half)),
                      offset = _mm256_load_ps(q8t_wide_factors(KIND, wide, groups, v, half) + 8);
            else q8t_unit8(KIND, strip, v, half, &scale, &offset);
            __m256i sum[Q8T_AVX2_ROWS];
#if STRATA_AVXVNNI /* vpdpbusd's int32 sums: no int16 span, Q8_0's bytes whole */
            for (int r = 0; r < R; r++) sum[r] = _mm256_set1_epi32(q8t_start(KIND, xs + r, v));
            for (int p = s * quads; p < (s + 1) * quads; p++) {
                const __m256i w = WIDE ? _mm256_load_si256((const __m256i *)q8t_wide_values(KIND, wide, groups, u,
                                                                                            p, half))
                                       : q8t_row8(KIND, g, p, half);
                for (int r = 0; r < R; r++)
                    sum[r] = _mm256_dpbusd_avx_epi32(sum[r], w, _mm256_set1_epi32(q8t_quad(xs[r].q + 32 * u + 4 * p)));
            }
            (void)span, (void)ones, (void)sixteens;
#else
            for (int p0 = s * quads; p0 < (s + 1) * quads; p0 += span) {
                __m256i pairs[Q8T_AVX2_ROWS], high[Q8T_AVX2_ROWS];
                for (int r = 0; r < R; r++) pairs[r] = high[r] = _mm256_setzero_si256();
                if (KIND == KIND_Q8_0) /* unrolled whole, its two planes' 32 registers spill the sums */
                    _Pragma("GCC unroll 2") for (int p = p0; p < p0 + span; p++)
                        q8t_pairs8(KIND, R, WIDE, wide, g, groups, u, p, half, xs, pairs, high);
                else
                    for (int p = p0; p < p0 + span; p++)
                        q8t_pairs8(KIND, R, WIDE, wide, g, groups, u, p, half, xs, pairs, high);
                for (int r = 0; r < R; r++) { /* the int32 sum after each span (integers: any order) */
                    __m256i part = _mm256_madd_epi16(pairs[r], ones);
                    if (KIND == KIND_Q8_0) part = _mm256_add_epi32(part, _mm256_madd_epi16(high[r], sixteens));
                    sum[r] = p0 == s * quads ? part : _mm256_add_epi32(sum[r], part);
                }
            }
            if (WIDE && Q8T_SIGNED_WIDE(KIND)) { /* the start and the float bias in the offset's place */
                for (int r = 0; r < R; r++)
                    acc[r] = q8t_add_signed8(sum[r], scale, _mm256_castps_si256(offset), acc[r]);
                continue;
            }
            for (int r = 0; r < R; r++) sum[r] = q8t_add_start8(KIND, sum[r], xs + r, v);
#endif
            for (int r = 0; r < R; r++)
                acc[r] = q8t_add8(KIND, sum[r], scale, offset, q8t_dx(KIND, xs + r, v), q8t_ox(KIND, xs + r, v),
                                  acc[r]);
        }
        if (q8t_k_quant(KIND) && u % 8 == 7)
            for (int r = 0; r < R; r++) {
                _mm256_store_ps(total[r], _mm256_fmadd_ps(acc[r], _mm256_set1_ps(xs[r].d[u / 8]),
                                                          _mm256_load_ps(total[r])));
                acc[r] = _mm256_setzero_ps();
            }
    }
    for (int r = 0; r < R; r++) out[r] = q8t_k_quant(KIND) ? _mm256_load_ps(total[r]) : acc[r];
}

/* A case of the dispatch below: count rows (Q8T_AVX2_ROWS or 1) of kind K, WIDE_PASS (a constant) from `wide`. */
#define Q8T_COUNTS8(K)                                                                                             \
    case K:                                                                                                        \
        if (count == 2) q8t_rows8(K, 2, WIDE_PASS, strip, groups, half, wide, xs, out);                            \
        else q8t_rows8(K, 1, WIDE_PASS, strip, groups, half, wide, xs, out);                                       \
        break;

/* count (Q8T_AVX2_ROWS or 1) rows of x times half a strip, from the strip's bytes made once (`wide`). Scheduled by
   GCC before register allocation, with its register-pressure model: without that it hoists x's broadcasts far ahead
   of their products and spills them (one core, [1536 x 512] at 64 rows: Q4_K 754 -> 655 us, Q4_0 763 -> 710). */
__attribute__((optimize("schedule-insns", "sched-pressure")))
static void q8t_rows8_wide(int kind, int count, const uint8_t *strip, int64_t groups, int half,
                           const q8t_wide_t *wide, const q8_x_t *xs, __m256 out[]) {
    enum { WIDE_PASS = 1 };
    switch (kind) { Q8_EACH_KIND(Q8T_COUNTS8) }
}

/* The same from the strip itself (below Q8T_WIDEN_ROWS rows), in GCC's default schedule: with the pressure model
   on these passes too, Gemma 3's decode read ~10% slower in alternating rounds. */
static void q8t_rows8_any(int kind, int count, const uint8_t *strip, int64_t groups, int half, const q8_x_t *xs,
                          __m256 out[]) {
    enum { WIDE_PASS = 0 };
    const q8t_wide_t *wide = NULL;
    switch (kind) { Q8_EACH_KIND(Q8T_COUNTS8) }
}
#undef Q8T_COUNTS8

/* One strip of out[m_total, n] (+ bias): with `wide`, its values made bytes first. */
static void q8t_strip8(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                       int64_t strip, const q8t_wide_t *wide) {
    const int64_t groups = w->k / 32;
    if (wide) switch (w->kind) {
#define Q8T_WIDEN8(K) case K: q8t_widen8(K, w->data + strip * w->row_bytes, groups, wide); break;
        Q8_EACH_KIND(Q8T_WIDEN8)
#undef Q8T_WIDEN8
        }
    for (int half = 0; half < 2; half++) {
        const int64_t n0 = 16 * strip + 8 * half, width = w->n - n0 < 8 ? w->n - n0 : 8;
        if (width <= 0) break;
        const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)width),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 b = bias ? _mm256_maskload_ps(bias + n0, valid) : _mm256_setzero_ps();
        for (int64_t m = 0; m < m_total;) {
            const int count = m_total - m >= Q8T_AVX2_ROWS ? Q8T_AVX2_ROWS : 1;
            __m256 y[Q8T_AVX2_ROWS];
            if (wide) q8t_rows8_wide(w->kind, count, w->data + strip * w->row_bytes, groups, half, wide, xs + m, y);
            else q8t_rows8_any(w->kind, count, w->data + strip * w->row_bytes, groups, half, xs + m, y);
            for (int r = 0; r < count; r++, m++) /* whole: vmaskmovps to lines not yet in cache took 3% of prefill */
                if (width == 8) _mm256_storeu_ps(out + m * w->n + n0, _mm256_add_ps(y[r], b));
                else _mm256_maskstore_ps(out + m * w->n + n0, valid, _mm256_add_ps(y[r], b));
        }
    }
}

/* out[m_total, n] = rounded rows xs times a tiled weight's transpose (+ bias): strips shared among the threads, each
   half strip read once for every Q8T_AVX2_ROWS rows of x. From Q8T_WIDEN_ROWS rows a strip is long work, handed out
   one at a time: a thread slowed by a neighbour on its core then takes fewer, where a fixed share kept the other
   waiting (prefill); below, fixed shares. */
static void q8t_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                         int num_threads) {
    const int64_t strips = (w->n + 15) / 16, groups = w->k / 32;
    if (m_total < Q8T_WIDEN_ROWS) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (strips * w->row_bytes * m_total >= (1 << 16))
        for (int64_t strip = 0; strip < strips; strip++) q8t_strip8(w, xs, m_total, bias, out, strip, NULL);
        return;
    }
#pragma omp parallel num_threads(num_threads) if (strips * w->row_bytes * m_total >= (1 << 16))
    {
    const int64_t bytes = groups * Q8T_WIDE_BYTES(w->kind);
    q8t_wide_t wide = {aligned_alloc(64, (size_t)(bytes + groups * Q8T_UNITS(w->kind) * 32 * sizeof(float))), NULL};
    wide.factors = wide.values ? (float *)(wide.values + bytes) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t strip = 0; strip < strips; strip++)
        q8t_strip8(w, xs, m_total, bias, out, strip, wide.values ? &wide : NULL);
    free(wide.values);
    }
}

#endif
