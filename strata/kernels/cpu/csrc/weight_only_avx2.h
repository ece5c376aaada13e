/* AVX2 batch-1 kernels for int4 and int8 weights (included by weight_only.c on AVX2 CPUs without AVX-512, after
   load_block). Widening int4 to float costs about three vector ops per 8 weights, so the float kernel was
   compute-bound on two Zen 3 cores (6.7 ns per 64 values a thread, 9 GB/s). Here, as in the VNNI kernel, x is
   rounded once per call to 24-bit fixed point (one scale per 128 values of K: at most 2^-24 of the block's largest
   value off, float32's own rounding) and split into three signed bytes, and vpmaddubsw multiplies 32 unsigned
   nibbles by 32 of them exactly: 4.1 ns per 64 values, 15 GB/s. (llama.cpp rounds x to 8 bits.) With more rows of
   x the float kernels win: they widen each weight once for every row, where this pays three products a row.
   int8 weights take the same rounded x as two 12-bit digits (vpmaddwd; bytes would overflow vpmaddubsw). */
#ifndef STRATA_WEIGHT_ONLY_AVX2_H
#define STRATA_WEIGHT_ONLY_AVX2_H
#include <immintrin.h>

#define I4_CHUNK 64         /* values of K in one 32-byte load of weights: two 32-value blocks */
#define I4_XBLOCK 128       /* values of K that share one scale of x */
#define I4_LIMIT 8323072.f  /* 127 * 65536: the high byte stays within -127..127 */
#define I4_DIGITS 3

/* x prepared for one row of weights: x / scale = 65536 digits[0] + 256 digits[1] + digits[2], each digit in the
   order the nibbles of a chunk come out: a chunk's 32 bytes are blocks 2c and 2c + 1 of 16 bytes, so its low
   nibbles are values 0-15 of both blocks, the high nibbles values 16-31 of both. */
typedef struct {
    float *buffer;             /* the one allocation: x padded with zeros to whole 128-value blocks, then the rest */
    int8_t *digits[I4_DIGITS]; /* each [chunks * 64] */
    float *scale;              /* [xblocks], of x times `lift` */
    float lift;                /* 2^64 for a row of tiny values (its scales would underflow), else 1 */
    float *xsum;               /* [groups]: the rounded x summed per weight group, for the zero points */
    int32_t *group_of;         /* [2 * chunks]: the weight group of each 32-value block */
    int64_t chunks;
} int4_x_t;

/* Position in a chunk of the 16 values starting at value o (0, 16, 32 or 48): the middle quarters trade places. */
static inline int64_t int4_position(int64_t o) { return o == 16 ? 32 : o == 32 ? 16 : o; }

/* 16 int32 (in a, b) as 16 bytes at dst (each within -128..127). */
static inline void store_bytes16(__m256i a, __m256i b, int8_t *dst) {
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* a | b as int16 */
    const __m256i bytes = _mm256_packs_epi16(words, words);                        /* a a | b b */
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(_mm256_permute4x64_epi64(bytes, 0x08)));
}

/* The balanced base-256 digits of v (|v| <= I4_LIMIT): v = 65536 high + 256 middle + low. */
static inline void split_digits(__m256i v, __m256i digit[I4_DIGITS]) {
    const __m256i bias = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
    const __m256i low = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, bias), byte), bias);
    const __m256i upper = _mm256_srai_epi32(_mm256_sub_epi32(v, low), 8);
    const __m256i middle = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(upper, bias), byte), bias);
    digit[0] = _mm256_srai_epi32(_mm256_sub_epi32(upper, middle), 8);
    digit[1] = middle;
    digit[2] = low;
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The largest magnitude of x[k0, k1), or NaN when one of its values is not finite (x * 0 is NaN there). */
static float x_block_extent(const float *row, int64_t k0, int64_t k1) {
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = k0; i < k1; i += 8) {
        const __m256 values = _mm256_loadu_ps(row + i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(values, magnitude));
        finite = _mm256_add_ps(finite, _mm256_mul_ps(values, _mm256_setzero_ps()));
    }
    return hmax(amax) + hsum(finite);
}

/* How a block of x with extent `extent` is rounded: x * lift / scale into +-I4_LIMIT (a NaN extent gives NaN). */
typedef struct {
    float scale;
    __m256 lifted, inverse;
} x_rounding_t;

static inline x_rounding_t x_rounding(float extent, float lift) {
    const float largest = extent * lift;
    const x_rounding_t r = {largest / I4_LIMIT, _mm256_set1_ps(lift),
                            _mm256_set1_ps(largest > 0.f ? I4_LIMIT / largest : 0.f)};
    return r;
}

/* Eight values of x at p, rounded. */
static inline __m256i x_round8(const float *p, const x_rounding_t *r) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(p), r->lifted), r->inverse));
}

/* One 128-value block of x (zero past K: `row` is padded) rounded into p, its extent (largest magnitude) times
   `lift` setting the scale; a NaN extent makes the scale NaN, so the outputs it reaches are NaN, as in float. The
   rounded values summed per 32-value block join their group's xsum (in double: it meets the zero points' large
   factor). */
static void int4_round_block(const float *row, int64_t k0, int64_t k1, int64_t b, float extent, float lift,
                             int4_x_t *p, double *sums) {
    const x_rounding_t rounding = x_rounding(extent, lift);
    const float scale = p->scale[b] = rounding.scale;
    for (int64_t i = k0; i < k1; i += BLOCK) {
        __m256i block_sum = _mm256_setzero_si256();
        for (int64_t h = i; h < i + BLOCK; h += 16) {
            __m256i v[2], digits[2][I4_DIGITS];
            for (int j = 0; j < 2; j++) {
                v[j] = x_round8(row + h + 8 * j, &rounding);
                split_digits(v[j], digits[j]);
            }
            const int64_t at = h / I4_CHUNK * I4_CHUNK + int4_position(h % I4_CHUNK);
            for (int d = 0; d < I4_DIGITS; d++) store_bytes16(digits[0][d], digits[1][d], p->digits[d] + at);
            block_sum = _mm256_add_epi32(block_sum, _mm256_add_epi32(v[0], v[1]));
        }
        sums[p->group_of[i / BLOCK]] += (double)scale * hsum_epi32(block_sum);
    }
}

/* The weight group of value k; a value past K (its products are 0) takes the last group. */
static inline int32_t group_of_value(const weights_t *w, int64_t k) {
    const int64_t g = k / w->group_size;
    return (int32_t)(g < w->groups ? g : w->groups - 1);
}

static inline int64_t int4_block_end(int64_t b, int64_t stride) {
    return (b + 1) * I4_XBLOCK < stride ? (b + 1) * I4_XBLOCK : stride;
}

/* One buffer of `floats` floats (x first, zero-padded to `padded` values) and `bytes` more, and the per-group sums
   (zeroed); NULL, with nothing allocated, when memory ran out. */
static float *x_buffer(const weights_t *w, const float *x, int64_t padded, size_t floats, size_t bytes,
                       double **sums) {
    float *f = aligned_alloc(64, (floats * sizeof(float) + bytes + 63) / 64 * 64);
    *sums = calloc((size_t)w->groups, sizeof(double));
    if (!f || !*sums) {
        free(f);
        free(*sums);
        return NULL;
    }
    memcpy(f, x, (size_t)w->k * sizeof(float));
    memset(f + w->k, 0, (size_t)(padded - w->k) * sizeof(float));
    return f;
}

/* Each 128-value block's extent into extent[b]; returns the row's lift: 2^64 for a row of tiny values (its scales
   would underflow), else 1. */
static float x_extents(const float *row, int64_t xblocks, int64_t stride, float *extent) {
    float row_max = 0.f;
    for (int64_t b = 0; b < xblocks; b++) {
        extent[b] = x_block_extent(row, b * I4_XBLOCK, int4_block_end(b, stride));
        row_max = extent[b] > row_max ? extent[b] : row_max;
    }
    return row_max < 0x1p-60f ? 0x1p64f : 1.f;
}

/* Round one row of x to the prepared form; returns -1 when memory ran out. One buffer holds it all. */
static int int4_prepare_x(const weights_t *w, const float *x, int4_x_t *p) {
    const int64_t values = w->row_bytes * 2, stride = (values + I4_CHUNK - 1) / I4_CHUNK * I4_CHUNK;
    const int64_t xblocks = (stride + I4_XBLOCK - 1) / I4_XBLOCK, padded = xblocks * I4_XBLOCK;
    p->chunks = stride / I4_CHUNK;
    const size_t floats = (size_t)(padded + xblocks + w->groups + 2 * p->chunks);
    double *sums;
    float *f = x_buffer(w, x, padded, floats, I4_DIGITS * (size_t)stride, &sums);
    if (!f) return -1;
    float *row = p->buffer = f;
    p->scale = row + padded;
    p->xsum = p->scale + xblocks;
    p->group_of = (int32_t *)(p->xsum + w->groups);
    for (int64_t b = 0; b < 2 * p->chunks; b++) p->group_of[b] = group_of_value(w, b * BLOCK);
    for (int d = 0; d < I4_DIGITS; d++) p->digits[d] = (int8_t *)(f + floats) + d * stride;
    p->lift = x_extents(row, xblocks, stride, p->scale); /* the extents wait in p->scale until the lift is known */
    for (int64_t b = 0; b < xblocks; b++)
        int4_round_block(row, b * I4_XBLOCK, int4_block_end(b, stride), b, p->scale[b], p->lift, p, sums);
    for (int64_t g = 0; g < w->groups; g++) p->xsum[g] = (float)sums[g];
    free(sums);
    return 0;
}

/* Chunk c of a row: its 64 nibbles as unsigned bytes, low nibbles in lo, high in hi (zeros past a row that ends
   half way through the chunk, reading nothing past it). */
static inline void int4_chunk(const uint8_t *row, int64_t c, int half, __m256i *lo, __m256i *hi) {
    const uint8_t *p = row + c * (I4_CHUNK / 2);
    const __m256i bytes = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p))
                               : _mm256_loadu_si256((const __m256i *)p);
    const __m256i nibble = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(bytes, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
}

/* The products of COUNT chunks from chunk c, the last one ending half way when `half`: gathered exactly in int16
   (at most 2 * COUNT products of 2 * 15 * 128 a lane), then in int32. */
static inline __attribute__((always_inline)) __m256 int4_segment(const uint8_t *row, const int4_x_t *xp, int64_t c,
                                                                const int COUNT, int half) {
    __m256i acc[I4_DIGITS];
    for (int d = 0; d < I4_DIGITS; d++) acc[d] = _mm256_setzero_si256();
    for (int i = 0; i < COUNT; i++) {
        const int64_t cc = c + i;
        if (!(cc & 1)) prefetch_ahead(row + cc * (I4_CHUNK / 2), 64); /* once per line */
        __m256i lo, hi;
        int4_chunk(row, cc, half && i == COUNT - 1, &lo, &hi);
        for (int d = 0; d < I4_DIGITS; d++) {
            const __m256i *x = (const __m256i *)(xp->digits[d] + cc * I4_CHUNK);
            acc[d] = _mm256_add_epi16(acc[d], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(x)),
                                                               _mm256_maddubs_epi16(hi, _mm256_loadu_si256(x + 1))));
        }
    }
    /* the digits joined in int32: a lane sums 4 * COUNT products of at most 15 * 127 (high digit) or 15 * 128, so
       65536 high + 256 middle + low stays under 2.03e9 (COUNT = 2); one rounding, in the conversion */
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i upper = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(acc[0], ones), 8),
                                           _mm256_madd_epi16(acc[1], ones));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(upper, 8), _mm256_madd_epi16(acc[2], ones)));
}

/* The scale of the segment at chunk c: the group's weight scale times the x block's; one chunk holding two
   groups gives each 128-bit half (one 32-value block) its own. */
static inline __m256 int4_scale(const float *scales, const int4_x_t *xp, int64_t c, const int SEG) {
    const __m256 ws = SEG == 2 ? _mm256_set1_ps(scales[xp->group_of[2 * c]])
                               : _mm256_set_m128(_mm_set1_ps(scales[xp->group_of[2 * c + 1]]),
                                                 _mm_set1_ps(scales[xp->group_of[2 * c]]));
    return _mm256_mul_ps(ws, _mm256_set1_ps(xp->scale[c * I4_CHUNK / I4_XBLOCK]));
}

/* Rows n0..n1 against the prepared x, a segment of SEG chunks at a time (two when every group and x block spans
   them both); the zero points' term joins at the end. */
static inline __attribute__((always_inline)) void int4_rows(const weights_t *w, int64_t n0, int64_t n1,
                                                           const int4_x_t *xp, const int SEG, const float *bias,
                                                           float *out) {
    const int half = w->row_bytes % (I4_CHUNK / 2) != 0;
    const int64_t whole = (xp->chunks - half) / SEG * SEG; /* chunks in whole segments, none ending half way */
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w->data + n * w->row_bytes;
        const float *scales = w->scales + n * w->groups;
        __m256 total = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c < whole; c += SEG)
            total = _mm256_fmadd_ps(int4_segment(row, xp, c, SEG, 0), int4_scale(scales, xp, c, SEG), total);
        if (c < xp->chunks) /* one chunk or two, the last perhaps half */
            total = _mm256_fmadd_ps(xp->chunks - c == 2 ? int4_segment(row, xp, c, 2, half)
                                                        : int4_segment(row, xp, c, 1, half),
                                    int4_scale(scales, xp, c, SEG), total);
        out[n] = (hsum(total) - zero_term(w, n, xp->xsum)) / xp->lift + (bias ? bias[n] : 0.f);
    }
}

static void int4_rows_pairs(const weights_t *w, int64_t n0, int64_t n1, const int4_x_t *xp, const float *bias,
                            float *out) {
    int4_rows(w, n0, n1, xp, 2, bias, out);
}

static void int4_rows_single(const weights_t *w, int64_t n0, int64_t n1, const int4_x_t *xp, const float *bias,
                             float *out) {
    int4_rows(w, n0, n1, xp, 1, bias, out);
}

/* out[1, n] = x[1, k] times an int4 weight's transpose (+ bias); -1 when memory ran out. */
static int matmul_int4_avx2(const weights_t *w, const float *x, const float *bias, float *out, int num_threads) {
    int4_x_t xp;
    if (int4_prepare_x(w, x, &xp) != 0) return -1;
    const int pairs = w->groups == 1 || w->group_size % I4_XBLOCK == 0;
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* A small weight is read faster by one thread than the fork of a second costs. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        (pairs ? int4_rows_pairs : int4_rows_single)(w, n0, n1, &xp, bias, out);
    }
    free(xp.buffer);
    return 0;
}

/* int8 weights, batch 1: x rounded as for int4 (24-bit fixed point per 128 values, lifted when tiny) but split
   into two balanced 12-bit digits held as int16, so that vpmaddwd multiplies 16 weights widened to int16 by 16
   digits exactly: five vector ops per 16 weights where widening them to float took seven. Serves weights whose
   groups hold whole 128-value blocks (per channel, or groups of 128, 256, ...). From DRAM on two Zen 3 cores:
   13-15 GB/s against the float kernel's 9.4-11.3 (a plain read loop: 15-18). */
#define I8_SHIFT 4096.f
typedef struct {
    float *buffer;
    int16_t *high, *low; /* [padded K] each: x / scale = 4096 high + low */
    float *scale;        /* [xblocks] */
    float lift;
    float *xsum;       /* [groups] */
    int32_t *group_of; /* [xblocks]: the weight group of each 128-value block */
    int64_t xblocks;
} int8_x_t;

static int int8_prepare_x(const weights_t *w, const float *x, int8_x_t *p) {
    const int64_t xblocks = (w->row_bytes + I4_XBLOCK - 1) / I4_XBLOCK, padded = xblocks * I4_XBLOCK;
    const size_t floats = (size_t)(padded + 2 * xblocks + w->groups);
    double *sums;
    float *f = x_buffer(w, x, padded, floats, 2 * (size_t)padded * sizeof(int16_t), &sums);
    if (!f) return -1;
    float *row = p->buffer = f;
    p->scale = row + padded;
    p->xsum = p->scale + xblocks;
    p->group_of = (int32_t *)(p->xsum + w->groups);
    p->high = (int16_t *)(f + floats);
    p->low = p->high + padded;
    p->xblocks = xblocks;
    p->lift = x_extents(row, xblocks, padded, p->scale);
    const __m256i bias = _mm256_set1_epi32(2048), mask = _mm256_set1_epi32(4095);
    for (int64_t b = 0; b < xblocks; b++) {
        const x_rounding_t rounding = x_rounding(p->scale[b], p->lift);
        const float scale = p->scale[b] = rounding.scale;
        __m256i block_sum = _mm256_setzero_si256();
        for (int64_t i = b * I4_XBLOCK; i < (b + 1) * I4_XBLOCK; i += 16) {
            __m256i v[2], high[2], low[2];
            for (int j = 0; j < 2; j++) {
                v[j] = x_round8(row + i + 8 * j, &rounding);
                low[j] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v[j], bias), mask), bias);
                high[j] = _mm256_srai_epi32(_mm256_sub_epi32(v[j], low[j]), 12);
            }
            /* packs interleaves 128-bit lanes: the permute puts the 16 values back in order */
            _mm256_storeu_si256((__m256i *)(p->high + i),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(high[0], high[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(p->low + i),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(low[0], low[1]), 0xD8));
            block_sum = _mm256_add_epi32(block_sum, _mm256_add_epi32(v[0], v[1]));
        }
        p->group_of[b] = group_of_value(w, b * I4_XBLOCK);
        sums[p->group_of[b]] += (double)scale * hsum_epi32(block_sum);
    }
    for (int64_t g = 0; g < w->groups; g++) p->xsum[g] = (float)sums[g];
    free(sums);
    return 0;
}

/* Rows n0..n1 against the prepared x: per 128-value block two exact int32 sums (a lane adds 16 products of at most
   255 * 2048, under 2^24, so each converts to float exactly), joined as 4096 high + low in float. */
static void int8_rows(const weights_t *w, int64_t n0, int64_t n1, const int8_x_t *xp, const float *bias,
                      float *out) {
    const __m256 shift = _mm256_set1_ps(I8_SHIFT);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w->data + n * w->row_bytes;
        const float *scales = w->scales + n * w->groups;
        __m256 total = _mm256_setzero_ps();
        for (int64_t b = 0; b < xp->xblocks; b++) {
            const int64_t k0 = b * I4_XBLOCK;
            const int64_t end = w->row_bytes - k0 < I4_XBLOCK ? w->row_bytes - k0 : I4_XBLOCK; /* 32, 64, 96, 128 */
            prefetch_ahead(row + k0, 128);
            __m256i high = _mm256_setzero_si256(), low = high;
            for (int64_t i = 0; i < end; i += 16) {
                const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + k0 + i)));
                const __m256i *h = (const __m256i *)(xp->high + k0 + i), *l = (const __m256i *)(xp->low + k0 + i);
                high = _mm256_add_epi32(high, _mm256_madd_epi16(q, _mm256_loadu_si256(h)));
                low = _mm256_add_epi32(low, _mm256_madd_epi16(q, _mm256_loadu_si256(l)));
            }
            const __m256 block = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), shift, _mm256_cvtepi32_ps(low));
            total = _mm256_fmadd_ps(block, _mm256_set1_ps(scales[xp->group_of[b]] * xp->scale[b]), total);
        }
        out[n] = (hsum(total) - zero_term(w, n, xp->xsum)) / xp->lift + (bias ? bias[n] : 0.f);
    }
}

/* out[1, n] = x[1, k] times an int8 weight's transpose (+ bias); -1 when memory ran out. */
static int matmul_int8_avx2(const weights_t *w, const float *x, const float *bias, float *out, int num_threads) {
    int8_x_t xp;
    if (int8_prepare_x(w, x, &xp) != 0) return -1;
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        int8_rows(w, n0, n1, &xp, bias, out);
    }
    free(xp.buffer);
    return 0;
}

#endif
