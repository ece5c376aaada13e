/* exp(x) in plain arithmetic the compiler vectorizes (libm's expf is a call per value), shared by strata's C
   libraries: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error under
   3e-7), 2^n built in the exponent bits; x clamped to [-87, 88], where float32 stays normal and finite. n is
   rounded by adding and taking away 1.5 * 2^23 (ties to even): roundf would be a libm call per value, and the
   loops calling this would not vectorize. */
#ifndef STRATA_FAST_EXP_H
#define STRATA_FAST_EXP_H
#include <stdint.h>
#include <string.h>

static inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float shifter = 12582912.f; /* 1.5 * 2^23: adding it leaves no fraction bits */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
