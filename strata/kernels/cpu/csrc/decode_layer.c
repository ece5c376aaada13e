/* A decode step's pre-norm attention block and SwiGLU block on CPU, each as one call: the kernels of the other
   libraries (RMSNorm, linear products, rotary, paged attention, SwiGLU) run in sequence here instead of through a
   dozen Python-level calls each (which cost more than a small layer's arithmetic). The kernels are reached by the
   function pointers Python hands over (`kernels_t`), so each keeps its own library. Called from
   strata/layers/decode_block.py, float32 activations only; the arithmetic is that of the separate calls.
   `decode_forward` adds the embedding lookup, the final norm, the LM head and each row's argmax around the layers
   (strata/layers/decode_forward.py): a single-stage model's whole decode step. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "bf16.h"
#include "isa.h"
#include "row_argmax.h"

typedef int (*weight_only_fn)(const float *, int64_t, int64_t, const void *, int64_t, int, const float *,
                              const float *, int64_t, int64_t, const float *, float *, int64_t, int);
typedef int (*blocked_fn)(const void *, int64_t, int64_t, const void *, int, int64_t, int64_t, int64_t,
                          const float *, void *, int, int);
typedef void (*rms_norm_fn)(const void *, const void *, const void *, void *, void *, int64_t, int64_t, float, int);
typedef void (*norm_heads_fn)(void *, int64_t, int64_t, int64_t, int64_t, const void *, float, int);
typedef void (*rope_fn)(void *, int64_t, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int);
typedef int (*rows_fn)(const void *, int64_t, int, int64_t, const int64_t *, int64_t, float *, int);
typedef void (*silu_fn)(const void *, void *, int64_t, int64_t, int);
typedef int (*attention_fn)(const void *, void *, void *, const int32_t *, const int32_t *, const int32_t *, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, float, void *, int, int, const void *,
                            const void *, int64_t, const int64_t *, float, const float *);
typedef int (*lora_fn)(const void *, const int64_t *, int64_t, const float *, float *, int);

typedef struct {
    weight_only_fn weight_only;
    blocked_fn blocked;
    rms_norm_fn rms_norm;
    rope_fn rope;
    silu_fn silu;
    attention_fn attention;
    norm_heads_fn norm_heads;
    rows_fn rows; /* rows of a table in ggml blocks (a GGUF embedding) */
    silu_fn gelu; /* gelu_tanh(gate) * up, the silu's signature */
    weight_only_fn gemm; /* weight_gemm: the large-batch product of the same weights */
    lora_fn lora;        /* lora_apply: each row's adapter delta added to a product */
} kernels_t;

/* One linear layer as a kernel reads it: oneDNN's blocked layout (blocked_matmul) or rows of float32, bfloat16,
   FP8, int8, int4 values or ggml blocks (weight_only_matmul; from `gemm_rows` rows of x on, weight_gemm, as
   kernel_choice.py measured them; 0: never); or `n_pieces` such layers whose outputs lie side by side (a fused
   q/k/v whose parts a GGUF file stores in different types); `lora`: its LoRA slots (lora.c's lora_t; NULL: none),
   whose deltas the step's rows of an adapter add to the product. */
typedef struct linear_s {
    int64_t blocked, n, k;
    const void *weight;
    const float *bias;
    int64_t bf16, block, k_pad;                                  /* blocked */
    int64_t row_bytes, kind, groups, group_size;                 /* weight-only */
    const float *scales, *zeros;
    int64_t n_pieces;
    const struct linear_s *pieces;
    int64_t gemm_rows;
    const void *lora;
} linear_t;

/* q/k norms over each head (NULL: none), the rotated leading dimensions of a head (partial rotary), the scale of
   the block's output before the residual add, and which of the step's key ranges (sliding window) it reads; the
   scores' soft cap (0: none) and one sink logit per head (NULL: none); a norm of the block's output (NULL: none;
   Gemma's norms after each block, which TP > 1 leaves to the modules: it must follow the all-reduce); `rope`, which
   of the step's rotary tables it turns q and k by (Gemma 3's local and global layers have their own bases). */
typedef struct {
    const float *norm_weight;
    float eps;
    int64_t hidden, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    linear_t qkv, o;
    void *k_cache, *v_cache;
    const float *q_norm, *k_norm;
    float qk_eps;
    int64_t rotary_dim, ranges;
    float out_scale;
    float softcap;
    const float *sinks;
    const float *out_norm;
    float out_eps;
    int64_t rope;
    int64_t kv_bf16; /* bfloat16 caches (kv_cache_dtype), read and written from float32 rows */
} attention_block_t;

/* gelu: gate with tanh-approximated GELU instead of SiLU; out_norm as the attention block's. */
typedef struct {
    const float *norm_weight;
    float eps;
    int64_t hidden, intermediate;
    linear_t gate_up, down;
    float out_scale;
    int64_t gelu;
    const float *out_norm;
    float out_eps;
} mlp_block_t;

/* The keys a step's tokens see through one kind of attention (full, or one sliding window). */
typedef struct {
    int64_t max_blocks;
    const int32_t *block_tables, *first_keys, *seq_lens;
} key_ranges_t;

/* What every layer of one decode step shares. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin; /* [rotaries, tokens, rotary_dim / 2]: one table per rotary embedding of the layers */
    const key_ranges_t *ranges;
    const int64_t *slots;
    int64_t threads;
    const int64_t *lora_slots; /* [tokens]: each row's LoRA slot (-1: none); NULL when no row uses an adapter */
} decode_step_t;

static int run_linear(const kernels_t *kn, const linear_t *l, const float *x, int64_t rows, float *out,
                      int threads);

/* Each piece into its own buffer, then its columns into out [rows, n]. */
static int run_pieces(const kernels_t *kn, const linear_t *l, const float *x, int64_t rows, float *out, int threads) {
    int64_t widest = 0, at = 0;
    for (int64_t p = 0; p < l->n_pieces; p++) widest = l->pieces[p].n > widest ? l->pieces[p].n : widest;
    float *part = malloc((size_t)(rows * widest) * sizeof(float));
    if (!part) return -1;
    for (int64_t p = 0; p < l->n_pieces; p++) {
        const linear_t *piece = l->pieces + p;
        const int status = run_linear(kn, piece, x, rows, part, threads);
        if (status) {
            free(part);
            return status;
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + r * l->n + at, part + r * piece->n, (size_t)piece->n * sizeof(float));
        at += piece->n;
    }
    free(part);
    if (l->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < l->n; j++) out[r * l->n + j] += l->bias[j];
    return 0;
}

static int run_linear(const kernels_t *kn, const linear_t *l, const float *x, int64_t rows, float *out,
                      int threads) {
    if (l->n_pieces) return run_pieces(kn, l, x, rows, out, threads);
    if (l->blocked)
        return kn->blocked(x, rows, l->k, l->weight, (int)l->bf16, l->block, l->k_pad, l->n, l->bias, out, threads, 0);
    const weight_only_fn product = l->gemm_rows > 0 && rows >= l->gemm_rows ? kn->gemm : kn->weight_only;
    return product(x, rows, l->k, l->weight, l->row_bytes, (int)l->kind, l->scales, l->zeros, l->groups,
                   l->group_size, l->bias, out, l->n, threads);
}

/* A projection of a layer: its product, then each adapter row's delta (before any all-reduce or gather, as
   strata/layers/linear.py adds it: a row-parallel layer's partial deltas are summed with its partial products). */
static int run_projection(const kernels_t *kn, const linear_t *l, const decode_step_t *step, const float *x,
                          float *out) {
    const int threads = (int)step->threads;
    const int status = run_linear(kn, l, x, step->tokens, out, threads);
    if (status || !l->lora || !step->lora_slots) return status;
    return kn->lora(l->lora, step->lora_slots, step->tokens, x, out, threads);
}

/* The norm before a block: the first layer's residual stream starts as its input (copied), later layers add the
   block's input to the stream in place. */
static void pre_norm(const kernels_t *kn, const float *x, float *residual, int first, const float *weight,
                     float eps, int64_t tokens, int64_t hidden, float *normed) {
    if (first) {
        memcpy(residual, x, (size_t)(tokens * hidden) * sizeof(float));
        kn->rms_norm(x, NULL, weight, normed, NULL, tokens, hidden, eps, 0);
    } else {
        kn->rms_norm(x, residual, weight, normed, residual, tokens, hidden, eps, 0);
    }
}

/* out [T, hidden] = o_proj(attention(rope(qkv_proj(norm(x (+ residual)))))); the step's keys and values are
   written to the cache. scratch: [T, hidden] normed input, [T, q + 2 kv] qkv, [T, q] contiguous q, [T, q]
   attention output. Returns 0, or the failing kernel's status. */
static void scale_rows(float *x, int64_t n, float by) {
    if (by != 1.f)
        for (int64_t i = 0; i < n; i++) x[i] *= by;
}

/* A block's output: scaled, then normalized in place when the layer norms its blocks' outputs. */
static void finish_block(const kernels_t *kn, float *out, int64_t t, int64_t hidden, float scale,
                         const float *norm_weight, float eps) {
    scale_rows(out, t * hidden, scale);
    if (norm_weight) kn->rms_norm(out, NULL, norm_weight, out, NULL, t, hidden, eps, 0);
}

int attention_block(const kernels_t *kn, const attention_block_t *b, const decode_step_t *step, const float *x,
                    float *residual, int first, float *scratch, float *out) {
    const int64_t t = step->tokens, q_width = b->num_heads * b->head_dim, kv_width = b->num_kv_heads * b->head_dim;
    const int64_t row = q_width + 2 * kv_width;
    const int threads = (int)step->threads;
    const key_ranges_t *keys = step->ranges + b->ranges;
    float *normed = scratch, *qkv = normed + t * b->hidden, *q = qkv + t * row, *attn = q + t * q_width;
    pre_norm(kn, x, residual, first, b->norm_weight, b->eps, t, b->hidden, normed);
    int status = run_projection(kn, &b->qkv, step, normed, qkv);
    if (status) return status;
    if (b->q_norm) {
        kn->norm_heads(qkv, t, b->num_heads, b->head_dim, row, b->q_norm, b->qk_eps, 0);
        kn->norm_heads(qkv + q_width, t, b->num_kv_heads, b->head_dim, row, b->k_norm, b->qk_eps, 0);
    }
    const int64_t table = b->rope * t * (b->rotary_dim / 2);
    const float *cos = step->cos + table, *sin = step->sin + table;
    kn->rope(qkv, t, b->num_heads, b->head_dim, b->rotary_dim, row, cos, sin, 0);
    kn->rope(qkv + q_width, t, b->num_kv_heads, b->head_dim, b->rotary_dim, row, cos, sin, 0);
    for (int64_t i = 0; i < t; i++) memcpy(q + i * q_width, qkv + i * row, (size_t)q_width * sizeof(float));
    status = kn->attention(q, b->k_cache, b->v_cache, keys->block_tables, keys->first_keys, keys->seq_lens, t,
                           b->num_heads, b->num_kv_heads, b->head_dim, b->block_size, keys->max_blocks, b->scale,
                           attn, threads, b->kv_bf16 ? 2 : 0, qkv + q_width, qkv + q_width + kv_width, row,
                           step->slots, b->softcap, b->sinks);
    if (status) return status;
    status = run_projection(kn, &b->o, step, attn, out);
    if (status) return status;
    finish_block(kn, out, t, b->hidden, b->out_scale, b->out_norm, b->out_eps);
    return 0;
}

/* out [T, hidden] = down(silu(gate) * up) (or GELU's) of norm(x + residual), the residual updated in place.
   scratch: [T, hidden] normed, [T, 2 * intermediate] gate and up, [T, intermediate] activation. */
int mlp_block(const kernels_t *kn, const mlp_block_t *b, const decode_step_t *step, const float *x, float *residual,
              float *scratch, float *out) {
    const int64_t t = step->tokens;
    float *normed = scratch, *gate_up = normed + t * b->hidden, *act = gate_up + t * 2 * b->intermediate;
    pre_norm(kn, x, residual, 0, b->norm_weight, b->eps, t, b->hidden, normed);
    int status = run_projection(kn, &b->gate_up, step, normed, gate_up);
    if (status) return status;
    (b->gelu ? kn->gelu : kn->silu)(gate_up, act, t, b->intermediate, 0);
    status = run_projection(kn, &b->down, step, act, out);
    if (status) return status;
    finish_block(kn, out, t, b->hidden, b->out_scale, b->out_norm, b->out_eps);
    return 0;
}

/* Layers [0, n) of a stage, one after the other: x (or, when not first, x + residual) through each layer's
   attention and MLP blocks, into out and residual; on the last stage (final_norm given) hidden_out then holds the
   final norm of out + residual. hidden_out is [T, hidden], the attention blocks' outputs until then. Returns 0, or
   the failing kernel's status. */
int decode_layers(const kernels_t *kn, const attention_block_t *attention, const mlp_block_t *mlp, int64_t n,
                  const decode_step_t *step, const float *x, float *residual, int first, float *scratch,
                  float *hidden_out, float *out, const float *final_norm, float final_eps) {
    for (int64_t i = 0; i < n; i++) {
        int status = attention_block(kn, attention + i, step, i == 0 ? x : out, residual, first && i == 0, scratch,
                                     hidden_out);
        if (status) return status;
        status = mlp_block(kn, mlp + i, step, hidden_out, residual, scratch, out);
        if (status) return status;
    }
    if (final_norm)
        kn->rms_norm(out, residual, final_norm, hidden_out, residual, step->tokens, mlp[n - 1].hidden, final_eps, 0);
    return 0;
}

/* What a single-stage model adds around its layers: the embedding table (float32 or bfloat16 rows), the rotary
   cos and sin of every position up to `rope_rows` ([ropes, rope_rows, rope_half] each: a table per rotary embedding,
   looked up instead of computed so that they are the values the modules use), the final norm and the LM head. */
typedef struct {
    const void *table;
    int64_t vocab, bf16;
    const float *rope_cos, *rope_sin;
    int64_t rope_rows, rope_half, ropes;
    const float *final_norm;
    float final_eps;
    linear_t head;
    int64_t table_kind, table_row_bytes; /* a table in ggml blocks: its kernel kind (0: float32 or bfloat16 rows) */
    float embed_scale, logits_divisor;   /* embeddings times, logits divided by (1: none) */
    float final_softcap;                 /* logits become cap * tanh(logits / cap) (0: none) */
} decode_model_t;

/* A decode step of T tokens through the whole model: logits [T, vocab] and each row's argmax. `step` gives the
   step's key ranges and slots (its cos and sin are filled here from the tables); scratch holds four [T, hidden]
   rows (input, residual, attention output, MLP output), the step's cos and sin of each rotary table, then what the
   layers need.
   Returns 0, -2 for a token id outside the table, -3 for a position past the rotary tables, or the failing
   kernel's status. */
int decode_forward(const kernels_t *kn, const attention_block_t *attention, const mlp_block_t *mlp, int64_t n,
                   const decode_step_t *step, const decode_model_t *m, const int64_t *token_ids,
                   const int64_t *positions, float *scratch, float *logits, int64_t *argmax) {
    const int64_t t = step->tokens, hidden = mlp[0].hidden, half = m->rope_half;
    float *x = scratch, *residual = x + t * hidden, *attn_out = residual + t * hidden, *out = attn_out + t * hidden;
    float *cos = out + t * hidden, *sin = cos + m->ropes * t * half, *rest = sin + m->ropes * t * half;
    for (int64_t i = 0; i < t; i++) {
        if (token_ids[i] < 0 || token_ids[i] >= m->vocab) return -2;
        if (positions[i] < 0 || positions[i] >= m->rope_rows) return -3;
        if (m->table_kind) {
            const int status = kn->rows(m->table, m->table_row_bytes, (int)m->table_kind, hidden, token_ids + i, 1,
                                        x + i * hidden, 1);
            if (status) return status;
        } else if (m->bf16) {
            const uint16_t *row = (const uint16_t *)m->table + token_ids[i] * hidden;
            for (int64_t j = 0; j < hidden; j++) x[i * hidden + j] = bf16_to_f32(row[j]);
        } else {
            memcpy(x + i * hidden, (const float *)m->table + token_ids[i] * hidden, (size_t)hidden * sizeof(float));
        }
        scale_rows(x + i * hidden, hidden, m->embed_scale);
        for (int64_t r = 0; r < m->ropes; r++) {
            const int64_t from = (r * m->rope_rows + positions[i]) * half, to = (r * t + i) * half;
            memcpy(cos + to, m->rope_cos + from, (size_t)half * sizeof(float));
            memcpy(sin + to, m->rope_sin + from, (size_t)half * sizeof(float));
        }
    }
    decode_step_t own = *step;
    own.cos = cos;
    own.sin = sin;
    int status = decode_layers(kn, attention, mlp, n, &own, x, residual, 1, rest, attn_out, out, m->final_norm,
                               m->final_eps);
    if (status) return status;
    status = run_linear(kn, &m->head, attn_out, t, logits, (int)step->threads);
    if (status) return status;
    if (m->logits_divisor != 1.f)
        for (int64_t i = 0; i < t * m->head.n; i++) logits[i] /= m->logits_divisor;
    const float cap = m->final_softcap;
    if (cap != 0.f)
        for (int64_t i = 0; i < t * m->head.n; i++) logits[i] = tanhf(logits[i] / cap) * cap;
    first_argmax(logits, t, m->head.n, argmax);
    return 0;
}

#define FIELD STRATA_ABI_FIELD
STRATA_ABI_EXPORT(decode_layer,
    STRATA_ABI_TYPE(kernels_t) FIELD(kernels_t, weight_only) FIELD(kernels_t, blocked) FIELD(kernels_t, rms_norm)
    FIELD(kernels_t, rope) FIELD(kernels_t, silu) FIELD(kernels_t, attention) FIELD(kernels_t, norm_heads)
    FIELD(kernels_t, rows) FIELD(kernels_t, gelu) FIELD(kernels_t, gemm) FIELD(kernels_t, lora)
    STRATA_ABI_TYPE(linear_t) FIELD(linear_t, blocked) FIELD(linear_t, n) FIELD(linear_t, k) FIELD(linear_t, weight)
    FIELD(linear_t, bias) FIELD(linear_t, bf16) FIELD(linear_t, block) FIELD(linear_t, k_pad)
    FIELD(linear_t, row_bytes) FIELD(linear_t, kind) FIELD(linear_t, groups) FIELD(linear_t, group_size)
    FIELD(linear_t, scales) FIELD(linear_t, zeros) FIELD(linear_t, n_pieces) FIELD(linear_t, pieces)
    FIELD(linear_t, gemm_rows) FIELD(linear_t, lora)
    STRATA_ABI_TYPE(attention_block_t) FIELD(attention_block_t, norm_weight) FIELD(attention_block_t, eps)
    FIELD(attention_block_t, hidden) FIELD(attention_block_t, num_heads) FIELD(attention_block_t, num_kv_heads)
    FIELD(attention_block_t, head_dim) FIELD(attention_block_t, block_size) FIELD(attention_block_t, scale)
    FIELD(attention_block_t, qkv) FIELD(attention_block_t, o) FIELD(attention_block_t, k_cache)
    FIELD(attention_block_t, v_cache) FIELD(attention_block_t, q_norm) FIELD(attention_block_t, k_norm)
    FIELD(attention_block_t, qk_eps) FIELD(attention_block_t, rotary_dim) FIELD(attention_block_t, ranges)
    FIELD(attention_block_t, out_scale) FIELD(attention_block_t, softcap) FIELD(attention_block_t, sinks)
    FIELD(attention_block_t, out_norm) FIELD(attention_block_t, out_eps) FIELD(attention_block_t, rope)
    FIELD(attention_block_t, kv_bf16)
    STRATA_ABI_TYPE(mlp_block_t) FIELD(mlp_block_t, norm_weight) FIELD(mlp_block_t, eps) FIELD(mlp_block_t, hidden)
    FIELD(mlp_block_t, intermediate) FIELD(mlp_block_t, gate_up) FIELD(mlp_block_t, down)
    FIELD(mlp_block_t, out_scale) FIELD(mlp_block_t, gelu) FIELD(mlp_block_t, out_norm) FIELD(mlp_block_t, out_eps)
    STRATA_ABI_TYPE(key_ranges_t) FIELD(key_ranges_t, max_blocks) FIELD(key_ranges_t, block_tables)
    FIELD(key_ranges_t, first_keys) FIELD(key_ranges_t, seq_lens)
    STRATA_ABI_TYPE(decode_step_t) FIELD(decode_step_t, tokens) FIELD(decode_step_t, cos) FIELD(decode_step_t, sin)
    FIELD(decode_step_t, ranges) FIELD(decode_step_t, slots) FIELD(decode_step_t, threads)
    FIELD(decode_step_t, lora_slots)
    STRATA_ABI_TYPE(decode_model_t) FIELD(decode_model_t, table) FIELD(decode_model_t, vocab)
    FIELD(decode_model_t, bf16) FIELD(decode_model_t, rope_cos) FIELD(decode_model_t, rope_sin)
    FIELD(decode_model_t, rope_rows) FIELD(decode_model_t, rope_half) FIELD(decode_model_t, ropes)
    FIELD(decode_model_t, final_norm) FIELD(decode_model_t, final_eps) FIELD(decode_model_t, head)
    FIELD(decode_model_t, table_kind) FIELD(decode_model_t, table_row_bytes) FIELD(decode_model_t, embed_scale)
    FIELD(decode_model_t, logits_divisor) FIELD(decode_model_t, final_softcap))
