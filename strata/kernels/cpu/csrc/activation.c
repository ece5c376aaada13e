/* SwiGLU's silu(gate) * up, and Gemma's gelu_tanh(gate) * up, on CPU (float32, or bfloat16 with float32 math
   rounded where torch rounds: after the activation and after the product): a decode step's few rows on the calling
   thread, a prefill's many rows shared among the threads. Built on first use by kernels/cpu/build.py, called from
   strata/layers/activation.py and decode_layer.c. */
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "bf16.h"
#include "fast_exp.h"
#include "isa.h"
#include "threaded_rows.h"

/* Each gate is g / (1 + e^a), a its exponent: silu's -g; torch's approximate="tanh" GELU, 0.5 g (1 + tanh(u)) with
   u = sqrt(2 / pi) (g + 0.044715 g^3), written with a = -2u: the same value without 1 + tanh(u)'s cancellation for
   negative gates (fast_exp clamps e^a for large |u|). */
static inline float silu_exponent(float g) { return -g; }
static inline float gelu_tanh_exponent(float g) { return -2.f * (0.7978845608028654f * (g + 0.044715f * g * g * g)); }

#define CHUNK 256 /* values of a row whose exponentials are taken together, 16 or 8 at a time (fast_exp.h) */

/* out = activation(gate) * up, row by row; gate_up: [rows, 2 * width] (gate then up, contiguous); out: [rows, width]. */
#define DEFINE_GATED_MUL(NAME, EXPONENT, T, LOAD, STORE)                                                       \
    static void NAME(const T *gate_up, T *out, int64_t rows, int64_t width) {                                  \
        _Pragma("omp parallel for if (rows >= THREADED_ROWS) schedule(static)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                                       \
            T *o = out + r * width;                                                                            \
            float e[CHUNK];                                                                                    \
            for (int64_t c = 0; c < width; c += CHUNK) {                                                       \
                const int64_t n = width - c < CHUNK ? width - c : CHUNK;                                       \
                _Pragma("omp simd") for (int64_t i = 0; i < n; i++) e[i] = EXPONENT(LOAD(gate[c + i]));        \
                fast_exp_in_place(e, n);                                                                       \
                _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                            \
                    o[c + i] = STORE(LOAD(STORE(LOAD(gate[c + i]) / (1.f + e[i]))) * LOAD(up[c + i]));         \
            }                                                                                                  \
        }                                                                                                      \
    }

static inline float same(float v) { return v; }
DEFINE_GATED_MUL(silu_mul_f32, silu_exponent, float, same, same)
DEFINE_GATED_MUL(silu_mul_bf16, silu_exponent, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_GATED_MUL(gelu_tanh_mul_f32, gelu_tanh_exponent, float, same, same)
DEFINE_GATED_MUL(gelu_tanh_mul_bf16, gelu_tanh_exponent, uint16_t, bf16_to_f32, f32_to_bf16)

void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) silu_mul_bf16(gate_up, out, rows, width);
    else silu_mul_f32(gate_up, out, rows, width);
}

void gelu_tanh_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) gelu_tanh_mul_bf16(gate_up, out, rows, width);
    else gelu_tanh_mul_f32(gate_up, out, rows, width);
}

STRATA_ABI_EXPORT(activation)
