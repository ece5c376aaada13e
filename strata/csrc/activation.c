/* SwiGLU's silu(gate) * up for the few rows of a decode step on CPU (float32, or bfloat16 with float32 math
   rounded where torch rounds: after silu and after the product). Built on first use by strata/native.py, called
   from strata/layers/activation.py; larger batches stay on torch's vectorized, threaded ops. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                                  \
    static void NAME(const T *gate_up, T *out, int64_t rows, int64_t width) {                                  \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                                       \
            T *o = out + r * width;                                                                            \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) {                                          \
                const float g = LOAD(gate[i]);                                                                 \
                o[i] = STORE(LOAD(STORE(g / (1.f + fast_exp(-g)))) * LOAD(up[i]));                             \
            }                                                                                                  \
        }                                                                                                      \
    }

static inline float same(float v) { return v; }
DEFINE_SILU_MUL(silu_mul_f32, float, same, same)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* gate_up: [rows, 2 * width] (gate then up, contiguous); out: [rows, width]. */
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) silu_mul_bf16(gate_up, out, rows, width);
    else silu_mul_f32(gate_up, out, rows, width);
}
