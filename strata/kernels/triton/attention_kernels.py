"""The Triton programs behind strata.kernels.triton.attention (imported only when a kernel is first called, so
that TRITON_INTERPRET is read after the caller set it and CPU users need no triton).

Keys are visited in tiles of BLOCK_N positions of a sequence, each key's slot looked up through the block table,
so tiles need not match the cache's block size. Scores live in log2 units (scale folded with log2(e)) so the
online softmax uses exp2. Running maxima start at -1e30 rather than -inf so that a row with no visible key in a
tile keeps a finite maximum and contributes exp2(-inf) = 0 instead of NaN. With DOT_F32 every product is taken in
float32 at IEEE precision: float32 inputs, and bfloat16 under the interpreter, whose bfloat16 tl.dot is wrong.
Soft-capping (CAPPED, Gemma 2) bends each score before the mask; a sink (HAS_SINKS, gpt-oss) is one more logit
per query head, merged into a row's softmax once, after its last key, with no value behind it.
"""
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_co, stride_ch, stride_vcb, stride_vco, stride_vch,
                    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:  # padding: written nowhere
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    ok = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(k_cache + block * stride_cb + offset * stride_co + heads * stride_ch + dims,
             k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_cache + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims,
             v.to(v_cache.dtype.element_ty), mask=ok)


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), s and cap in the same (log2) units, with tanh(x) = sign(x) (1 - e) / (1 + e) for
    e = exp(-2|x|): exp2 of a non-positive argument never overflows (and Triton has no tanh the interpreter runs)."""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / cap))
    t = cap * (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t)


@triton.jit
def _add_sink(acc, m, denom, sink):
    """Merges one more logit `sink` [M] (log2 units, no value behind it) into rows' running softmax."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    return acc * alpha[:, None], denom * alpha + tl.exp2(sink - m_new)


@triton.jit
def _attend_tile(q, acc, m, denom, k_cache, v_cache, table_row, pos, key_ok, ok, kv_head, dims, dim_ok, scale_log2,
                 cap_log2, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                 BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr, CAPPED: tl.constexpr):
    """One online-softmax step: rows of q [M, DIM_PAD] against the keys at positions pos [N], of which only
    those with key_ok [N] are read (the rest may be another sequence's blocks, or garbage) and row i sees key j
    where ok [M, N] (or [1, N]). With CAPPED, scores are soft-capped at cap_log2 (the cap in log2 units)."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    k = tl.load(k_cache + (block * stride_kb + offset * stride_ko + kv_head * stride_kh)[None, :] + dims[:, None],
                mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [DIM_PAD, N]
    v = tl.load(v_cache + (block * stride_vb + offset * stride_vo + kv_head * stride_vh)[:, None] + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, DIM_PAD]
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale_log2
    if CAPPED:
        s = _soft_cap(s, cap_log2)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, denom


@triton.jit
def decode_kernel(q_ptr, k_cache, v_cache, block_tables, first_keys, seq_lens, out_ptr, m_ptr, denom_ptr, acc_ptr,
                  sinks_ptr, scale_log2, cap_log2, stride_qs, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb,
                  stride_vo, stride_vh, stride_bt, stride_os, stride_oh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  DOT_F32: tl.constexpr, CAPPED: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (sequence, KV head, split): all GROUP query heads of that KV head over one range of key tiles.
    One split writes the output (its sinks merged); several write their (max, sum, accumulator) for
    combine_kernel, which merges the sinks."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    start, end = tl.load(first_keys + seq), tl.load(seq_lens + seq)
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(end, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = first_tile + split * per_split
    hi = tl.minimum(lo + per_split, first_tile + num_tiles)
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for tile in range(lo, hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (pos >= start) & (pos < end)
        acc, m, denom = _attend_tile(q, acc, m, denom, k_cache, v_cache, table_row, pos, ok, ok[None, :], kv_head,
                                 dims, dim_ok, scale_log2, cap_log2,
                                 stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                                 BLOCK_SIZE, DOT_F32, CAPPED)
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
            acc, denom = _add_sink(acc, m, denom, sink)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [S, Hq, NUM_SPLITS] layout
        tl.store(m_ptr + part, m, mask=row_ok)
        tl.store(denom_ptr + part, denom, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_kernel(m_ptr, denom_ptr, acc_ptr, sinks_ptr, out_ptr, stride_os, stride_oh, num_heads,
                   HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (sequence, query head): merges the splits' partial softmaxes (and the head's sink, a split of one
    logit and no value) into the output row."""
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < NUM_SPLITS
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(m_ptr + part, mask=split_ok, other=-1e30)
    denom = tl.load(denom_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # splits that saw no key have denom = 0 and weigh nothing
    total = tl.sum(weight * denom, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def prefill_kernel(q_ptr, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out_ptr, sinks_ptr, num_seqs,
                   scale_log2, cap_log2, stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                   stride_vh, stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQS_PAD: tl.constexpr,
                   WINDOW: tl.constexpr, CHUNK: tl.constexpr, DOT_F32: tl.constexpr, CAPPED: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """Program (query tile, query head). Sequence b owns tiles from query_start_loc[b] // BLOCK_M + b on, at
    least as many as its chunk needs, so a grid of T // BLOCK_M + B tiles covers every chunk without the host
    knowing their lengths; tiles past a chunk's end exit at once."""
    tile, head = tl.program_id(0), tl.program_id(1)
    seqs = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_loc + seqs, mask=seqs < num_seqs, other=0)
    owns = (seqs < num_seqs) & (starts // BLOCK_M + seqs <= tile)
    seq = tl.sum(owns.to(tl.int32), axis=0) - 1
    q_start, q_end = tl.load(query_start_loc + seq), tl.load(query_start_loc + seq + 1)
    first_row = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if first_row >= q_end - q_start:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - (q_end - q_start)  # position of the chunk's first query
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end - q_start
    q_pos = context + rows
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # Keys from the first one the tile's first query sees to its last query: every one of them is seen by
    # some query of the tile, so with a window or attention chunk the earlier context is never visited.
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(context + first_row - WINDOW + 1, 0)
    if CHUNK > 0:
        first_key = tl.maximum(first_key, (context + first_row) // CHUNK * CHUNK)
    end_key = tl.minimum(context + first_row + BLOCK_M, seq_len)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for key_tile in range(first_key // BLOCK_N, tl.cdiv(end_key, BLOCK_N)):
        pos = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= first_key)
        if WINDOW > 0:
            ok = ok & (q_pos[:, None] - pos[None, :] < WINDOW)
        if CHUNK > 0:
            ok = ok & (pos[None, :] // CHUNK == q_pos[:, None] // CHUNK)
        key_ok = (pos >= first_key) & (pos < end_key)
        acc, m, denom = _attend_tile(q, acc, m, denom, k_cache, v_cache, table_row, pos, key_ok, ok, head // GROUP,
                                 dims, dim_ok, scale_log2, cap_log2, stride_kb, stride_ko, stride_kh, stride_vb,
                                 stride_vo, stride_vh, BLOCK_SIZE, DOT_F32, CAPPED)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        acc, denom = _add_sink(acc, m, denom, tl.full([BLOCK_M], 0.0, tl.float32) + sink)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
