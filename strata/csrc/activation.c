/* SwiGLU's silu(gate) * up, and Gemma's gelu_tanh(gate) * up, on CPU (float32, or bfloat16 with float32 math
   rounded where torch rounds: after the activation and after the product): a decode step's few rows on the calling
   thread, a prefill's many rows shared among the threads. Built on first use by strata/native.py, called from
   strata/layers/activation.py and decode_layer.c. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

/* Rows from which a call shares them among the threads: below, waking the threads costs more than the rows. */
#define THREADED_ROWS 32

static inline float silu(float g) { return g / (1.f + fast_exp(-g)); }

/* 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3): torch's approximate="tanh", written as
   g / (1 + e^(-2u)), the same value without 1 + tanh(u)'s cancellation for negative gates, in a form that
   vectorizes (fast_exp clamps e^(-2u) for large |u|). */
static inline float gelu_tanh(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.f + fast_exp(-2.f * u));
}

/* out = GATE(gate) * up, row by row; gate_up: [rows, 2 * width] (gate then up, contiguous); out: [rows, width]. */
#define DEFINE_GATED_MUL(NAME, GATE, T, LOAD, STORE)                                                           \
    static void NAME(const T *gate_up, T *out, int64_t rows, int64_t width) {                                  \
        _Pragma("omp parallel for if (rows >= THREADED_ROWS) schedule(static)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                                       \
            T *o = out + r * width;                                                                            \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++)                                            \
                o[i] = STORE(LOAD(STORE(GATE(LOAD(gate[i])))) * LOAD(up[i]));                                  \
        }                                                                                                      \
    }

static inline float same(float v) { return v; }
DEFINE_GATED_MUL(silu_mul_f32, silu, float, same, same)
DEFINE_GATED_MUL(silu_mul_bf16, silu, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_GATED_MUL(gelu_tanh_mul_f32, gelu_tanh, float, same, same)
DEFINE_GATED_MUL(gelu_tanh_mul_bf16, gelu_tanh, uint16_t, bf16_to_f32, f32_to_bf16)

void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) silu_mul_bf16(gate_up, out, rows, width);
    else silu_mul_f32(gate_up, out, rows, width);
}

void gelu_tanh_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) gelu_tanh_mul_bf16(gate_up, out, rows, width);
    else gelu_tanh_mul_f32(gate_up, out, rows, width);
}
