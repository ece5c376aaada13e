/* The weight side of the AMX GEMM (included by gemm_amx.h inside its AMX block): runs of 32 values of a weight row
   as bfloat16 values exact once their scales and offsets are set aside, packed 16 outputs at a time into the tiles'
   pair layout with their scales and offsets. */
#ifndef STRATA_AMX_WEIGHT_TILES_H
#define STRATA_AMX_WEIGHT_TILES_H

/* 32 integers (two vectors of 16 bytes, signed or not, less `minus`) as 32 bfloat16 values, in order: exact for
   magnitudes up to 256. */
static inline __m512i bf16_of_bytes(__m128i low, __m128i high, const int SIGNED, __m512 minus) {
    const __m512i a = SIGNED ? _mm512_cvtepi8_epi32(low) : _mm512_cvtepu8_epi32(low);
    const __m512i b = SIGNED ? _mm512_cvtepi8_epi32(high) : _mm512_cvtepu8_epi32(high);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_cvtepi32_ps(b), minus),
                                        _mm512_sub_ps(_mm512_cvtepi32_ps(a), minus));
}

/* Run `run` (values 32 run .. 32 run + 31, in scale group g of an int4 / int8 / FP8 weight) of weight row r as
   32 bfloat16 values v, and the scales and offset with which v * scale + offset are the weight's values (scale[1]:
   Q6_K's second 16 values'; the others' one scale twice). */
static inline __attribute__((always_inline)) __m512i weight_run(const int KIND, const weights_t *w, int64_t r,
                                                                 int64_t run, int64_t g, float scale[2],
                                                                 float *offset) {
    const uint8_t *row = w->data + r * w->row_bytes;
    scale[0] = scale[1] = 1.f, *offset = 0.f;
    if (KIND == KIND_BF16) { /* a partial last run: only its values, zeros after */
        const int64_t left = w->k - run * RUN;
        const __mmask32 valid = left >= RUN ? 0xffffffffu : (__mmask32)((1u << left) - 1);
        return _mm512_maskz_loadu_epi16(valid, row + run * RUN * 2);
    }
    if (KIND == KIND_INT4 || KIND == KIND_INT8 || KIND == KIND_FP8) {
        scale[0] = scale[1] = w->scales[r * w->groups + g];
        if (KIND == KIND_FP8) { /* sign and 7 bits under float32's exponent and mantissa, rebiased: exact */
            const __m512i sign = _mm512_set1_epi32(0x80), rest = _mm512_set1_epi32(0x7f);
            __m512 v[2];
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + run * RUN + 16 * h)));
                const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(q, sign), 24),
                                                     _mm512_slli_epi32(_mm512_and_si512(q, rest), 20));
                v[h] = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
            }
            return (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
        }
        const __m512 zero = _mm512_set1_ps(zero_point(w, r, g));
        if (KIND == KIND_INT8)
            return bf16_of_bytes(_mm_loadu_si128((const __m128i *)(row + run * RUN)),
                                 _mm_loadu_si128((const __m128i *)(row + run * RUN + 16)), 0, zero);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + run * RUN / 2)), nibble = _mm_set1_epi8(15);
        return bf16_of_bytes(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), 0, zero);
    }
    const int64_t per_block = gguf_block_values(KIND);
    __m128i q[2];
    float scales[2], offsets[2];
    gguf_run_bytes(KIND, row + run * RUN / per_block * gguf_block_bytes(KIND), (int)(run % (per_block / RUN)), q,
                   scales, offsets);
    scale[0] = scales[0], scale[1] = scales[1];
    /* Q4_0, Q5_0 and Q6_K subtract a whole 8, 16 or 32 from q, which bfloat16 holds: no offset left */
    const float minus = (float)gguf_zero(KIND);
    *offset = gguf_has_offsets(KIND) ? offsets[0] : 0.f;
    return bf16_of_bytes(q[0], q[1], KIND == KIND_Q8_0, _mm512_set1_ps(minus));
}

/* Bytes of a weight row before run `run` (GGUF: before the block holding it). */
static inline int64_t run_offset(const int KIND, int64_t run) {
    switch (KIND) {
    case KIND_BF16: return run * RUN * 2;
    case KIND_INT4: return run * RUN / 2;
    case KIND_INT8: case KIND_FP8: return run * RUN;
    default: return run * RUN / gguf_block_values(KIND) * gguf_block_bytes(KIND);
    }
}

/* Outputs n0 .. n0 + 15 for runs run0 .. run0 + runs as tiles [runs][16 pairs of K][16 outputs][2] (rows past n:
   zeros), and each run's scales [2 halves][16] and 16 offsets. The next strip's rows are asked for meanwhile:
   sixteen rows read a few bytes at a time are sixteen streams, more than the hardware prefetcher follows (int4 at
   16 rows of x: 4 GB/s without). */
static inline __attribute__((always_inline)) void pack_strip_tiles(const int KIND, const weights_t *w, int64_t n0,
                                                                   int64_t run0, int64_t runs, uint16_t *tiles,
                                                                   float *scales, float *offsets) {
    const int64_t from = run_offset(KIND, run0), to = run_offset(KIND, run0 + runs + gguf_block_values(KIND) / RUN);
    for (int64_t r = n0 + 16; r < n0 + 32 && r < w->n; r++)
        for (int64_t b = from; b < to && b < w->row_bytes; b += 64)
            _mm_prefetch((const char *)(w->data + r * w->row_bytes + b), _MM_HINT_T1);
    for (int64_t i = 0; i < runs; i++) {
        const int64_t g = scaled(KIND) ? (run0 + i) * RUN / w->group_size : 0; /* once a run, not once a row */
        __m512i rows[16];
        for (int j = 0; j < 16; j++) {
            float scale[2] = {0.f, 0.f}, offset = 0.f;
            rows[j] = n0 + j < w->n ? weight_run(KIND, w, n0 + j, run0 + i, g, scale, &offset)
                                    : _mm512_setzero_si512();
            scales[i * 32 + j] = scale[0], scales[i * 32 + 16 + j] = scale[1], offsets[i * 16 + j] = offset;
        }
        transpose16(rows); /* row j held output j's 16 pairs; now row p holds pair p of the 16 outputs */
        for (int p = 0; p < 16; p++) _mm512_store_si512(tiles + i * TILE + p * 32, rows[p]);
    }
}

static void pack_strip_any(const weights_t *w, int64_t n0, int64_t run0, int64_t runs, uint16_t *tiles, float *scales,
                           float *offsets) {
    switch (w->kind) { /* constant kinds, so each run's extraction inlines */
#define PACK(K) case K: pack_strip_tiles(K, w, n0, run0, runs, tiles, scales, offsets); break;
    PACK(KIND_BF16) PACK(KIND_FP8) PACK(KIND_INT4) PACK(KIND_INT8) PACK(KIND_Q4_0) PACK(KIND_Q4_1) PACK(KIND_Q5_0)
    PACK(KIND_Q5_1) PACK(KIND_Q8_0) PACK(KIND_Q4_K) PACK(KIND_Q5_K) PACK(KIND_Q6_K)
#undef PACK
    }
}

#endif
