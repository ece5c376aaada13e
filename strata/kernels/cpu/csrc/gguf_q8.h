/* GGUF products with x rounded to 8 bits as llama.cpp rounds it (the `quantized_activations=int8` option): each row
   of x once per product to Q8_0 blocks (32 values, an fp16 d = max|x| / 127, q = roundf(x / d); with Q8_1's
   s = fp16(d * sum q) for Q4_1 / Q5_1) for the legacy kinds, to Q8_K blocks (256 values, float d, q = nearest_int)
   for the K-quants, as ggml-quants.c's quantize_row_q8_{0,1,K}_ref do; then exact integer dot products per block,
   scaled in float once a block (AVX-512 VNNI vpdpbusd: the weights' unsigned q times x's signed q; AVX2's
   vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd, in gguf_q8_avx2.h; portable C elsewhere). Included by weight_only.c
   after gguf_matmul.h; kinds KIND_GGUF_Q8 + ggml's type. */
#ifndef STRATA_GGUF_Q8_H
#define STRATA_GGUF_Q8_H
#include <math.h>

#include "gguf_blocks.h"

enum { KIND_GGUF_Q8 = 64 }; /* + ggml's type: that GGUF kind, products with x rounded to 8 bits */

#define Q8_ROWS_PER_PASS 64 /* rows of x per pass over a task's weight rows (their rounded x stays in L2) */

/* Whether a GGUF kind has int8-activation kernels. */
static inline int q8_has_kernel(int kind) {
    switch (kind) {
    case KIND_Q4_0: case KIND_Q4_1: case KIND_Q5_0: case KIND_Q5_1: case KIND_Q8_0:
    case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K: return 1;
    default: return 0;
    }
}

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

/* One row of x rounded: q[k]; d per block (Q8_0: the fp16 d as float; Q8_K: float d); s per 32 (Q8_1's fp16 s);
   lanes: q summed per 4 values (each int32 lane of a vpdpbusd); sum16: q summed per 16 (Q8_K's bsums). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *lanes, *sum16;
} q8_x_t;

/* Blocks of 32 (Q8_0 / Q8_1), quantize_row_q8_1_ref's arithmetic. */
static void q8_round_row_32(const float *x, int64_t k, q8_x_t *p) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int q = (int)roundf(v[j] * id);
            p->q[32 * b + j] = (int8_t)q;
            sum += q;
        }
        p->d[b] = q8_round_half(d);
        p->s[b] = q8_round_half((float)sum * d);
    }
}

/* Blocks of 256 (Q8_K), quantize_row_q8_K_ref's arithmetic: the scale from the signed value of largest magnitude. */
static void q8_round_row_256(const float *x, int64_t k, q8_x_t *p) {
    for (int64_t b = 0; b < k / QK_K; b++) {
        const float *v = x + QK_K * b;
        float max = 0.f, amax = 0.f; /* the first value of largest magnitude (the reference's strict >) */
        for (int j = 0; j < QK_K; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j];
        if (amax == 0.f) {
            memset(p->q + QK_K * b, 0, QK_K);
            p->d[b] = 0.f;
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int q = q8_nearest_int(iscale * v[j]);
            p->q[QK_K * b + j] = (int8_t)(q < 127 ? q : 127);
        }
        p->d[b] = 1.f / iscale;
    }
}

static void q8_round_row(const float *x, int64_t k, int per_block, q8_x_t *p) {
    if (per_block == 32) q8_round_row_32(x, k, p);
    else q8_round_row_256(x, k, p);
    for (int64_t i = 0; i < k / 4; i++)
        p->lanes[i] = p->q[4 * i] + p->q[4 * i + 1] + p->q[4 * i + 2] + p->q[4 * i + 3];
    for (int64_t i = 0; i < k / 16; i++)
        p->sum16[i] = p->lanes[4 * i] + p->lanes[4 * i + 1] + p->lanes[4 * i + 2] + p->lanes[4 * i + 3];
}

/* Portable: one block of a weight row against rounded x (block b). Integer sums per run, float once a block. */
static inline float q8_block_portable(int kind, const uint8_t *block, int64_t b, const q8_x_t *x) {
    int q[32];
    float scale[2], offset[2];
    if (gguf_block_values(kind) == 32) {
        gguf_run_scalar(kind, block, 0, q, scale, offset);
        const int8_t *xq = x->q + 32 * b;
        int32_t sum = 0;
        for (int l = 0; l < 32; l++) sum += q[l] * xq[l];
        const int32_t xsum = x->sum16[2 * b] + x->sum16[2 * b + 1];
        const float d = half_at(block);
        if (kind == KIND_Q4_1 || kind == KIND_Q5_1) return d * x->d[b] * (float)sum + half_at(block + 2) * x->s[b];
        const int off = kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : 0;
        return d * x->d[b] * (float)(sum - off * xsum);
    }
    int32_t total = 0, mins = 0;
    for (int j = 0; j < 8; j++) { /* 32-value runs */
        gguf_run_scalar(kind, block, j, q, scale, offset);
        const int8_t *xq = x->q + QK_K * b + 32 * j;
        int32_t half_sums[2] = {0, 0};
        for (int l = 0; l < 32; l++) half_sums[l / 16] += q[l] * xq[l];
        const int32_t *s16 = x->sum16 + QK_K / 16 * b + 2 * j;
        if (kind == KIND_Q6_K) { /* 16-value sub-blocks with int8 scales, offset -32 */
            const int h = j / 4, s = j % 4;
            for (int i = 0; i < 2; i++)
                total += (int8_t)block[192 + 8 * h + 2 * s + i] * (half_sums[i] - 32 * s16[i]);
        } else {
            int sc, mn;
            k_scale_min(block + 4, j, &sc, &mn);
            total += sc * (half_sums[0] + half_sums[1]);
            mins += mn * (s16[0] + s16[1]);
        }
    }
    if (kind == KIND_Q6_K) return half_at(block + 208) * x->d[b] * (float)total;
    return x->d[b] * half_at(block) * (float)total - x->d[b] * half_at(block + 2) * (float)mins;
}

static inline float q8_row_portable(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x) {
    const int64_t bytes = gguf_block_bytes(kind);
    float sum = 0.f;
    for (int64_t b = 0; b < blocks; b++) sum += q8_block_portable(kind, row + b * bytes, b, x);
    return sum;
}

#if STRATA_AVX512VNNI
#include "gguf_q8_vnni.h"
#elif STRATA_AVX2
#include "gguf_q8_avx2.h"
#endif

#if STRATA_AVX2 && !STRATA_AVX512VNNI
#define Q8_TILE Q8A_ROWS /* rows of x that AVX2's kernels take at once */
#else
#define Q8_TILE 1
#endif

/* One weight row against `count` rounded rows of x (1 or Q8_TILE): y[r]. The AVX-512 VNNI kernels, else AVX2's,
   else portable C. */
static inline void q8_rows(int kind, const uint8_t *row, int64_t blocks, const q8_x_t *x, int count, float *y) {
#if STRATA_AVX512VNNI
    (void)count;
    y[0] = q8_row_vnni(kind, row, blocks, x);
#elif STRATA_AVX2
    q8_rows_avx2(kind, row, blocks, x, count, y);
#else
    (void)count;
    y[0] = q8_row_portable(kind, row, blocks, x);
#endif
}

/* Bytes of one rounded row of x (q8_x_t's arrays, 64-byte aligned): what q8_at lays out. */
static inline size_t q8_row_stride(int64_t k, int per_block) {
    const size_t per_row = (size_t)k + sizeof(float) * (size_t)(2 * (k / per_block)) +
                           sizeof(int32_t) * (size_t)(k / 4 + k / 16);
    return (per_row + 63) / 64 * 64;
}

/* The arrays of one rounded row at `at` (q8_row_stride bytes). */
static inline q8_x_t q8_at(uint8_t *at, int64_t k, int per_block) {
    q8_x_t x;
    x.lanes = (int32_t *)at;
    x.sum16 = x.lanes + k / 4;
    x.d = (float *)(x.sum16 + k / 16);
    x.s = x.d + k / per_block;
    x.q = (int8_t *)(x.s + k / per_block);
    return x;
}

/* Rounds every row of x once (threads over rows when there are many); -1 when memory ran out. The caller frees
   *buffer. */
static int q8_prepare(const float *x, int64_t m_total, int64_t k, int per_block, q8_x_t *xs, void **buffer) {
    const size_t stride = q8_row_stride(k, per_block);
    uint8_t *base = aligned_alloc(64, stride * (size_t)m_total);
    if (!base) return -1;
    *buffer = base;
    for (int64_t m = 0; m < m_total; m++) xs[m] = q8_at(base + stride * (size_t)m, k, per_block);
#pragma omp parallel for schedule(static) if (m_total >= 8)
    for (int64_t m = 0; m < m_total; m++) q8_round_row(x + m * k, k, per_block, xs + m);
    return 0;
}

/* out[m_total, n] = rounded rows xs times a GGUF weight's transpose (+ bias): the weight's rows shared among the
   threads, each read once for up to Q8_ROWS_PER_PASS rows of x. */
static void q8_multiply(const weights_t *w, const q8_x_t *xs, int64_t m_total, const float *bias, float *out,
                        int num_threads) {
    const int64_t blocks = w->k / gguf_block_values(w->kind);
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        for (int64_t m0 = 0; m0 < m_total; m0 += Q8_ROWS_PER_PASS) {
            const int64_t m1 = m0 + Q8_ROWS_PER_PASS < m_total ? m0 + Q8_ROWS_PER_PASS : m_total;
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *row = w->data + n * w->row_bytes;
                for (int64_t m = m0; m < m1;) {
                    const int count = m1 - m >= Q8_TILE ? Q8_TILE : 1;
                    float y[Q8_TILE];
                    q8_rows(w->kind, row, blocks, xs + m, count, y);
                    for (int r = 0; r < count; r++, m++) out[m * w->n + n] = y[r] + (bias ? bias[n] : 0.f);
                }
            }
        }
    }
}

/* out[m_total, n] = x (rounded as above) times a GGUF weight's transpose (+ bias), any number of rows of x; the
   weight's rows shared among the threads, each read once for up to Q8_ROWS_PER_PASS rows of x. Returns 0, -1 when
   memory ran out, -2 for a kind without these kernels. */
static int gguf_q8_matmul(const weights_t *w, const float *x, int64_t m_total, const float *bias, float *out,
                          int num_threads) {
    if (!q8_has_kernel(w->kind)) return -2;
    const int per_block = (int)gguf_block_values(w->kind);
    q8_x_t *xs = calloc((size_t)m_total, sizeof(q8_x_t));
    void *buffer = NULL;
    if (!xs || q8_prepare(x, m_total, w->k, per_block, xs, &buffer) != 0) {
        free(xs);
        return -1;
    }
    q8_multiply(w, xs, m_total, bias, out, num_threads);
    free(buffer);
    free(xs);
    return 0;
}

#endif
