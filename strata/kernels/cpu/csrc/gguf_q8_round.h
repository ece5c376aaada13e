/* Rows of x rounded to 8 bits as llama.cpp rounds them (Q8_0 / Q8_1 blocks of 32, Q8_K blocks of 256), with the sums
   and per-lane scales the int8 kernels read; the layout of one rounded row in memory. Included by gguf_q8.h. The
   AVX2 form computes the same values as the scalar one (the same float products, roundf's halves away from zero). */
#ifndef STRATA_GGUF_Q8_ROUND_H
#define STRATA_GGUF_Q8_ROUND_H
#include <math.h>

#include "gguf_blocks.h"

/* float32 -> IEEE half, rounded to nearest even (GGML_FP32_TO_FP16), as float32 again. */
static inline float q8_round_half(float f) {
#if STRATA_F16C
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
    uint16_t h;
    if (magnitude >= 0x47800000u) h = magnitude > 0x7f800000u ? 0x7e00 : 0x7c00; /* NaN; overflow to infinity */
    else if (magnitude < 0x38800000u) { /* subnormal half: magnitude * 2^24, rounded to nearest even */
        float scaled_value, m;
        memcpy(&m, &magnitude, sizeof m);
        scaled_value = m * 0x1p24f;
        h = (uint16_t)nearbyintf(scaled_value);
    } else {
        const uint32_t mantissa = magnitude & 0x7fffff, exponent = (magnitude >> 23) - 112;
        uint32_t half = (exponent << 10) | (mantissa >> 13);
        const uint32_t rest = mantissa & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* may carry into the exponent: right */
        h = (uint16_t)half;
    }
    return f16_to_f32((uint16_t)(h | (sign >> 16)));
#endif
}

/* ggml's nearest_int (float32's 2^23 + 2^22 added and taken off: ties to even) of a float32 product, as rintf; the
   addition written out would let the compiler fuse it with the product (one rounding less, another integer at
   near-ties). */
static inline int q8_nearest_int(float f) { return (int)rintf(f); }

/* One row of x rounded: q[k] and uq[k] = q + 128 (the unsigned operand against signed weights); d per block (Q8_0:
   the fp16 d as float; Q8_K: float d); s per 32 (Q8_1's fp16 s); lanes: q summed per 4 values (each int32 lane of a
   vpdpbusd); sum16: q summed per 16 (Q8_K's bsums); sum32 per 32, and as float (sum32_f); per lane of 4 values its
   block's d (d_lanes) and s / 8 (s_lanes: 8 lanes a block sum to s); sum16_d: sum16 times the block's d (the
   K-quants' mins meet it). */
typedef struct {
    int8_t *q;
    uint8_t *uq;
    float *d, *s, *d_lanes, *s_lanes, *sum16_d, *sum32_f;
    int32_t *lanes, *sum16, *sum32;
} q8_x_t;

#if STRATA_AVX2
/* Eight products v * scale rounded as roundf (halves away from zero: the fraction that truncation leaves is exact) or
   as rintf (ties to even), as int32. */
static inline __m256i q8_round8(__m256 v, __m256 scale, int ties_even) {
    const __m256 y = _mm256_mul_ps(v, scale);
    if (ties_even) return _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), sign = _mm256_set1_ps(-0.f);
    const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_and_ps(y, sign), _mm256_set1_ps(1.f));
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, one)));
}

/* 32 values (int32 in four registers, within int8's range) stored as bytes in order; their sums per 4 into lanes. */
static inline void q8_store32(const __m256i *v, int8_t *q, int32_t *lanes) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, order));
    const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)lanes, _mm256_permutevar8x32_epi32(sums, order));
}

static inline float q8_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float q8_abs_max(const float *v, int64_t count) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    return q8_max8(m);
}

/* The index of the first of count values (a multiple of 8) whose magnitude is amax; the last index if none is (a
   NaN amax matches nothing). */
static inline int64_t q8_first_of(const float *v, int64_t count, float amax) {
    const __m256 sign = _mm256_set1_ps(-0.f), target = _mm256_set1_ps(amax);
    for (int64_t j = 0; j < count; j += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)), target,
                                                          _CMP_EQ_OQ));
        if (hits) return j + __builtin_ctz((unsigned)hits);
    }
    return count - 1;
}

/* 32 values v * scale rounded (q8_round8) into q, their sums per 4 into lanes; returns their sum. */
static inline int32_t q8_round32(const float *v, float scale, int ties_even, int8_t *q, int32_t *lanes) {
    __m256i r[4];
    for (int i = 0; i < 4; i++) {
        r[i] = q8_round8(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(scale), ties_even);
        if (ties_even) r[i] = _mm256_min_epi32(r[i], _mm256_set1_epi32(127));
    }
    q8_store32(r, q, lanes);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}
#else
static inline float q8_abs_max(const float *v, int64_t count) {
    float amax = 0.f;
    for (int64_t j = 0; j < count; j++) amax = fmaxf(amax, fabsf(v[j]));
    return amax;
}

static inline int64_t q8_first_of(const float *v, int64_t count, float amax) {
    int64_t j = 0;
    while (j < count - 1 && fabsf(v[j]) != amax) j++; /* bounded: a NaN amax matches nothing */
    return j;
}

static inline int32_t q8_round32(const float *v, float scale, int ties_even, int8_t *q, int32_t *lanes) {
    int32_t sum = 0;
    for (int j = 0; j < 32; j++) {
        int r = ties_even ? q8_nearest_int(scale * v[j]) : (int)roundf(v[j] * scale);
        if (ties_even && r > 127) r = 127;
        q[j] = (int8_t)r;
        sum += r;
    }
    for (int i = 0; i < 8; i++) lanes[i] = q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3];
    return sum;
}
#endif

/* count floats rounded to IEEE half and back in place (q8_round_half's values; F16C's 8 a step). */
static inline void q8_round_halves(float *v, int64_t count) {
    int64_t i = 0;
#if STRATA_F16C
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(v + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; i < count; i++) v[i] = q8_round_half(v[i]);
}

/* Blocks of 32 (Q8_0 / Q8_1), quantize_row_q8_1_ref's arithmetic. The fp16 roundings of d and s wait for the whole
   row, 8 a step, where a block's two scalar round trips took a third of the rounding time. */
static void q8_round_row_32(const float *x, int64_t k, q8_x_t *p) {
    float *restrict d = p->d, *restrict s = p->s;
    for (int64_t b = 0; b < k / 32; b++) {
        d[b] = q8_abs_max(x + 32 * b, 32) / 127.f;
        const float id = d[b] != 0.f ? 1.f / d[b] : 0.f;
        s[b] = (float)q8_round32(x + 32 * b, id, 0, p->q + 32 * b, p->lanes + 8 * b) * d[b];
    }
    q8_round_halves(d, k / 32);
    q8_round_halves(s, k / 32);
}

/* Blocks of 256 (Q8_K), quantize_row_q8_K_ref's arithmetic: the scale from the signed value of largest magnitude (its
   first occurrence: the reference's strict >). */
static void q8_round_row_256(const float *x, int64_t k, q8_x_t *p) {
    for (int64_t b = 0; b < k / QK_K; b++) {
        const float *v = x + QK_K * b, amax = q8_abs_max(v, QK_K);
        if (amax == 0.f) {
            memset(p->q + QK_K * b, 0, QK_K);
            memset(p->lanes + QK_K / 4 * b, 0, QK_K);
            p->d[b] = 0.f;
            continue;
        }
        const float iscale = -127.f / v[q8_first_of(v, QK_K, amax)];
        for (int i = 0; i < QK_K / 32; i++) q8_round32(v + 32 * i, iscale, 1, p->q + QK_K * b + 32 * i,
                                                       p->lanes + QK_K / 4 * b + 8 * i);
        p->d[b] = 1.f / iscale;
    }
}

/* Whether rows rounded in blocks of per_block need uq, x + 128, the unsigned operand against signed weights: the
   AVX-512 VNNI and AMX kernels' every row, and AVX2's Q6_K passes (Q8_K blocks) without AVX-VNNI. */
#define Q8_UNSIGNED_X(per_block) (STRATA_AVX512VNNI || (STRATA_AVX2 && !STRATA_AVXVNNI && (per_block) == QK_K))

/* x's k values rounded into p's arrays (q8_at's layout), blocks of per_block (32 or 256). uq only where a kernel
   reads it (Q8_UNSIGNED_X); d_lanes, s_lanes and sum16_d only where the AVX-512 VNNI (and AMX) kernels do. */
static void q8_round_row(const float *x, int64_t k, int per_block, q8_x_t *p) {
    if (per_block == 32) q8_round_row_32(x, k, p);
    else q8_round_row_256(x, k, p);
    /* The arrays as restrict locals: through p, each store might have changed p's pointers, so GCC reloaded them
       and wrote a value at a time (the whole rounding then took 5 cycles a value, a quarter of AMX prefill's product
       time). */
    const int32_t *restrict lanes = p->lanes;
    int32_t *restrict sum16 = p->sum16, *restrict sum32 = p->sum32;
    float *restrict sum32_f = p->sum32_f;
    for (int64_t i = 0; i < k / 16; i++)
        sum16[i] = lanes[4 * i] + lanes[4 * i + 1] + lanes[4 * i + 2] + lanes[4 * i + 3];
    for (int64_t i = 0; i < k / 32; i++) {
        sum32[i] = sum16[2 * i] + sum16[2 * i + 1];
        sum32_f[i] = (float)sum32[i];
    }
    if (Q8_UNSIGNED_X(per_block)) {
        const int8_t *restrict q = p->q;
        uint8_t *restrict uq = p->uq;
        for (int64_t i = 0; i < k; i++) uq[i] = (uint8_t)(q[i] + 128);
    }
#if STRATA_AVX512VNNI
    const float *restrict d = p->d, *restrict s = p->s;
    float *restrict sum16_d = p->sum16_d, *restrict d_lanes = p->d_lanes, *restrict s_lanes = p->s_lanes;
    for (int64_t b = 0; b < k / per_block; b++) {
        const float s_lane = per_block == 32 ? s[b] * 0.125f : 0.f;
        for (int64_t i = b * per_block / 16; i < (b + 1) * per_block / 16; i++) sum16_d[i] = (float)sum16[i] * d[b];
        for (int64_t i = b * per_block / 4; i < (b + 1) * per_block / 4; i++) d_lanes[i] = d[b], s_lanes[i] = s_lane;
    }
#endif
}

/* Bytes of one rounded row of x (q8_x_t's arrays, 64-byte aligned): what q8_at lays out. */
static inline size_t q8_row_stride(int64_t k, int per_block) {
    const size_t floats = (size_t)(2 * (k / per_block) + 2 * (k / 4) + k / 16 + k / 32);
    const size_t per_row = 2 * (size_t)k + sizeof(float) * floats + sizeof(int32_t) * (size_t)(k / 4 + k / 16 + k / 32);
    return (per_row + 63) / 64 * 64;
}

/* The arrays of one rounded row at `at` (q8_row_stride bytes). */
static inline q8_x_t q8_at(uint8_t *at, int64_t k, int per_block) {
    q8_x_t x;
    x.lanes = (int32_t *)at;
    x.d_lanes = (float *)(x.lanes + k / 4);
    x.s_lanes = x.d_lanes + k / 4;
    x.sum16 = (int32_t *)(x.s_lanes + k / 4);
    x.sum32 = x.sum16 + k / 16;
    x.sum16_d = (float *)(x.sum32 + k / 32);
    x.sum32_f = x.sum16_d + k / 16;
    x.d = x.sum32_f + k / 32;
    x.s = x.d + k / per_block;
    x.q = (int8_t *)(x.s + k / per_block);
    x.uq = (uint8_t *)(x.q + k);
    return x;
}

#endif
