/* Runs of a decode step's rows for the decode attention (cpu_attention.c, which includes this after its attend
   loops): a request's consecutive rows of one step (a speculative verification's, which see the same blocks, one
   key more each) read each key and value once for all of them, where one row at a time read them once a row. Each
   row keeps the keys its own decode step would take (the same slice of its own keys), the same dot products and
   the same softmax over them, so that its output has the bits it would have alone. */
#ifndef STRATA_DECODE_ATTENTION_RUNS_H
#define STRATA_DECODE_ATTENTION_RUNS_H

#define MAX_RUN 64 /* rows of one run: below MIN_SPLIT_KEYS, so that every row has keys in every slice */

/* What every work item of one scored_decode_attention call reads. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *first_keys, *seq_lens;
    int64_t num_heads, group, head_dim, block_size, max_blocks, block_stride, token_stride, splits;
    float scale, softcap;
    const float *sinks;
    void *out;
    float *partial, *stats; /* splits > 1: each split's outputs and (top score, sum of exponentials) */
    int mode;
} decode_args_t;

/* The first row of each run into run_first (then num_seqs after the last); returns the number of runs. Row s joins
   row s - 1's run when it sees one key more through the same blocks. */
static int64_t find_runs(const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs, int64_t max_blocks,
                         int64_t block_size, int64_t *run_first) {
    int64_t runs = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
        if (s > 0 && s - run_first[runs - 1] < MAX_RUN && seq_lens[s] == seq_lens[s - 1] + 1 &&
            blocks <= max_blocks &&
            !memcmp(block_tables + s * max_blocks, block_tables + (s - 1) * max_blocks,
                    sizeof(int32_t) * (size_t)blocks))
            continue;
        run_first[runs++] = s;
    }
    run_first[runs] = num_seqs;
    return runs;
}

/* Row s's keys in slice `part` of the splits: [*lo, *hi). */
static inline void row_keys(const decode_args_t *a, int64_t s, int64_t part, int64_t *lo, int64_t *hi) {
    const int64_t first = a->first_keys[s], keys = a->seq_lens[s] - first;
    *lo = first + keys * part / a->splits, *hi = first + keys * (part + 1) / a->splits;
}

/* The keys [lo, hi) that rows s .. s + rows - 1 take together in slice `part`. */
static void run_keys(const decode_args_t *a, int64_t s, int64_t rows, int64_t part, int64_t *lo, int64_t *hi) {
    row_keys(a, s, part, lo, hi);
    for (int64_t r = 1; r < rows; r++) {
        int64_t l, h;
        row_keys(a, s + r, part, &l, &h);
        *lo = l < *lo ? l : *lo, *hi = h > *hi ? h : *hi;
    }
}

/* Floats of scratch attend_run takes for rows s .. s + rows - 1, num_kv KV heads, slice `part`. */
static int64_t run_scratch_floats(const decode_args_t *a, int64_t s, int64_t rows, int64_t num_kv, int64_t part) {
    int64_t lo, hi;
    run_keys(a, s, rows, part, &lo, &hi);
    const int64_t num_q = num_kv * a->group * rows;
    return num_q * (hi - lo) + num_q * (2 * a->head_dim + 7); /* scores, q and out, stats, sinks, ranges */
}

/* Rows s .. s + rows - 1 and KV heads [h0, h0 + num_kv) over slice `part` of their keys: their query heads
   gathered (KV head, row, query head of the group), attended together, each over its own keys, then put in place
   (out, or the slice's partial output and stats). */
static void attend_run(const decode_args_t *a, int64_t s, int64_t rows, int64_t h0, int64_t num_kv, int64_t part,
                       float *scratch) {
    const int64_t per_kv = rows * a->group, num_q = num_kv * per_kv, d = a->head_dim;
    int64_t lo, hi;
    run_keys(a, s, rows, part, &lo, &hi);
    int64_t *ranges = (int64_t *)scratch; /* malloc's alignment; 4 * num_q floats */
    float *scores = scratch + 4 * num_q, *q = scores + num_q * (hi - lo), *out = q + num_q * d;
    float *stats = out + num_q * d, *sinks = stats + 2 * num_q;
    for (int64_t j = 0; j < num_q; j++) {
        const int64_t row = s + j % per_kv / a->group, head = h0 * a->group + j / per_kv * a->group + j % a->group;
        int64_t l, h;
        row_keys(a, row, part, &l, &h);
        ranges[2 * j] = l - lo, ranges[2 * j + 1] = h - lo;
        const int64_t at = (row * a->num_heads + head) * d;
        if (a->mode == 1)
            for (int64_t i = 0; i < d; i++) q[j * d + i] = bf16_to_f32(((const bf16 *)a->q)[at + i]);
        else
            memcpy(q + j * d, (const float *)a->q + at, sizeof(float) * (size_t)d);
        sinks[j] = a->sinks ? a->sinks[head] : 0.f;
    }
    const int32_t *table = a->block_tables + s * a->max_blocks;
    const float *head_sinks = a->sinks && !a->partial ? sinks : NULL; /* a split row's sinks join at the merge */
    float *split_stats = a->partial ? stats : NULL;
    if (a->mode == 0)
        attend_f32(q, (const float *)a->k_cache + h0 * d, (const float *)a->v_cache + h0 * d, table, lo, hi, num_kv,
                   per_kv, d, a->block_size, a->block_stride, a->token_stride, a->scale, a->softcap, head_sinks,
                   scores, out, split_stats, ranges);
    else
        attend_bf16(q, (const bf16 *)a->k_cache + h0 * d, (const bf16 *)a->v_cache + h0 * d, table, lo, hi, num_kv,
                    per_kv, d, a->block_size, a->block_stride, a->token_stride, a->scale, a->softcap, head_sinks,
                    scores, out, split_stats, ranges);
    for (int64_t j = 0; j < num_q; j++) {
        const int64_t row = s + j % per_kv / a->group, head = h0 * a->group + j / per_kv * a->group + j % a->group;
        if (a->partial) {
            const int64_t at = (row * a->splits + part) * a->num_heads + head;
            memcpy(a->partial + at * d, out + j * d, sizeof(float) * (size_t)d);
            a->stats[2 * at] = stats[2 * j], a->stats[2 * at + 1] = stats[2 * j + 1];
        } else if (a->mode == 1) {
            for (int64_t i = 0; i < d; i++)
                ((bf16 *)a->out)[(row * a->num_heads + head) * d + i] = f32_to_bf16(out[j * d + i]);
        } else {
            memcpy((float *)a->out + (row * a->num_heads + head) * d, out + j * d, sizeof(float) * (size_t)d);
        }
    }
}

#endif
