/* AVX2 products of GGUF block weights by 1-3 rows of x (included by gguf_matmul.h, after weight_only_avx2.h, whose
   rounding of x this shares). Widening each weight to float costs about three vector ops per 8 values: the float
   kernel read Q4_0 / Q4_K rows at 5-7 values per ns a Zen 3 thread, half of memory speed. Here x is rounded once per
   call to 24-bit fixed point (one scale per 128 values, as the int4 kernel does: float32's own precision, not
   llama.cpp's 8 bits) and split into three signed bytes, which vpmaddubsw multiplies by a block's unsigned q
   exactly: 11-12 values per ns, as fast per byte as the int4 kernel. The blocks' own scales join in: Q4_0 .. Q5_1's
   d in float, two blocks per register; the K-quants' 6-bit (Q6_K: 8-bit) sub-block scales in the integer sums
   through vpmaddwd, converted once per 128 values. Q4_0 and Q5_0's offsets (-8, -16) come off the integer sums
   exactly; the mins (Q4_1's m, Q4_K's dmin * mn) and Q6_K's -32 meet x summed per 32 (16) values. */
#ifndef STRATA_GGUF_DOT_AVX2_H
#define STRATA_GGUF_DOT_AVX2_H
#include <immintrin.h>

/* Up to how many rows of x these kernels, once a row, beat the float ones, which widen each weight once for all rows,
   depends on the CPU: one Zen 3 core, [256 x 4096]: Q4_K 236 against 281 us at 2 rows, 226 against 326 at 3, 309
   against 254 at 4; on Zen 4 the AVX-512 float kernel wins from 2 rows. FIXED_POINT_ROWS is the guess until
   strata/layers/quantization/kernel_choice.py sets each kind's measured crossover (set_fixed_point_rows). */
#ifndef FIXED_POINT_ROWS
#define FIXED_POINT_ROWS (STRATA_AVX512BW ? 1 : 3)
#endif
#define FIXED_POINT_MAX_ROWS 8

/* How x's digits are ordered for the kernels that read them: in order (Q6_K); `paired`, each 64 values as
   the legacy kinds' two blocks come out of one AVX2 register (values 16-31 and 32-47 trade places, as
   int4_position); `quad`, each 128 values as four blocks come out of one AVX-512 register (gguf_dot_vnni.h): values
   0-15 of the four blocks, then their values 16-31; `k-quad`, each 128 values as a Q4_K / Q5_K block's 64 bytes of
   nibbles come out of two AVX-512 registers (gguf_dot_vnni.h): values 0-31, 64-95, then 32-63, 96-127. */
enum { X_IN_ORDER, X_PAIRED, X_QUAD, X_KQUAD };

/* Where the 16 values from h (a multiple of 16) go in a layout. */
static inline int64_t x_position(int64_t h, int layout) {
    if (layout == X_PAIRED) return h / I4_CHUNK * I4_CHUNK + int4_position(h % I4_CHUNK);
    if (layout == X_QUAD) return h / 128 * 128 + (h % 32) / 16 * 64 + (h % 128) / 32 * 16;
    if (layout == X_KQUAD) return h / 128 * 128 + (h % 64) / 32 * 64 + (h % 128) / 64 * 32 + h % 32;
    return h;
}

/* x prepared for one row of weights, its digits in one of the layouts above. */
typedef struct {
    float *buffer;     /* the one allocation: x padded with zeros to whole 128-value blocks, then the rest */
    int8_t *digits[I4_DIGITS]; /* x / scale = 65536 digits[0] + 256 digits[1] + digits[2], each [padded K] */
    float *scale;      /* [padded K / 128] of x times `lift` */
    float *sum16;      /* [padded K / 16]: the rounded x summed per 16 values, times its scale */
    float *sum32;      /* [padded K / 32] */
    int32_t *lanes;    /* [padded K / 8], paired or quad x: the rounded x summed over the 8 values each int32
                          lane of a chunk's products takes (4 from either register), for Q4_0 and Q5_0's exact
                          offsets */
    float lift;        /* 2^64 for a row of tiny values (its scales would underflow), else 1 */
} gguf_x_t;

/* One 128-value block b of x rounded into p. */
static void gguf_round_block(const float *row, int64_t b, float extent, int layout, gguf_x_t *p) {
    const x_rounding_t rounding = x_rounding(extent, p->lift);
    const float scale = p->scale[b] = rounding.scale;
    for (int64_t h = b * I4_XBLOCK; h < (b + 1) * I4_XBLOCK; h += 16) {
        __m256i v[2], digits[2][I4_DIGITS];
        for (int j = 0; j < 2; j++) {
            v[j] = x_round8(row + h + 8 * j, &rounding);
            split_digits(v[j], digits[j]);
        }
        const int64_t at = x_position(h, layout);
        for (int d = 0; d < I4_DIGITS; d++) store_bytes16(digits[0][d], digits[1][d], p->digits[d] + at);
        p->sum16[h / 16] = scale * (float)hsum_epi32(_mm256_add_epi32(v[0], v[1]));
        if (layout == X_PAIRED || layout == X_QUAD) { /* position o feeds lane (o % 32) / 4 (quad: (o % 64) / 4) */
            int32_t values[16];
            _mm256_storeu_si256((__m256i *)values, v[0]);
            _mm256_storeu_si256((__m256i *)(values + 8), v[1]);
            int32_t *lanes = layout == X_PAIRED ? p->lanes + at / I4_CHUNK * 8 + at % 32 / 4
                                                : p->lanes + at / 128 * 16 + at % 64 / 4;
            for (int i = 0; i < 16; i++) lanes[i / 4] += values[i];
        }
        if (h % 32) p->sum32[h / 32] = p->sum16[h / 16 - 1] + p->sum16[h / 16];
    }
}

/* Round one row of x (k values) to the prepared form; -1 when memory ran out. */
static int gguf_prepare_x(const float *x, int64_t k, int layout, gguf_x_t *p) {
    const int64_t xblocks = (k + I4_XBLOCK - 1) / I4_XBLOCK, padded = xblocks * I4_XBLOCK;
    const size_t floats = (size_t)(padded + xblocks + padded / 16 + padded / 32 + padded / 8);
    float *f = aligned_alloc(64, (floats * sizeof(float) + I4_DIGITS * (size_t)padded + 63) / 64 * 64);
    if (!f) return -1;
    memcpy(f, x, (size_t)k * sizeof(float));
    memset(f + k, 0, (size_t)(padded - k) * sizeof(float));
    p->buffer = f;
    p->scale = f + padded;
    p->sum16 = p->scale + xblocks;
    p->sum32 = p->sum16 + padded / 16;
    p->lanes = (int32_t *)(p->sum32 + padded / 32);
    memset(p->lanes, 0, (size_t)(padded / 8) * sizeof(int32_t));
    for (int d = 0; d < I4_DIGITS; d++) p->digits[d] = (int8_t *)(f + floats) + d * padded;
    p->lift = x_extents(f, xblocks, padded, p->scale); /* the extents wait in p->scale until the lift is known */
    for (int64_t b = 0; b < xblocks; b++) gguf_round_block(f, b, p->scale[b], layout, p);
    return 0;
}

/* The products of 32 unsigned bytes q (each at most 63) with the three digits at x: int16 pairs, exact
   (at most 2 * 63 * 128). */
static inline void digit_products(__m256i q, const gguf_x_t *xp, int64_t at, __m256i p[I4_DIGITS]) {
    for (int d = 0; d < I4_DIGITS; d++)
        p[d] = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(xp->digits[d] + at)));
}

/* Three digits' int32 sums as one float sum: 65536 high + 256 middle + low (one rounding per conversion). */
static inline __m256 join_digits(const __m256i acc[I4_DIGITS]) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[0]), _mm256_set1_ps(65536.f),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[1]), _mm256_set1_ps(256.f),
                                           _mm256_cvtepi32_ps(acc[2])));
}

/* The fifth bits of two blocks (their 32-bit qh in the low 32 bits of each 128-bit lane) as bytes, 0x10 where the
   bit is set: values 0-15 of both blocks (`upper` 0) or values 16-31 (`upper` 1), each lane a block's. */
static inline __m256i fifth_bits(__m256i qh, int upper) {
    const long long first = upper ? 0x0202020202020202LL : 0;
    const long long second = upper ? 0x0303030303030303LL : 0x0101010101010101LL;
    const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_set_epi64x(second, first, second, first));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

static inline uint16_t half_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

/* The halves at a and b (b NULL: 0) as float32 lanes 0 and 1. */
static inline __m128 two_halves(const uint8_t *a, const uint8_t *b) {
#if STRATA_F16C
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)(half_bits(a) | (b ? (uint32_t)half_bits(b) << 16 : 0))));
#else
    return _mm_setr_ps(f16_to_f32(half_bits(a)), b ? f16_to_f32(half_bits(b)) : 0.f, 0.f, 0.f);
#endif
}

/* Q4_0, Q4_1, Q5_0, Q5_1, blocks b and b + 1 (`one`: b alone, the row's last) against the paired x: the products'
   int32 lanes 0-3 are block b's, 4-7 block b + 1's, each scaled by its d; Q4_1 and Q5_1's mins times the x sums
   join `offsets` (lanes 0 and 1). */
static inline __attribute__((always_inline)) __m256 legacy_pair(const uint8_t *block, int64_t b, int one,
                                                               const gguf_x_t *xp, const int KIND, __m256 total,
                                                               __m128 *offsets) {
    const int with_min = KIND == KIND_Q4_1 || KIND == KIND_Q5_1, five = KIND == KIND_Q5_0 || KIND == KIND_Q5_1;
    const int64_t bytes = gguf_block_bytes(KIND), qs = (with_min ? 4 : 2) + (five ? 4 : 0);
    const uint8_t *next = block + bytes;
    const __m128i first = _mm_loadu_si128((const __m128i *)(block + qs));
    const __m256i q = one ? _mm256_zextsi128_si256(first)
                          : _mm256_inserti128_si256(_mm256_castsi128_si256(first),
                                                    _mm_loadu_si128((const __m128i *)(next + qs)), 1);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i low = _mm256_and_si256(q, nibble), high = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
    if (five) {
        uint32_t h0, h1 = 0;
        memcpy(&h0, block + qs - 4, sizeof h0);
        if (!one) memcpy(&h1, next + qs - 4, sizeof h1);
        const __m256i qh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128((int)h0)),
                                                   _mm_cvtsi32_si128((int)h1), 1);
        low = _mm256_or_si256(low, fifth_bits(qh, 0));
        high = _mm256_or_si256(high, fifth_bits(qh, 1));
    }
    const int64_t at = b / 2 * I4_CHUNK;
    __m256i p[2][I4_DIGITS], acc[I4_DIGITS];
    digit_products(low, xp, at, p[0]);
    digit_products(high, xp, at + 32, p[1]);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int d = 0; d < I4_DIGITS; d++) acc[d] = _mm256_madd_epi16(_mm256_add_epi16(p[0][d], p[1][d]), ones);
    /* joined in int32: a lane sums 8 products of q (at most 31) and x (at most 2^23): Q4_0 and Q5_0 take away
       8 or 16 times the lane's x exactly, so q - offset times x stays within 2^31 */
    __m256i joined = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(_mm256_slli_epi32(acc[0], 8), acc[1]), 8),
                                      acc[2]);
    const __m128 d = two_halves(block, one ? NULL : next);
    if (with_min) {
        const __m128 sums = _mm_castpd_ps(_mm_load_sd((const double *)(xp->sum32 + b))); /* b is even */
        *offsets = _mm_fmadd_ps(two_halves(block + 2, one ? NULL : next + 2), sums, *offsets);
    } else {
        const __m256i lanes = _mm256_loadu_si256((const __m256i *)(xp->lanes + b / 2 * 8));
        joined = _mm256_sub_epi32(joined, _mm256_slli_epi32(lanes, five ? 4 : 3));
    }
    const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(xp->scale[b / 4]))),
                                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), scale, total);
}

static inline __attribute__((always_inline)) float legacy_row(const uint8_t *row, int64_t blocks, const gguf_x_t *xp,
                                                              const int KIND) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m256 total = _mm256_setzero_ps();
    __m128 offsets = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const uint8_t *block = row + b * bytes;
        __builtin_prefetch(block + 2 * bytes + PREFETCH_BYTES, 0, 3); /* at least once a line: pairs span < 64 */
        total = legacy_pair(block, b, 0, xp, KIND, total, &offsets);
    }
    if (b < blocks) total = legacy_pair(row + b * bytes, b, 1, xp, KIND, total, &offsets);
    return hsum(total) + _mm_cvtss_f32(_mm_add_ss(offsets, _mm_movehdup_ps(offsets))); /* the mins' part */
}

/* A K-quant block's 8 scales and 8 mins (Q4_K, Q5_K: 6 bits each, unpacked four at a time from 32-bit words), as
   bytes sc[0..7], mn[0..7] of one register. */
static inline __m128i k_scales_mins(const uint8_t *s) {
    uint32_t w[3];
    memcpy(w, s, sizeof w);
    const uint32_t low6 = 0x3f3f3f3f, nibbles = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc_lo = w[0] & low6, mn_lo = w[1] & low6;
    const uint32_t sc_hi = (w[2] & nibbles) | (((w[0] >> 6) & top2) << 4);
    const uint32_t mn_hi = ((w[2] >> 4) & nibbles) | (((w[1] >> 6) & top2) << 4);
    return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi);
}

/* Bit j of each byte as its bit 4 (0x10), the rest cleared. */
static inline __m256i fifth_bit(__m256i bits, int j) {
    const __m256i moved = j <= 4 ? _mm256_sll_epi16(bits, _mm_cvtsi32_si128(4 - j))
                                 : _mm256_srl_epi16(bits, _mm_cvtsi32_si128(j - 4));
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

/* The vpshufb index that spreads word j of a 128-bit lane over the low lane and word j + 1 over the high lane (of a
   register whose two lanes hold the same 8 words). */
static inline __m256i word_pair(int j) {
    const __m256i first = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_add_epi8(first, _mm256_set1_epi8((char)(2 * j)));
}

/* A Q4_K / Q5_K block's mins (dmin * mn per 32-value sub-block, from its unpacked scales and mins) times x's sums
   per 32 (block s), into `mins`: the part of the product its offsets make. */
static inline void k_block_mins(const uint8_t *block, __m128i packed, int64_t s, const gguf_x_t *xp, __m256 *mins) {
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
    *mins = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(half_at(block + 2))),
                            _mm256_loadu_ps(xp->sum32 + 8 * s), *mins);
}

/* A Q6_K block's (block sb) int8 sub-block scales times d times x's sums per 16, into `offsets`: the -32 offset's
   part of the product, once times 32. */
static inline void q6k_block_offsets(const uint8_t *block, int64_t sb, const gguf_x_t *xp, __m256 *offsets) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(block + 192));
    const __m256 sc_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
    const __m256 sc_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
    const __m256 weighted = _mm256_fmadd_ps(sc_hi, _mm256_loadu_ps(xp->sum16 + 16 * sb + 8),
                                            _mm256_mul_ps(sc_lo, _mm256_loadu_ps(xp->sum16 + 16 * sb)));
    *offsets = _mm256_fmadd_ps(weighted, _mm256_set1_ps(half_at(block + 208)), *offsets);
}

/* Q4_K / Q5_K, one block against the paired x. 32 bytes of qs hold sub-block 2i in their low nibbles and 2i + 1 in
   their high ones; their 128-bit halves rearranged, one register takes values 0-15 of both and the other values
   16-31, so the products of the two add in int16 with each half a sub-block's, and one vpmaddwd applies both
   scales. Per 128 values each digit's int32 sums are joined, then scaled by d. The mins (dmin * mn per sub-block)
   meet the x sums per 32 in `mins`. */
static inline __attribute__((always_inline)) __m256 q45k_block(const uint8_t *block, int64_t s, const gguf_x_t *xp,
                                                              const int KIND, __m256 total, __m256 *mins) {
    const __m128i packed = k_scales_mins(block + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
    k_block_mins(block, packed, s, xp, mins);
    const uint8_t *qs = block + (KIND == KIND_Q5_K ? 48 : 16);
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i qh = KIND == KIND_Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16)) : _mm256_setzero_si256();
    const float d = half_at(block);
    #pragma GCC unroll 4
    for (int half = 0; half < 2; half++) {
        __m256i acc[I4_DIGITS] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        #pragma GCC unroll 4
        for (int i = 2 * half; i < 2 * half + 2; i++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            if (KIND == KIND_Q5_K) { /* bits 2i and 2i + 1 of qh[l] */
                low = _mm256_or_si256(low, fifth_bit(qh, 2 * i));
                high = _mm256_or_si256(high, fifth_bit(qh, 2 * i + 1));
            }
            __m256i p[2][I4_DIGITS];
            digit_products(_mm256_permute2x128_si256(low, high, 0x20), xp,
                           s * QK_K + 64 * i, p[0]);
            digit_products(_mm256_permute2x128_si256(low, high, 0x31), xp,
                           s * QK_K + 64 * i + 32, p[1]);
            const __m256i scale = _mm256_shuffle_epi8(scales, word_pair(2 * i));
            for (int dd = 0; dd < I4_DIGITS; dd++)
                acc[dd] = _mm256_add_epi32(acc[dd], _mm256_madd_epi16(_mm256_add_epi16(p[0][dd], p[1][dd]), scale));
        }
        total = _mm256_fmadd_ps(join_digits(acc), _mm256_set1_ps(d * xp->scale[2 * s + half]), total);
    }
    return total;
}

/* Q6_K, one block against the in-order x: run s of each 128-value half takes a nibble of ql and two bits of qh
   (gguf_blocks.h); its 16-value sub-blocks' int8 scales join the int32 sums (vpmaddwd), the -32 offset meets the
   x sums per 16 in `offsets`. */
static inline __attribute__((always_inline)) __m256 q6k_block(const uint8_t *block, int64_t sb, const gguf_x_t *xp,
                                                             __m256 total, __m256 *offsets) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(block + 192));
    const float d = half_at(block + 208);
    q6k_block_offsets(block, sb, xp, offsets);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8); /* sc0..7 | sc8..15 */
    const __m256i nibble = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(0x30);
    #pragma GCC unroll 4
    for (int h = 0; h < 2; h++) {
        const __m256i scales = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                 : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        __m256i acc[I4_DIGITS] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        #pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * (s & 1)));
            const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), nibble);
            const __m256i top = _mm256_and_si256(s == 0 ? _mm256_slli_epi16(qh, 4) : s == 1 ? _mm256_slli_epi16(qh, 2)
                                                 : s == 2 ? qh : _mm256_srli_epi16(qh, 2), two_bits);
            __m256i p[I4_DIGITS];
            digit_products(_mm256_or_si256(low, top), xp,
                           sb * QK_K + 128 * h + 32 * s, p);
            /* the low 16 values take scale 2s, the high 16 scale 2s + 1 (of this half's 8) */
            const __m256i scale = _mm256_shuffle_epi8(scales, word_pair(2 * s));
            for (int dd = 0; dd < I4_DIGITS; dd++) acc[dd] = _mm256_add_epi32(acc[dd], _mm256_madd_epi16(p[dd], scale));
        }
        total = _mm256_fmadd_ps(join_digits(acc), _mm256_set1_ps(d * xp->scale[2 * sb + h]), total);
    }
    return total;
}

static inline __attribute__((always_inline)) float kquant_row(const uint8_t *row, int64_t blocks, const gguf_x_t *xp,
                                                              const int KIND) {
    const int64_t bytes = gguf_block_bytes(KIND);
    __m256 total = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t s = 0; s < blocks; s++) {
        const uint8_t *block = row + s * bytes;
        prefetch_ahead(block, bytes);
        total = KIND == KIND_Q6_K ? q6k_block(block, s, xp, total, &offsets)
                                  : q45k_block(block, s, xp, KIND, total, &offsets);
    }
    return hsum(total) - (KIND == KIND_Q6_K ? 32.f : 1.f) * hsum(offsets);
}

/* Whether these kernels serve a GGUF kind. */
static inline int gguf_has_fixed_point(int kind) {
    switch (kind) {
    case KIND_Q4_0: case KIND_Q4_1: case KIND_Q5_0: case KIND_Q5_1: case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K:
        return 1;
    default: return 0;
    }
}

/* Per kind (KIND_GGUF + ggml's type, ggml's types below 32), the rows of x up to which these kernels run: written
   only by set_fixed_point_rows, once a process, before the kind's first product (a calibration's result); -1: not
   set, FIXED_POINT_ROWS. */
static int64_t fixed_point_rows_of[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

/* Rows of x up to which these kernels beat the float ones (gguf_matmul.h) on a kind, 0 for the kinds they do not
   serve. */
static inline int64_t gguf_fixed_point_rows(int kind) {
    if (!gguf_has_fixed_point(kind)) return 0;
    const int64_t rows = fixed_point_rows_of[kind - KIND_GGUF];
    return rows < 0 ? FIXED_POINT_ROWS : rows;
}

#if STRATA_AVX512VNNI
#include "gguf_dot_vnni.h"
#define LEGACY_ROW legacy_row_vnni
#define LEGACY_LAYOUT X_QUAD
#define KQUANT_ROW kquant_row_vnni
#define KQUANT_LAYOUT X_KQUAD
#else
#define LEGACY_ROW legacy_row
#define LEGACY_LAYOUT X_PAIRED
#define KQUANT_ROW kquant_row
#define KQUANT_LAYOUT X_PAIRED
#endif

#define DEFINE_FIXED_ROWS(KIND, ROW)                                                                              \
    static void fixed_rows_##KIND(const weights_t *w, int64_t n0, int64_t n1, const gguf_x_t *xp,              \
                                  const float *bias, float *out) {                                            \
        const int64_t blocks = w->k / gguf_block_values(KIND);                                                 \
        for (int64_t n = n0; n < n1; n++)                                                                      \
            out[n] = ROW(w->data + n * w->row_bytes, blocks, xp, KIND) / xp->lift + (bias ? bias[n] : 0.f);    \
    }
DEFINE_FIXED_ROWS(KIND_Q4_0, LEGACY_ROW)
DEFINE_FIXED_ROWS(KIND_Q4_1, LEGACY_ROW)
DEFINE_FIXED_ROWS(KIND_Q5_0, LEGACY_ROW)
DEFINE_FIXED_ROWS(KIND_Q5_1, LEGACY_ROW)
DEFINE_FIXED_ROWS(KIND_Q4_K, KQUANT_ROW)
DEFINE_FIXED_ROWS(KIND_Q5_K, KQUANT_ROW)
DEFINE_FIXED_ROWS(KIND_Q6_K, KQUANT_ROW)

typedef void (*fixed_rows_fn)(const weights_t *, int64_t, int64_t, const gguf_x_t *, const float *, float *);

/* out[m_total, n] = x[m_total, k] times a GGUF weight's transpose (+ bias) for the kinds above, each row of x
   prepared once; a task's weight rows, read from memory for the first row of x, stay in cache for the others.
   -1 when memory ran out. */
static int gguf_matmul_fixed_point(const weights_t *w, const float *x, int64_t m_total, const float *bias,
                                   float *out, int num_threads) {
    const int legacy = w->kind == KIND_Q4_0 || w->kind == KIND_Q4_1 || w->kind == KIND_Q5_0 || w->kind == KIND_Q5_1;
    const int layout = w->kind == KIND_Q6_K ? X_IN_ORDER : legacy ? LEGACY_LAYOUT : KQUANT_LAYOUT;
    gguf_x_t *xp = calloc((size_t)m_total, sizeof(gguf_x_t));
    int failed = !xp;
    for (int64_t m = 0; m < m_total && !failed; m++)
        failed = gguf_prepare_x(x + m * w->k, w->k, layout, xp + m) != 0;
    if (failed) {
        for (int64_t m = 0; xp && m < m_total; m++) free(xp[m].buffer);
        free(xp);
        return -1;
    }
    fixed_rows_fn rows;
    switch (w->kind) {
    case KIND_Q4_0: rows = fixed_rows_KIND_Q4_0; break;
    case KIND_Q4_1: rows = fixed_rows_KIND_Q4_1; break;
    case KIND_Q5_0: rows = fixed_rows_KIND_Q5_0; break;
    case KIND_Q5_1: rows = fixed_rows_KIND_Q5_1; break;
    case KIND_Q4_K: rows = fixed_rows_KIND_Q4_K; break;
    case KIND_Q5_K: rows = fixed_rows_KIND_Q5_K; break;
    default: rows = fixed_rows_KIND_Q6_K;
    }
    const int64_t tasks = (w->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (w->n * w->row_bytes * m_total >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < w->n ? n0 + ROWS_PER_TASK : w->n;
        for (int64_t m = 0; m < m_total; m++) rows(w, n0, n1, xp + m, bias, out + m * w->n);
    }
    for (int64_t m = 0; m < m_total; m++) free(xp[m].buffer);
    free(xp);
    return 0;
}

#endif
