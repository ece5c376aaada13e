/* GGUF (llama.cpp) weights in their blocks, as the kernels read them (weight_only.c, weight_gemm.c): the kinds
   (KIND_GGUF + ggml's type number), the block sizes, and each quantized type's 32-value runs dequantized to float32,
   portable C and AVX2. Block layouts: specs/gguf.md; the reference is gguf-py's dequantize
   (strata/layers/quantization/gguf_quants.py mirrors it in torch). */
#ifndef STRATA_GGUF_BLOCKS_H
#define STRATA_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>

#include "weight_values.h"

/* KIND_GGUF + F32 / F16 / BF16 read as the dense kinds KIND_F32, KIND_F16 (= KIND_GGUF + 1), KIND_BF16. */
enum {
    KIND_GGUF_F32 = KIND_GGUF,
    KIND_Q4_0 = KIND_GGUF + 2,
    KIND_Q4_1 = KIND_GGUF + 3,
    KIND_Q5_0 = KIND_GGUF + 6,
    KIND_Q5_1 = KIND_GGUF + 7,
    KIND_Q8_0 = KIND_GGUF + 8,
    KIND_Q4_K = KIND_GGUF + 12,
    KIND_Q5_K = KIND_GGUF + 13,
    KIND_Q6_K = KIND_GGUF + 14,
    KIND_GGUF_BF16 = KIND_GGUF + 30,
};

/* Every weight kind, for the ABI table of a library that reads them (abi.h). */
#define STRATA_ABI_WEIGHT_KINDS                                                                                 \
    STRATA_ABI_CONST(KIND_F32) STRATA_ABI_CONST(KIND_BF16) STRATA_ABI_CONST(KIND_INT4) STRATA_ABI_CONST(KIND_INT8) \
    STRATA_ABI_CONST(KIND_FP8) STRATA_ABI_CONST(KIND_GGUF) STRATA_ABI_CONST(KIND_F16)                           \
    STRATA_ABI_CONST(KIND_GGUF_F32) STRATA_ABI_CONST(KIND_Q4_0) STRATA_ABI_CONST(KIND_Q4_1)                     \
    STRATA_ABI_CONST(KIND_Q5_0) STRATA_ABI_CONST(KIND_Q5_1) STRATA_ABI_CONST(KIND_Q8_0)                         \
    STRATA_ABI_CONST(KIND_Q4_K) STRATA_ABI_CONST(KIND_Q5_K) STRATA_ABI_CONST(KIND_Q6_K)                         \
    STRATA_ABI_CONST(KIND_GGUF_BF16)

#define QK_K 256 /* values in one block of the K-quants */

/* The kind a dense GGUF kind reads as (others unchanged). */
static inline int gguf_dense_kind(int kind) {
    return kind == KIND_GGUF_F32 ? KIND_F32 : kind == KIND_GGUF_BF16 ? KIND_BF16 : kind;
}

/* GGUF kinds whose values are q * scale + an offset that is not a whole multiple of the scale (Q4_1 / Q5_1's m, the
   K-quants' -dmin * mn): a group's sum of x times the offset joins each output. */
static inline int gguf_has_offsets(int kind) {
    return kind == KIND_Q4_1 || kind == KIND_Q5_1 || kind == KIND_Q4_K || kind == KIND_Q5_K;
}

/* The whole number a kind's stored q exceed its signed values by (a multiple of the scale): Q4_0's 8, Q5_0's 16,
   Q6_K's 32; 0 for the others. */
static inline int gguf_zero(int kind) {
    return kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : kind == KIND_Q6_K ? 32 : 0;
}

/* Values in one block of a quantized GGUF kind; 0 for any other kind. */
static inline int64_t gguf_block_values(int kind) {
    switch (kind) {
    case KIND_Q4_0: case KIND_Q4_1: case KIND_Q5_0: case KIND_Q5_1: case KIND_Q8_0: return 32;
    case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K: return QK_K;
    default: return 0;
    }
}

static inline int64_t gguf_block_bytes(int kind) {
    switch (kind) {
    case KIND_Q4_0: return 18;
    case KIND_Q4_1: return 20;
    case KIND_Q5_0: return 22;
    case KIND_Q5_1: return 24;
    case KIND_Q8_0: return 34;
    case KIND_Q4_K: return 144;
    case KIND_Q5_K: return 176;
    case KIND_Q6_K: return 210;
    default: return 0;
    }
}

/* Whether a row of k values of a quantized GGUF kind is whole blocks, within row_bytes. */
static inline int gguf_shape_ok(int kind, int64_t k, int64_t row_bytes) {
    const int64_t per_block = gguf_block_values(kind);
    return per_block > 0 && k % per_block == 0 && k / per_block * gguf_block_bytes(kind) <= row_bytes;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}

/* Scale and min (6 bits each) of sub-block j (0..7) of a Q4_K / Q5_K block from its 12 packed bytes: j < 4 keeps
   the low 6 bits of bytes j and j + 4; j >= 4 joins the nibbles of byte j + 4 with the top 2 bits of j - 4 and j. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Run j of a block as 32 unsigned values q (Q8_0: signed) and value = q * scale + offset (Q6_K: a scale and an
   offset per 16 values, scale[1] and offset[1] for the second 16). Q6_K's run j is values 32j .. 32j + 31: half
   h = j / 4 of 128 values, in it run s = j % 4 takes the low (s < 2) or high nibble of ql[l + 32 (s & 1)] and
   bits 2s, 2s + 1 of qh[l]. */
static inline void gguf_run_scalar(int kind, const uint8_t *block, int j, int q[32], float scale[2],
                                   float offset[2]) {
    switch (kind) {
    case KIND_Q8_0:
        for (int l = 0; l < 32; l++) q[l] = (int8_t)block[2 + l];
        scale[0] = half_at(block), offset[0] = 0.f;
        break;
    case KIND_Q4_K: case KIND_Q5_K: {
        const uint8_t *qs = block + (kind == KIND_Q5_K ? 48 : 16) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            q[l] = j & 1 ? qs[l] >> 4 : qs[l] & 15;
            if (kind == KIND_Q5_K) q[l] |= ((block[16 + l] >> j) & 1) << 4;
        }
        int sc, mn;
        k_scale_min(block + 4, j, &sc, &mn);
        scale[0] = half_at(block) * (float)sc, offset[0] = -(half_at(block + 2) * (float)mn);
        break;
    }
    case KIND_Q6_K: {
        const int h = j / 4, s = j % 4;
        const uint8_t *ql = block + 64 * h + 32 * (s & 1), *qh = block + 128 + 32 * h;
        for (int l = 0; l < 32; l++) q[l] = (s < 2 ? ql[l] & 15 : ql[l] >> 4) | (((qh[l] >> (2 * s)) & 3) << 4);
        for (int i = 0; i < 2; i++) {
            scale[i] = half_at(block + 208) * (float)(int8_t)block[192 + 8 * h + 2 * s + i];
            offset[i] = -32.f * scale[i];
        }
        return;
    }
    default: { /* Q4_0, Q4_1, Q5_0, Q5_1: d [, m] [, qh] then 16 bytes of nibbles (value l low, l + 16 high) */
        const int with_min = kind == KIND_Q4_1 || kind == KIND_Q5_1, five = kind == KIND_Q5_0 || kind == KIND_Q5_1;
        const uint8_t *qs = block + (with_min ? 4 : 2) + (five ? 4 : 0);
        uint32_t qh = 0;
        if (five) memcpy(&qh, block + (with_min ? 4 : 2), sizeof qh);
        for (int l = 0; l < 32; l++) q[l] = (l < 16 ? qs[l] & 15 : qs[l - 16] >> 4) | (((qh >> l) & 1) << 4);
        scale[0] = half_at(block);
        offset[0] = with_min ? half_at(block + 2) : -(five ? 16.f : 8.f) * scale[0];
    }
    }
    scale[1] = scale[0], offset[1] = offset[0];
}

/* Run j (32 values) of a block, dequantized into out. */
static inline void gguf_run_floats(int kind, const uint8_t *block, int j, float *out) {
    int q[32];
    float scale[2], offset[2];
    gguf_run_scalar(kind, block, j, q, scale, offset);
    for (int l = 0; l < 32; l++) out[l] = (float)q[l] * scale[l / 16] + offset[l / 16];
}

#if STRATA_AVX2
/* 16 values q (bytes; signed when SIGNED) as q * scale + offset into two registers. */
static inline void widen16(__m128i q, const int SIGNED, __m256 scale, __m256 offset, __m256 v[2]) {
    const __m128i upper = _mm_srli_si128(q, 8);
    const __m256i a = SIGNED ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
    const __m256i b = SIGNED ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
    v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scale, offset);
    v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scale, offset);
}

/* 16 bits as 16 bytes, 0x10 where the bit is set (the fifth bit of 16 values). */
static inline __m128i fifth_bits16(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), _mm_set_epi64x(0x0101010101010101LL, 0));
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(0x10));
}

/* Run j of a block as two vectors of 16 bytes q (its values 0-15 and 16-31; Q8_0's signed), each half's values
   q * scale[i] + offset[i]: one extraction that the AVX2 and AVX-512 kernels widen at their own widths. */
static inline __attribute__((always_inline)) void gguf_run_bytes(const int KIND, const uint8_t *block, int j,
                                                                 __m128i q[2], float scale[2], float offset[2]) {
    const __m128i nibble = _mm_set1_epi8(15);
    if (KIND == KIND_Q8_0) {
        q[0] = _mm_loadu_si128((const __m128i *)(block + 2));
        q[1] = _mm_loadu_si128((const __m128i *)(block + 18));
        scale[0] = scale[1] = half_at(block), offset[0] = offset[1] = 0.f;
    } else if (KIND == KIND_Q4_K || KIND == KIND_Q5_K) {
        const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16) + 32 * (j / 2);
        int sc, mn;
        k_scale_min(block + 4, j, &sc, &mn);
        scale[0] = scale[1] = half_at(block) * (float)sc;
        offset[0] = offset[1] = -(half_at(block + 2) * (float)mn);
        for (int i = 0; i < 2; i++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + 16 * i));
            q[i] = _mm_and_si128(j & 1 ? _mm_srli_epi16(bytes, 4) : bytes, nibble);
            if (KIND == KIND_Q5_K) {
                const __m128i bit = _mm_set1_epi8((char)(1 << j));
                const __m128i qh = _mm_loadu_si128((const __m128i *)(block + 16 + 16 * i));
                q[i] = _mm_or_si128(q[i], _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(qh, bit), bit),
                                                        _mm_set1_epi8(0x10)));
            }
        }
    } else if (KIND == KIND_Q6_K) {
        const int h = j / 4, s = j % 4;
        const uint8_t *ql = block + 64 * h + 32 * (s & 1), *qh = block + 128 + 32 * h;
        const float d = half_at(block + 208);
        for (int i = 0; i < 2; i++) {
            const __m128i low = _mm_loadu_si128((const __m128i *)(ql + 16 * i));
            const __m128i high =
                _mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * i)), _mm_cvtsi32_si128(2 * s));
            q[i] = _mm_or_si128(_mm_and_si128(s < 2 ? low : _mm_srli_epi16(low, 4), nibble),
                                _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4));
            scale[i] = d * (float)(int8_t)block[192 + 8 * h + 2 * s + i];
            offset[i] = -32.f * scale[i];
        }
    } else { /* Q4_0, Q4_1, Q5_0, Q5_1 */
        const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + (with_min ? 4 : 2) + (five ? 4 : 0)));
        q[0] = _mm_and_si128(bytes, nibble), q[1] = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        if (five) {
            uint32_t qh;
            memcpy(&qh, block + (with_min ? 4 : 2), sizeof qh);
            q[0] = _mm_or_si128(q[0], fifth_bits16(qh & 0xffff));
            q[1] = _mm_or_si128(q[1], fifth_bits16(qh >> 16));
        }
        const float d = half_at(block);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = with_min ? half_at(block + 2) : -(five ? 16.f : 8.f) * d;
    }
}

/* Run j of a block dequantized as four registers of 8 floats (values 32j .. 32j + 31 of the block). */
static inline __attribute__((always_inline)) void gguf_run(const int KIND, const uint8_t *block, int j,
                                                           __m256 v[4]) {
    __m128i q[2];
    float scale[2], offset[2];
    gguf_run_bytes(KIND, block, j, q, scale, offset);
    for (int i = 0; i < 2; i++)
        widen16(q[i], KIND == KIND_Q8_0, _mm256_set1_ps(scale[i]), _mm256_set1_ps(offset[i]), v + 2 * i);
}
#endif

/* Values k0 .. k0 + count of a row of a quantized GGUF kind (k0 and count whole blocks' worth) into dst. */
static inline void gguf_row_floats(int kind, const uint8_t *row, int64_t k0, int64_t count, float *dst) {
    const int64_t per_block = gguf_block_values(kind), bytes = gguf_block_bytes(kind);
    for (int64_t i = 0; i < count; i += 32) {
        const int64_t k = k0 + i;
        const uint8_t *block = row + k / per_block * bytes;
        const int j = (int)(k % per_block / 32);
#if STRATA_AVX2
        __m256 v[4];
        switch (kind) { /* constant kinds, so each run inlines */
        case KIND_Q4_0: gguf_run(KIND_Q4_0, block, j, v); break;
        case KIND_Q4_1: gguf_run(KIND_Q4_1, block, j, v); break;
        case KIND_Q5_0: gguf_run(KIND_Q5_0, block, j, v); break;
        case KIND_Q5_1: gguf_run(KIND_Q5_1, block, j, v); break;
        case KIND_Q8_0: gguf_run(KIND_Q8_0, block, j, v); break;
        case KIND_Q4_K: gguf_run(KIND_Q4_K, block, j, v); break;
        case KIND_Q5_K: gguf_run(KIND_Q5_K, block, j, v); break;
        default: gguf_run(KIND_Q6_K, block, j, v);
        }
        for (int r = 0; r < 4; r++) _mm256_storeu_ps(dst + i + 8 * r, v[r]);
#else
        gguf_run_floats(kind, block, j, dst + i);
#endif
    }
}

#endif
