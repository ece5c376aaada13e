/* AVX-512 VNNI small-batch kernels for int4 / int8 weights (included by weight_only.c after
   weight_only_avx512.h, when the compiler targets AVX-512 VNNI). x is rounded once per call to 24-bit fixed
   point, one scale per 128 values of K (at most 2^-24 of the block's largest value off: float32's own rounding),
   and split into three signed bytes; every unsigned weight byte meets each with vpdpbusd, 64 exact integer
   products per instruction, instead of being widened to float. (llama.cpp rounds x to 8 bits.) */
#ifndef STRATA_WEIGHT_ONLY_VNNI_H
#define STRATA_WEIGHT_ONLY_VNNI_H
#include <immintrin.h>

#define CHUNK 64         /* values of K one vpdpbusd covers: two 32-value blocks */
#define XBLOCK 128       /* values of K that share one scale of x */
#define X_LIMIT 8323072.f /* 127 * 65536: the high byte stays within -127..127 */
#define X_BYTES 3

/* x prepared for the weights: per row, bytes in the order a chunk of weight bytes holds them. */
typedef struct {
    int8_t *bytes[X_BYTES];    /* each [m_total, chunks * 64]: x / scale = 65536 bytes[0] + 256 bytes[1] + bytes[2] */
    float *scale;              /* [m_total, xblocks] */
    float *xsum;               /* [m_total, groups]: the rounded x summed per weight group, for the zero points */
    int32_t *group_of;         /* [2 * chunks]: the weight group of each 32-value block (no division per row) */
    int64_t chunks, xblocks;
} vnni_x_t;

/* Values of K a weight row holds (K padded to a multiple of 32). */
static inline int64_t row_values(const weights_t *w) { return w->row_bytes * (w->kind == KIND_INT4 ? 2 : 1); }

/* Byte position of value o (0..63) of a chunk. int4: a chunk's 32 bytes are two blocks of 16; the low nibbles
   come first (block 0's values 0-15, block 1's 0-15), then the high ones (values 16-31 of each), so the middle
   quarters trade places. A swap, so it also gives the value held at a position. */
static inline int64_t vnni_position(int kind, int64_t o) {
    if (kind != KIND_INT4 || o < 16 || o >= 48) return o;
    return o < 32 ? o + 16 : o - 16;
}

/* 16 values of x (masked past k) times `inverse`, rounded, into the three bytes of position `at`; returns the
   rounded integers. */
static inline __m512i vnni_round16(const float *src, int64_t left, __m512 inverse, const vnni_x_t *p,
                                   int64_t at) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask16(left), src), inverse));
    const __m512i bias = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
    const __m512i low = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, bias), byte), bias);
    const __m512i upper = _mm512_srai_epi32(_mm512_sub_epi32(v, low), 8);
    const __m512i middle = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(upper, bias), byte), bias);
    const __m512i high = _mm512_srai_epi32(_mm512_sub_epi32(upper, middle), 8);
    _mm_storeu_si128((__m128i *)(p->bytes[0] + at), _mm512_cvtepi32_epi8(high));
    _mm_storeu_si128((__m128i *)(p->bytes[1] + at), _mm512_cvtepi32_epi8(middle));
    _mm_storeu_si128((__m128i *)(p->bytes[2] + at), _mm512_cvtepi32_epi8(low));
    return v;
}

/* Round x [m_total, k] to the prepared form; returns -1 when memory ran out. One buffer holds it all. */
static int vnni_prepare_x(const weights_t *w, const float *x, int64_t m_total, vnni_x_t *p) {
    const int64_t k = w->k, stride = (row_values(w) + CHUNK - 1) / CHUNK * CHUNK;
    p->chunks = stride / CHUNK;
    p->xblocks = (stride + XBLOCK - 1) / XBLOCK;
    const size_t floats = (size_t)(m_total * (p->xblocks + w->groups) + 2 * p->chunks);
    const size_t bytes = (size_t)(m_total * stride);
    float *f = aligned_alloc(64, (floats * sizeof(float) + X_BYTES * bytes + 63) / 64 * 64);
    double *sums = calloc((size_t)w->groups, sizeof(double));
    if (!f || !sums) {
        free(f);
        free(sums);
        return -1;
    }
    p->scale = f;
    p->xsum = f + m_total * p->xblocks;
    p->group_of = (int32_t *)(p->xsum + m_total * w->groups);
    for (int64_t b = 0; b < 2 * p->chunks; b++) {
        const int64_t g = b * (CHUNK / 2) / w->group_size;
        p->group_of[b] = (int32_t)(g < w->groups ? g : w->groups - 1); /* a block past K: its products are 0 */
    }
    for (int j = 0; j < X_BYTES; j++) p->bytes[j] = (int8_t *)(f + floats) + j * bytes;
    for (int64_t m = 0; m < m_total; m++) {
        const float *row = x + m * k;
        memset(sums, 0, (size_t)w->groups * sizeof(double));
        for (int64_t b = 0; b < p->xblocks; b++) {
            const int64_t k0 = b * XBLOCK, k1 = k0 + XBLOCK < stride ? k0 + XBLOCK : stride;
            __m512 amax = _mm512_setzero_ps(), finite = _mm512_setzero_ps(); /* x * 0: NaN where x is not finite */
            for (int64_t i = k0; i < k1; i += 16) {
                const __m512 values = _mm512_maskz_loadu_ps(tail_mask16(k - i), row + i);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(values));
                finite = _mm512_add_ps(finite, _mm512_mul_ps(values, _mm512_setzero_ps()));
            }
            /* a NaN or infinity in x makes the block's scale NaN, so the outputs it reaches are NaN, as in float */
            const float largest = _mm512_reduce_max_ps(amax);
            const float scale = largest / X_LIMIT + _mm512_reduce_add_ps(finite);
            const __m512 inverse = _mm512_set1_ps(largest > 0.f ? X_LIMIT / largest : 0.f);
            p->scale[m * p->xblocks + b] = scale;
            for (int64_t i = k0; i < k1; i += CHUNK / 2) { /* a 32-value block lies in one weight group */
                __m512i block_sum = _mm512_setzero_si512();
                for (int64_t h = i; h < i + CHUNK / 2; h += 16) {
                    const int64_t at = m * stride + h / CHUNK * CHUNK + vnni_position(w->kind, h % CHUNK);
                    block_sum = _mm512_add_epi32(block_sum, vnni_round16(row + h, k - h, inverse, p, at));
                }
                sums[p->group_of[i / (CHUNK / 2)]] += (double)scale * _mm512_reduce_add_epi32(block_sum);
            }
        }
        for (int64_t g = 0; g < w->groups; g++) p->xsum[m * w->groups + g] = (float)sums[g];
    }
    free(sums);
    return 0;
}

/* Chunk c of a row as 64 unsigned bytes in position order; the last chunk of a K that ends half way through
   one holds zeros past it (and reads nothing past the row). */
static inline __attribute__((always_inline)) __m512i vnni_chunk(const int KIND, const uint8_t *row, int64_t c,
                                                                int half) {
    if (KIND == KIND_INT8) {
        const uint8_t *p = row + c * CHUNK;
        return half ? _mm512_maskz_loadu_epi8(0xffffffffull, p) : _mm512_loadu_si512(p);
    }
    const uint8_t *p = row + c * (CHUNK / 2);
    const __m256i bytes = half ? _mm512_castsi512_si256(_mm512_maskz_loadu_epi8(0xffff, p))
                               : _mm256_loadu_si256((const __m256i *)p);
    const __m512i both = _mm512_broadcast_i64x4(bytes); /* low nibbles from the lower half, high from the upper */
    return _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xffff0000u, both, 4), _mm512_set1_epi8(15));
}

/* Rows n0..n1 of the weight against MC rows of prepared x, into out (+ bias). Products gather exactly in int32
   over a segment of SEG chunks (two when every group and x block spans them both), then join the float total at
   the segment's scale: the group's weight scale times the x block's, or, when a chunk holds two groups, a
   lane-by-lane mix of both. The zero points' term joins the total before its one reduction. */
static inline __attribute__((always_inline)) void vnni_rows(const weights_t *w, int64_t n0, int64_t n1,
                                                            const vnni_x_t *xp, const int KIND, const int MC,
                                                            const int SEG, const float *bias, float *out) {
    const int64_t chunks = xp->chunks, stride = chunks * CHUNK;
    const int64_t half_chunk = row_values(w) % CHUNK ? chunks - 1 : -1;
    const int mixed = SEG == 1 && w->groups > 1 && w->group_size % CHUNK != 0;
    const __mmask16 second_block = KIND == KIND_INT4 ? 0xf0f0 : 0xff00; /* lanes summing the chunk's block 2 */
    const float zero = KIND == KIND_INT4 ? 8.f : 128.f;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w->data + n * w->row_bytes;
        const float *scales = w->scales + n * w->groups;
        __m512 total[MAX_MC512];
        for (int m = 0; m < MC; m++) total[m] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c += SEG) {
            __m512i acc[MAX_MC512][X_BYTES];
            for (int m = 0; m < MC; m++)
                for (int j = 0; j < X_BYTES; j++) acc[m][j] = _mm512_setzero_si512();
            for (int64_t cc = c; cc < c + SEG && cc < chunks; cc++) {
                const uint8_t *bytes = row + cc * (KIND == KIND_INT4 ? CHUNK / 2 : CHUNK);
                if (KIND == KIND_INT8 || !(cc & 1)) prefetch_ahead(bytes, 64); /* once per line */
                const __m512i v = vnni_chunk(KIND, row, cc, cc == half_chunk);
                for (int m = 0; m < MC; m++)
                    for (int j = 0; j < X_BYTES; j++)
                        acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], v,
                                                        _mm512_loadu_si512(xp->bytes[j] + m * stride + cc * CHUNK));
            }
            const int32_t g0 = xp->group_of[2 * c];
            const __m512 ws = mixed ? _mm512_mask_blend_ps(second_block, _mm512_set1_ps(scales[g0]),
                                                           _mm512_set1_ps(scales[xp->group_of[2 * c + 1]]))
                                    : _mm512_set1_ps(scales[g0]);
            const int64_t b = c * CHUNK / XBLOCK;
            for (int m = 0; m < MC; m++) {
                /* each byte's sum is exact in float (under 2^24); 65536 * high would overflow int32 */
                const __m512 products = _mm512_fmadd_ps(
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), _mm512_set1_ps(256.f),
                                    _mm512_cvtepi32_ps(acc[m][1])),
                    _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(acc[m][2]));
                const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(xp->scale[m * xp->xblocks + b]));
                total[m] = _mm512_fmadd_ps(products, scale, total[m]);
            }
        }
        const float *zeros = w->zeros ? w->zeros + n * w->groups : NULL;
        for (int m = 0; m < MC; m++) {
            const __m512 terms = zero_terms(scales, zeros, zero, xp->xsum + m * w->groups, w->groups, 0.f);
            out[m * w->n + n] = _mm512_reduce_add_ps(_mm512_sub_ps(total[m], terms)) + (bias ? bias[n] : 0.f);
        }
    }
}

typedef void (*vnni_fn)(const weights_t *, int64_t, int64_t, const vnni_x_t *, const float *, float *);
#define DEFINE_VNNI(KIND, MC, SEG)                                                                             \
    static void vnni_##KIND##_##MC##_##SEG(const weights_t *w, int64_t n0, int64_t n1, const vnni_x_t *xp,       \
                                           const float *bias, float *out) {                                      \
        vnni_rows(w, n0, n1, xp, KIND, MC, SEG, bias, out);                                                      \
    }
#define DEFINE_VNNI_KIND(KIND)                                                                                   \
    DEFINE_VNNI(KIND, 1, 1) DEFINE_VNNI(KIND, 2, 1) DEFINE_VNNI(KIND, 4, 1)                                     \
    DEFINE_VNNI(KIND, 1, 2) DEFINE_VNNI(KIND, 2, 2) DEFINE_VNNI(KIND, 4, 2)
DEFINE_VNNI_KIND(KIND_INT4)
DEFINE_VNNI_KIND(KIND_INT8)
#define VNNI_MC(KIND, MC, SEG)                                                                                   \
    ((MC) == 4 ? vnni_##KIND##_4_##SEG : (MC) == 2 ? vnni_##KIND##_2_##SEG : vnni_##KIND##_1_##SEG)
#define VNNI_OF(KIND, MC, SEG) ((SEG) == 2 ? VNNI_MC(KIND, MC, 2) : VNNI_MC(KIND, MC, 1))

static int matmul_vnni(const weights_t *w, const float *x, int64_t m_total, const float *bias, float *out,
                       int num_threads) {
    vnni_x_t xp;
    if (vnni_prepare_x(w, x, m_total, &xp) != 0) return -1;
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int segment = w->groups == 1 || w->group_size % XBLOCK == 0 ? XBLOCK / CHUNK : 1;
    /* A small weight is read faster by one thread than the fork of a second costs. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        for (int64_t m0 = 0; m0 < m_total;) {
            const int64_t left = m_total - m0;
            /* at most 4 rows a pass: 8 kept 32 sums (8 x 3 bytes, 8 totals) and spilled them (8 rows 36 ms
               against 24 in passes of 4, Llama 250M's int4 linears on two Xeon cores) */
            const int mc = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const vnni_fn kernel = w->kind == KIND_INT4 ? VNNI_OF(KIND_INT4, mc, segment)
                                                        : VNNI_OF(KIND_INT8, mc, segment);
            const int64_t skip = m0 * xp.chunks * CHUNK;
            const vnni_x_t rows = {{xp.bytes[0] + skip, xp.bytes[1] + skip, xp.bytes[2] + skip},
                                   xp.scale + m0 * xp.xblocks, xp.xsum + m0 * w->groups, xp.group_of, xp.chunks,
                                   xp.xblocks};
            kernel(w, n0, n1, &rows, bias, out + m0 * w->n);
            m0 += mc;
        }
    }
    free(xp.scale);
    return 0;
}

#endif
