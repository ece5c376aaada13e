/* TP all-reduce and all-gather, and the PP hand-off between stages, among ranks of one machine through
   shared memory segments. Built on first use by kernels/cpu/build.py, called from
   strata/executor/shm_collectives.py.

   Collective segment: a header of one 64-byte line per rank holding the number of the last operation whose data that
   rank has written, then two buffers of `size` slots of `slot_bytes` each. Operation n (numbered from 1,
   in the same order on every rank) uses buffer n % 2: a rank writes its slot, publishes n, waits until
   every rank has published n, then reads all slots. Nobody can write buffer n % 2 again (operation n + 2)
   before everyone has published n + 1, which each rank does only after it finished reading operation n,
   so one barrier per operation is enough. Tensors larger than a slot go through in several operations.

   Channel segment (one sender, one receiver): the count of pieces written and the count read, on lines of
   their own, then `depth` slots; piece k goes to slot k % depth once piece k - depth has been read. */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "abi.h"
#include "bf16.h"
#include "isa.h"

#define HEADER_BYTES 4096
#define FLAG_STRIDE 8 /* int64s per rank: one cache line each, so ranks do not share lines */

static inline void cpu_relax(void) {
#if STRATA_X86
    __builtin_ia32_pause();
#endif
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Returns 0 once *flag >= target, -1 after `timeout_s` seconds without that. Spins briefly (peers on
   other cores answer within microseconds), then yields, then sleeps, so that ranks outnumbering the
   cores still leave the CPU to the one being waited for. */
static int wait_at_least(int64_t *flag, int64_t target, double timeout_s) {
    uint64_t spins = 0;
    double started = 0.0;
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < target) {
        if (++spins < 2048) {
            cpu_relax();
            continue;
        }
        if (started == 0.0) started = now();
        const double waited = now() - started;
        if (waited > timeout_s) return -1;
        if (waited < 1e-3) {
            sched_yield();
        } else {
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
        }
    }
    return 0;
}

static int wait_all(int64_t *flags, int size, int64_t target, double timeout_s) {
    for (int r = 0; r < size; r++)
        if (wait_at_least(flags + r * FLAG_STRIDE, target, timeout_s) != 0) return -1;
    return 0;
}

static char *slot(char *base, int size, int64_t slot_bytes, int64_t op, int rank) {
    return base + HEADER_BYTES + ((op & 1) * size + rank) * slot_bytes;
}

/* One operation: copies `nbytes` of `src` into this rank's slot, publishes it and waits for every rank.
   Returns slot 0 of the operation's buffer (slot r lies r * slot_bytes further), or NULL on timeout. */
static const char *exchange(char *base, int rank, int size, int64_t slot_bytes, int64_t *op, const void *src,
                            int64_t nbytes, double timeout_s) {
    const int64_t current = ++*op;
    memcpy(slot(base, size, slot_bytes, current, rank), src, nbytes);
    int64_t *flags = (int64_t *)base;
    __atomic_store_n(flags + rank * FLAG_STRIDE, current, __ATOMIC_RELEASE);
    if (wait_all(flags, size, current, timeout_s) != 0) return NULL;
    return slot(base, size, slot_bytes, current, 0);
}

/* Folds every rank's `n` elements (slot r at parts + r * per_op elements) into `out`. */
typedef void (*combine_fn)(void *out, const void *parts, int size, int64_t per_op, int64_t n);

/* Float32 sum in rank order, so that every rank gets identical bits. */
static void sum_f32(void *out_, const void *parts_, int size, int64_t per_op, int64_t n) {
    float *out = (float *)out_;
    const float *parts = (const float *)parts_;
    memcpy(out, parts, n * sizeof(float));
    for (int r = 1; r < size; r++) {
        const float *part = parts + r * per_op;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] += part[i];
    }
}

/* Bfloat16 sum in float32, in rank order, rounded once at the end. */
static void sum_bf16(void *out_, const void *parts_, int size, int64_t per_op, int64_t n) {
    uint16_t *out = (uint16_t *)out_;
    const uint16_t *parts = (const uint16_t *)parts_;
    for (int64_t i = 0; i < n; i++) {
        float total = 0.f;
        for (int r = 0; r < size; r++) total += bf16_to_f32(parts[r * per_op + i]);
        out[i] = f32_to_bf16(total);
    }
}

/* All-reduce of `numel` elements of `elem` bytes in place, in pieces of one slot each. */
static int all_reduce(char *base, int rank, int size, int64_t slot_bytes, int64_t *op, char *x, int64_t numel,
                      int64_t elem, combine_fn combine, double timeout_s) {
    const int64_t per_op = slot_bytes / elem;
    for (int64_t offset = 0; offset < numel; offset += per_op) {
        const int64_t n = numel - offset < per_op ? numel - offset : per_op;
        const char *parts = exchange(base, rank, size, slot_bytes, op, x + offset * elem, n * elem, timeout_s);
        if (parts == NULL) return -1;
        combine(x + offset * elem, parts, size, per_op, n);
    }
    return 0;
}

int shm_all_reduce_f32(char *base, int rank, int size, int64_t slot_bytes, int64_t *op, float *x, int64_t numel,
                       double timeout_s) {
    return all_reduce(base, rank, size, slot_bytes, op, (char *)x, numel, sizeof(float), sum_f32, timeout_s);
}

int shm_all_reduce_bf16(char *base, int rank, int size, int64_t slot_bytes, int64_t *op, uint16_t *x, int64_t numel,
                        double timeout_s) {
    return all_reduce(base, rank, size, slot_bytes, op, (char *)x, numel, sizeof(uint16_t), sum_bf16, timeout_s);
}

/* out = the `nbytes` of every rank's `x`, concatenated in rank order. */
int shm_all_gather(char *base, int rank, int size, int64_t slot_bytes, int64_t *op, const char *x, int64_t nbytes,
                   char *out, double timeout_s) {
    for (int64_t offset = 0; offset < nbytes; offset += slot_bytes) {
        const int64_t n = nbytes - offset < slot_bytes ? nbytes - offset : slot_bytes;
        const char *parts = exchange(base, rank, size, slot_bytes, op, x + offset, n, timeout_s);
        if (parts == NULL) return -1;
        for (int r = 0; r < size; r++) memcpy(out + r * nbytes + offset, parts + r * slot_bytes, n);
    }
    return 0;
}

/* Sends `nbytes` of `x` as pieces numbered after *sent; returns once they are all in the segment. */
int shm_send(char *base, int64_t slot_bytes, int64_t depth, int64_t *sent, const char *x, int64_t nbytes,
             double timeout_s) {
    int64_t *written = (int64_t *)base, *read = written + FLAG_STRIDE;
    for (int64_t offset = 0; offset < nbytes; offset += slot_bytes) {
        const int64_t n = nbytes - offset < slot_bytes ? nbytes - offset : slot_bytes, piece = *sent + 1;
        if (wait_at_least(read, piece - depth, timeout_s) != 0) return -1;
        memcpy(base + HEADER_BYTES + (piece % depth) * slot_bytes, x + offset, n);
        __atomic_store_n(written, piece, __ATOMIC_RELEASE);
        *sent = piece;
    }
    return 0;
}

/* Receives `nbytes` into `out`: the pieces numbered after *received. */
int shm_recv(char *base, int64_t slot_bytes, int64_t depth, int64_t *received, char *out, int64_t nbytes,
             double timeout_s) {
    int64_t *written = (int64_t *)base, *read = written + FLAG_STRIDE;
    for (int64_t offset = 0; offset < nbytes; offset += slot_bytes) {
        const int64_t n = nbytes - offset < slot_bytes ? nbytes - offset : slot_bytes, piece = *received + 1;
        if (wait_at_least(written, piece, timeout_s) != 0) return -1;
        memcpy(out + offset, base + HEADER_BYTES + (piece % depth) * slot_bytes, n);
        __atomic_store_n(read, piece, __ATOMIC_RELEASE);
        *received = piece;
    }
    return 0;
}

STRATA_ABI_EXPORT(shm_collectives, STRATA_ABI_CONST(HEADER_BYTES))
