/* RMSNorm on CPU, with the residual add fused in (float32, or bfloat16 with float32 math rounded where torch
   rounds): a decode step's few rows on the calling thread, a prefill's many rows shared among the threads. Built on
   first use by kernels/cpu/build.py, called from strata/layers/norm.py and decode_layer.c. */
#include <math.h>
#include <stdint.h>

#include "abi.h"
#include "bf16.h"
#include "isa.h"
#include "threaded_rows.h"

#include <stddef.h>

/* One row: s = x (+ residual, rounded to the dtype, written to sum_out); out = weight * (s / rms(s)) with
   the normalized value rounded to the dtype before the weight multiplies it, as HF's RMSNorm does. */
#define DEFINE_ROW(NAME, T, LOAD, STORE)                                                                       \
    static void NAME(const T *x, const T *residual, const T *weight, T *out, T *sum_out, int64_t hidden,       \
                     float eps) {                                                                              \
        float squares = 0.f;                                                                                   \
        if (residual) {                                                                                        \
            _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < hidden; i++) {                  \
                const T v = STORE(LOAD(x[i]) + LOAD(residual[i]));                                             \
                sum_out[i] = v;                                                                                \
                squares += LOAD(v) * LOAD(v);                                                                  \
            }                                                                                                  \
            x = sum_out;                                                                                       \
        } else {                                                                                               \
            _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < hidden; i++)                    \
                squares += LOAD(x[i]) * LOAD(x[i]);                                                            \
        }                                                                                                      \
        const float inv = 1.f / sqrtf(squares / (float)hidden + eps);                                          \
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++)                                               \
            out[i] = STORE(LOAD(weight[i]) * LOAD(STORE(LOAD(x[i]) * inv)));                                   \
    }

static inline float same(float v) { return v; }
DEFINE_ROW(row_f32, float, same, same)
DEFINE_ROW(row_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

void rms_norm(const void *x, const void *residual, const void *weight, void *out, void *sum_out, int64_t rows,
              int64_t hidden, float eps, int bf16) {
#pragma omp parallel for if (rows >= THREADED_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * hidden;
        if (bf16)
            row_bf16((const uint16_t *)x + at, residual ? (const uint16_t *)residual + at : NULL, weight,
                     (uint16_t *)out + at, (uint16_t *)sum_out + at, hidden, eps);
        else
            row_f32((const float *)x + at, residual ? (const float *)residual + at : NULL, weight,
                    (float *)out + at, (float *)sum_out + at, hidden, eps);
    }
}

/* Each head of each token normalized in place (Qwen3's q/k norms over head_dim): heads `head_dim` apart, tokens
   `row_stride` apart (views into a fused qkv output). */
void rms_norm_heads(void *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride, const void *weight,
                    float eps, int bf16) {
#pragma omp parallel for if (tokens >= THREADED_ROWS) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * row_stride + h * head_dim;
            if (bf16)
                row_bf16((const uint16_t *)x + at, NULL, weight, (uint16_t *)x + at, NULL, head_dim, eps);
            else
                row_f32((const float *)x + at, NULL, weight, (float *)x + at, NULL, head_dim, eps);
        }
}

STRATA_ABI_EXPORT(rms_norm)
