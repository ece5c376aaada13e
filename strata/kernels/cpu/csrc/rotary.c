/* Rotary embedding of query and key heads on CPU, in place (half-split "neox" style; float32, or bfloat16 with every
   product and sum rounded as torch rounds them): a decode step's few tokens on the calling thread, a prefill's many
   shared among the threads. Built on first use by kernels/cpu/build.py, called from strata/layers/rotary.py with the
   step's cos/sin tables, which torch computes once per step. */
#include <stdint.h>

#include "abi.h"
#include "bf16.h"
#include "isa.h"
#include "threaded_rows.h"

/* x[:h] <- x1 cos - x2 sin, x[h:2h] <- x2 cos + x1 sin for the first `rotary_dim` = 2h dimensions of each head
   of each token (the rest of a head is left as it is: partial rotary); rows of x are `row_stride` elements apart,
   heads `head_dim` apart; cos/sin are [tokens, rotary_dim / 2]. No fused multiply-adds: each product is rounded on
   its own, as torch's separate multiplications round it. */
#define DEFINE_ROTATE(NAME, T, LOAD, STORE)                                                                   \
    __attribute__((optimize("fp-contract=off"))) static void NAME(                                            \
        T *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim, int64_t row_stride,        \
        const T *cos, const T *sin) {                                                                         \
        const int64_t half = rotary_dim / 2;                                                                  \
        _Pragma("omp parallel for if (tokens >= THREADED_ROWS) schedule(static)")                           \
        for (int64_t t = 0; t < tokens; t++) {                                                                \
            const T *c = cos + t * half, *s = sin + t * half;                                                 \
            for (int64_t h = 0; h < heads; h++) {                                                             \
                T *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;                                   \
                _Pragma("omp simd") for (int64_t i = 0; i < half; i++) {                                      \
                    const float a = LOAD(x1[i]), b = LOAD(x2[i]), ci = LOAD(c[i]), si = LOAD(s[i]);           \
                    x1[i] = STORE(LOAD(STORE(a * ci)) - LOAD(STORE(b * si)));                                  \
                    x2[i] = STORE(LOAD(STORE(b * ci)) + LOAD(STORE(a * si)));                                  \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

static inline float same(float v) { return v; }
DEFINE_ROTATE(rotate_f32, float, same, same)
DEFINE_ROTATE(rotate_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

void rope_half_split(void *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                     int64_t row_stride, const void *cos, const void *sin, int bf16) {
    if (bf16) rotate_bf16(x, tokens, heads, head_dim, rotary_dim, row_stride, cos, sin);
    else rotate_f32(x, tokens, heads, head_dim, rotary_dim, row_stride, cos, sin);
}

STRATA_ABI_EXPORT(rotary)
