/* Each row's greedy argmax over a decode step's logits (decode_forward in decode_layer.c; bound as `first_argmax`
   for its tests). Included by decode_layer.c. */
#ifndef STRATA_ROW_ARGMAX_H
#define STRATA_ROW_ARGMAX_H
#include <math.h>
#include <stdint.h>

#include "isa.h"

/* The largest of row[0 .. n) (n >= 1) if none is a NaN; NaN if one is. Vector maxima, four at a time: the scalar
   loop's chain of compares was 4 cycles a value (SmolLM2's 49152 logits: 50 us a row, single-threaded). */
static float row_top(const float *row, int64_t n) {
    int64_t v = 0;
    float top = row[0];
#if STRATA_AVX512F
    __m512 tops[4] = {_mm512_set1_ps(top), _mm512_set1_ps(top), _mm512_set1_ps(top), _mm512_set1_ps(top)};
    __mmask16 nan = 0;
    for (; v + 64 <= n; v += 64)
        for (int u = 0; u < 4; u++) {
            const __m512 x = _mm512_loadu_ps(row + v + 16 * u);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            tops[u] = _mm512_max_ps(tops[u], x);
        }
    if (nan) return NAN;
    top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3])));
#elif STRATA_AVX2
    __m256 tops[4] = {_mm256_set1_ps(top), _mm256_set1_ps(top), _mm256_set1_ps(top), _mm256_set1_ps(top)};
    __m256 nan = _mm256_setzero_ps();
    for (; v + 32 <= n; v += 32)
        for (int u = 0; u < 4; u++) {
            const __m256 x = _mm256_loadu_ps(row + v + 8 * u);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            tops[u] = _mm256_max_ps(tops[u], x);
        }
    if (_mm256_movemask_ps(nan)) return NAN;
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(tops[0], tops[1]), _mm256_max_ps(tops[2], tops[3])));
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
#endif
    for (; v < n; v++) {
        if (isnan(row[v])) return NAN;
        top = row[v] > top ? row[v] : top;
    }
    return top;
}

/* Each row's first largest value, a NaN counting as the largest (torch's and numpy's argmax): the largest value
   (row_top), then the first index holding it (-0 and +0 alike, as the compares of a single pass found them). */
void first_argmax(const float *rows, int64_t t, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < t; i++) {
        const float *row = rows + i * n, top = row_top(row, n);
        int64_t v = 0;
        if (isnan(top))
            while (!isnan(row[v])) v++;
        else
            while (row[v] != top) v++;
        out[i] = v;
    }
}

#endif
