/* Large-batch products (prefill, batched decode) straight from weights narrower than float32: bfloat16, int8, int4
   and FP8 in strata's layouts (weight_values.h). A GEMM in the manner of BLIS: a task (128 outputs) widens the next
   256 values of K of its outputs into float32 once, as panels of 16 outputs in cache, and a 6 x 16 register-blocked
   kernel multiplies every row of x by them (gemm_panels.h packs both), so the widening costs one pass over the
   weight per product (the tiles this replaced were dequantized, then repacked by oneDNN, on every call). Built on
   first use by kernels/cpu/build.py; AVX2/FMA, plain C otherwise; on CPUs with AMX, gemm_amx.h's tiles for the kinds
   they read, where measured faster (set_gemm_engine). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "gguf_blocks.h"
#include "isa.h"
#include "weight_values.h"

#define KC 256  /* values of K in one panel: a strip of 16 outputs is 16 KiB, in L1 (AVX-512: a pair of them, 32 KiB:
                   measured no slower than 128, which doubles the passes over the output) */
#define NR 16   /* outputs of one kernel call: two registers */
#define MR 6    /* rows of x of one kernel call: 12 accumulators */
#define MC 96   /* rows of x per pass over a panel: 96 KiB of x, in L2 */
#define NC 128  /* outputs of one task: a 128 KiB panel, in L2 */

#include "gemm_amx.h"

/* Which engine each kind's products take (indexed by kind, GGUF kinds included): FMA until kernel_choice.py has
   measured AMX faster on this machine. */
static int engine_of[KIND_GGUF + 32];

#include "gemm_panels.h"

#if STRATA_AVX2
/* The rows of an output tile the kernel adds its sums to at the end, asked for at its start: waiting on those loads
   took a tenth of the kernel's time (the first and last of a row's `width` floats, so both lines of an unaligned
   row come). */
static inline __attribute__((always_inline)) void prefetch_tile(const float *c, int64_t ldc, const int mr,
                                                                const int width) {
    for (int m = 0; m < mr; m++) {
        _mm_prefetch((const char *)(c + m * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + m * ldc + width - 1), _MM_HINT_T0);
        if (width > 16) _mm_prefetch((const char *)(c + m * ldc + 16), _MM_HINT_T0);
    }
}
#endif

/* c[mr][16] (+)= a [kc][6] (the first mr of each 6) times panel [kc][16]; `valid` of the 16 columns are stored. */
static inline __attribute__((always_inline)) void kernel(const float *a, const float *panel, int64_t kc,
                                                         float *c, int64_t ldc, const int mr, int accumulate,
                                                         int valid, const float *bias) {
#if STRATA_AVX2
    if (accumulate) prefetch_tile(c, ldc, mr, NR);
    /* Twelve named accumulators: an array of them, indexed in loops, was kept on the stack (3x slower). */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define STEP(i)                                                  \
    if (mr > i) {                                                \
        const __m256 x = _mm256_broadcast_ss(a + k * MR + i);    \
        c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0);               \
        c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);               \
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + k * NR), b1 = _mm256_loadu_ps(panel + k * NR + 8);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
#undef STEP
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    if (valid == NR) { /* straight from the registers */
        const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++) {
            float *row = c + m * ldc;
            __m256 y0 = _mm256_add_ps(acc[m][0], bias0), y1 = _mm256_add_ps(acc[m][1], bias1);
            if (accumulate) {
                y0 = _mm256_add_ps(_mm256_loadu_ps(row), y0);
                y1 = _mm256_add_ps(_mm256_loadu_ps(row + 8), y1);
            }
            _mm256_storeu_ps(row, y0);
            _mm256_storeu_ps(row + 8, y1);
        }
        return;
    }
    float tile[MR][NR];
    for (int m = 0; m < mr; m++) {
        _mm256_storeu_ps(tile[m], acc[m][0]);
        _mm256_storeu_ps(tile[m] + 8, acc[m][1]);
    }
#else
    float tile[MR][NR] = {{0.f}};
    for (int64_t k = 0; k < kc; k++)
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < NR; j++) tile[m][j] += a[k * MR + m] * panel[k * NR + j];
#endif
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < valid; j++)
            c[m * ldc + j] = (accumulate ? c[m * ldc + j] : 0.f) + (tile[m][j] + (bias ? bias[j] : 0.f));
}

#if !STRATA_AVX512F
#define DEFINE_KERNEL(MRC)                                                                                      \
    static void kernel_##MRC(const float *a, const float *panel, int64_t kc, float *c, int64_t ldc,             \
                             int accumulate, int valid, const float *bias) {                                    \
        kernel(a, panel, kc, c, ldc, MRC, accumulate, valid, bias);                                             \
    }
DEFINE_KERNEL(1)
DEFINE_KERNEL(2)
DEFINE_KERNEL(3)
DEFINE_KERNEL(4)
DEFINE_KERNEL(5)
DEFINE_KERNEL(6)
typedef void (*kernel_fn)(const float *, const float *, int64_t, float *, int64_t, int, int, const float *);
static const kernel_fn KERNELS[MR + 1] = {NULL, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6};
#endif

#if STRATA_AVX512F
/* c[mr][32] (+)= a [kc][6] times two strips [kc][16] side by side, the second KC * 16 floats after the first
   (`valid0` / `valid1` of their 16 columns stored; `two` 0: the first strip alone, 6 accumulators). One zmm holds
   a strip's row, so per value of K two loads and six broadcasts feed twelve FMAs, half the loads and broadcasts
   per FMA of the ymm kernel; each output's sums come in the same order as there. Partial strips are masked loads
   and stores. */
static inline __attribute__((always_inline)) void kernel512(const float *a, const float *panel0, const int two,
                                                            int64_t kc, float *c, int64_t ldc, const int mr,
                                                            int accumulate, int valid0, int valid1,
                                                            const float *bias) {
    const float *panel1 = panel0 + KC * NR;
    if (accumulate) prefetch_tile(c, ldc, mr, two ? 2 * NR : NR);
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define STEP(i)                                                  \
    if (mr > i) {                                                \
        const __m512 x = _mm512_set1_ps(a[k * MR + i]);          \
        c##i##0 = _mm512_fmadd_ps(x, b0, c##i##0);               \
        if (two) c##i##1 = _mm512_fmadd_ps(x, b1, c##i##1);      \
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(panel0 + k * NR), b1 = two ? _mm512_loadu_ps(panel1 + k * NR) : b0;
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
    }
#undef STEP
    const __m512 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    const __mmask16 mask[2] = {(__mmask16)((1u << valid0) - 1), (__mmask16)((1u << valid1) - 1)};
    for (int h = 0; h < 1 + two; h++) {
        const __m512 add = bias ? _mm512_maskz_loadu_ps(mask[h], bias + NR * h) : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++) {
            float *row = c + m * ldc + NR * h;
            __m512 y = _mm512_add_ps(acc[m][h], add);
            if (accumulate) y = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[h], row), y);
            _mm512_mask_storeu_ps(row, mask[h], y);
        }
    }
}

#define DEFINE_KERNEL512(MRC)                                                                                   \
    static void kernel512_##MRC(const float *a, const float *panel0, int two, int64_t kc, float *c,             \
                                int64_t ldc, int accumulate, int valid0, int valid1, const float *bias) {       \
        if (two) kernel512(a, panel0, 1, kc, c, ldc, MRC, accumulate, valid0, valid1, bias);                    \
        else kernel512(a, panel0, 0, kc, c, ldc, MRC, accumulate, valid0, 0, bias);                             \
    }
DEFINE_KERNEL512(1)
DEFINE_KERNEL512(2)
DEFINE_KERNEL512(3)
DEFINE_KERNEL512(4)
DEFINE_KERNEL512(5)
DEFINE_KERNEL512(6)
typedef void (*kernel512_fn)(const float *, const float *, int, int64_t, float *, int64_t, int, int, int,
                             const float *);
static const kernel512_fn KERNELS512[MR + 1] = {NULL, kernel512_1, kernel512_2, kernel512_3, kernel512_4,
                                                kernel512_5, kernel512_6};
#endif

/* Outputs n0 .. n1 of every row of x: panel by panel along K, each multiplied by all of x while in cache. */
static void task(const weights_t *w, const float *xp, int64_t m_total, int64_t n0, int64_t n1, const float *bias,
                 float *out, float *rows, float *panel) {
    const int64_t strips = (n1 - n0 + NR - 1) / NR;
    for (int64_t k0 = 0; k0 < w->k; k0 += KC) {
        const int64_t kc = w->k - k0 < KC ? w->k - k0 : KC;
        const int last = k0 + kc == w->k;
        for (int64_t s = 0; s < strips; s++) pack_strip(w, n0 + s * NR, k0, kc, rows, panel + s * KC * NR);
        for (int64_t mc = 0; mc < m_total; mc += MC) {
            const int64_t mc_end = mc + MC < m_total ? mc + MC : m_total;
            for (int64_t s = 0; s < strips; s += STRATA_AVX512F ? 2 : 1) {
                const int64_t col = n0 + s * NR;
                const int valid = n1 - col < NR ? (int)(n1 - col) : NR;
                const float *strip_bias = last && bias ? bias + col : NULL;
                for (int64_t m = mc; m < mc_end; m += MR) {
                    const int mr = mc_end - m < MR ? (int)(mc_end - m) : MR;
                    const float *a = xp + m * w->k + k0 * MR, *strip = panel + s * KC * NR;
#if STRATA_AVX512F
                    const int pair = s + 1 < strips, valid1 = n1 - col - NR < NR ? (int)(n1 - col - NR) : NR;
                    KERNELS512[mr](a, strip, pair, kc, out + m * w->n + col, w->n, k0 > 0, valid, pair ? valid1 : 0,
                                   strip_bias);
#else
                    KERNELS[mr](a, strip, kc, out + m * w->n + col, w->n, k0 > 0, valid, strip_bias);
#endif
                }
            }
        }
    }
}

/* out[m_total, n] = x[m_total, k] (float32, contiguous) times the weight's transpose (+ bias, float32 or NULL);
   the weight as in weight_only_matmul (kind 1 bfloat16, 4 / 8 int4 / int8 with scales and zeros [n, groups],
   9 FP8 with scales [n, 1], 32 + ggml's type GGUF blocks). Tasks of NC outputs are shared among the threads.
   Returns 0, -1 when scratch memory ran out, -2 for a GGUF kind it does not read or a K of partial blocks. */
int weight_gemm(const float *x, int64_t m_total, int64_t k, const void *weight, int64_t row_bytes, int kind,
                const float *scales, const float *zeros, int64_t groups, int64_t group_size, const float *bias,
                float *out, int64_t n, int num_threads) {
    kind = gguf_dense_kind(kind);
    if (kind >= KIND_GGUF && kind != KIND_F16 && !gguf_shape_ok(kind, k, row_bytes)) return -2;
    const weights_t w = {weight, row_bytes, n, k, scaled(kind) ? groups : 1, scaled(kind) ? group_size : k + BLOCK,
                         scales, zeros, kind};
    if (m_total == 0 || n == 0) return 0;
    if (k == 0) { /* no panels: the bias alone */
        for (int64_t i = 0; i < m_total * n; i++) out[i] = bias ? bias[i % n] : 0.f;
        return 0;
    }
    /* Tasks of at most NC outputs, whole strips, as many as a multiple of the threads: q/k/v's 576/192 outputs
       in tasks of 128 left one of two threads idle for a third or a half of the product. */
    const int64_t strips = (n + NR - 1) / NR, threads = num_threads > 0 ? num_threads : 1;
    const int64_t rounds = ((n + NC - 1) / NC + threads - 1) / threads;
    const int64_t per_task = (strips + rounds * threads - 1) / (rounds * threads) * NR;
#if STRATA_AMX
    if (engine_of[kind] == GEMM_AMX && amx_reads(&w)) return amx_gemm(x, m_total, &w, bias, out, per_task, num_threads);
#endif
    const int64_t tasks = (n + per_task - 1) / per_task, blocks = (m_total + MR - 1) / MR;
    float *xp = aligned_alloc(64, (sizeof(float) * (size_t)(blocks * MR * k) + 63) / 64 * 64);
    if (!xp) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) pack_rows(x, m_total, k, b, xp);
        float *rows = aligned_alloc(64, sizeof(float) * (NR * KC + NC * KC));
        if (!rows) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = t * per_task, n1 = n0 + per_task < n ? n0 + per_task : n;
            if (rows) task(&w, xp, m_total, n0, n1, bias, out, rows, rows + NR * KC);
        }
        free(rows);
    }
    free(xp);
    return failed ? -1 : 0;
}

/* Sets a kind's engine (GEMM_FMA or GEMM_AMX) while no product of it runs. Returns 0; -2 where this build has no AMX
   path for the kind; -1 where the operating system refuses this process AMX's tile state. */
int set_gemm_engine(int kind, int engine) {
    kind = gguf_dense_kind(kind);
    if (engine == GEMM_FMA && kind >= 0 && kind < KIND_GGUF + 32) {
        engine_of[kind] = GEMM_FMA;
        return 0;
    }
#if STRATA_AMX
    if (engine != GEMM_AMX || !amx_reads_kind(kind)) return -2;
    if (!amx_permitted()) return -1;
    engine_of[kind] = GEMM_AMX;
    return 0;
#else
    return -2;
#endif
}

/* A kind's engine now, or -2 where this build has no AMX path for it (the FMA GEMM serves it, unmeasured). */
int gemm_engine(int kind) {
    kind = gguf_dense_kind(kind);
#if STRATA_AMX
    if (amx_reads_kind(kind)) return engine_of[kind];
#endif
    (void)kind;
    return -2;
}

STRATA_ABI_EXPORT(weight_gemm, STRATA_ABI_WEIGHT_KINDS STRATA_ABI_CONST(GEMM_FMA) STRATA_ABI_CONST(GEMM_AMX))
