/* When the elementwise kernels (RMSNorm, gated activations, rotary) share a call's rows among the threads. */
#ifndef STRATA_THREADED_ROWS_H
#define STRATA_THREADED_ROWS_H

/* Rows (tokens) from which a call shares them among the threads: a decode step's few stay on the calling thread,
   where waking the others costs more than the rows. */
#define THREADED_ROWS 32

#endif
