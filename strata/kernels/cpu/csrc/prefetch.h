/* How far ahead of the weight bytes being read the small-batch kernels ask for cache lines, shared by strata's C
   libraries: the hardware prefetcher alone leaves DRAM idle part of the time between a kernel's short runs of
   rows (an int8 decode step read its weights at 11 GB/s without, 16.5 with, on 2 Xeon cores). */
#ifndef STRATA_PREFETCH_H
#define STRATA_PREFETCH_H

#define PREFETCH_BYTES 4096

/* Every 64-byte line of [at, at + bytes), PREFETCH_BYTES further on. */
static inline void prefetch_ahead(const void *at, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)at + PREFETCH_BYTES + i, 0, 3);
}

/* Every 64-byte line of [at, at + bytes). */
static inline void prefetch_lines(const void *at, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)at + i, 0, 3);
}

#endif
