"""Triton kernel for attention over a paged KV cache, prefill and decode alike.

The cache of one layer is [slots, kv_heads, head_dim] (blocks of `block_size` slots); a
sequence's position p lives in slot `block_tables[seq, p // block_size] * block_size +
p % block_size`. Every program owns one KV head and BLOCK_M rows, each row a (query
position, query head of that KV head's group) pair, so a GQA group reads its keys once and
nothing is copied per head. Queries of a sequence are its last `query_len` positions of
`context_len`; row q attends to positions <= its own (causal with the cached offset). Online
softmax in float32; out-of-range rows are neither read nor written.

Decode with ROPE: the program first rotates its query rows and this step's key of its KV head
by the token's position (rotate-half over the first 2 * HALF channels, cos and sin rounded
to the activations' dtype, each rotated value rounded to it: as `norm_rope_jit.rotary_kernel`)
and stores that key and the value at the token's cache slot; a barrier makes the stores
visible to the program's own threads, which then read the context (the new key included)
from the cache as without ROPE. One launch where rotary, the cache write and attention took
two. With QK_NORM the query rows and the key are RMS-normalised per head before they are
rotated (as `norm_rope_jit.rms_norm_kernel`: statistics in float32, rounded to the
activations' dtype), a rotated channel's partner normalised with the same row statistic;
two launches fewer (Qwen3's and Qwen3.5's q_norm and k_norm).

With GATE (decode) each output row is multiplied by the sigmoid of its gate row, rounded as
the torch steps round it (the attention output and the sigmoid each to the output dtype,
then their product): Qwen3.5's gated attention without its two elementwise launches.

Decode with SPLITS > 1: programs (sequence, KV head, split); a long context is cut into
splits of whole SPLIT_MIN-position units (`decode_split`, a function of the context length
alone), each split's rows, maxima and sums are left in a float32 workspace, and the last
split of a pair to finish (an atomic counter per pair) merges them in split order
(`merge_splits`), so the bits are the same whichever finishes last and whatever the batch.
A context of one split writes its rows directly, as with SPLITS 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops
from freetoken.kernels.norm_rope_jit import rms_apply, rms_scale, rope_cos_sin


@triton.jit
def paged_attention_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_starts_ptr,
    context_lens_ptr,
    work_ptr,
    positions_ptr,      # ROPE: [T] int64
    inv_freq_ptr,       # ROPE: [HALF] float32
    k_new_ptr,          # ROPE: [T, kv_heads, head_dim] this step's keys (unrotated)
    v_new_ptr,          # ROPE: [T, kv_heads, head_dim] this step's values
    slot_mapping_ptr,   # ROPE: [T] int64
    partial_ptr,        # SPLITS > 1: float32 [B, kv_heads, SPLITS, BLOCK_M, BLOCK_D + 2]
    counter_ptr,        # SPLITS > 1: int32 [B * kv_heads], zero between launches
    q_norm_ptr,         # QK_NORM: [head_dim] the query heads' RMSNorm weight
    k_norm_ptr,         # QK_NORM: [head_dim] the key heads' RMSNorm weight
    gate_ptr,           # GATE: [T, heads, head_dim] (unit stride along head_dim)
    # sizes
    scale,
    block_size,
    norm_eps,           # QK_NORM
    # strides
    stride_q_token,
    stride_q_head,
    stride_cache_slot,
    stride_cache_head,
    stride_out_token,
    stride_out_head,
    stride_table_seq,
    stride_k_new_token,
    stride_k_new_head,
    stride_v_new_token,
    stride_v_new_head,
    stride_gate_token,
    stride_gate_head,
    # meta
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr = False,
    HALF: tl.constexpr = 1,
    SEQ_ROW: tl.constexpr = False,
    V_EARLY: tl.constexpr = False,
    STAGES: tl.constexpr = None,   # decode: the loop's pipelining depth; None: the launch's
    SPLITS: tl.constexpr = 1,
    SPLIT_MIN: tl.constexpr = 256,
    PDL: tl.constexpr = 0,      # decode: let the stream's next kernel launch as it starts
    QK_NORM: tl.constexpr = False,      # with ROPE: q and k RMS-normalised first
    NORM_OFFSET: tl.constexpr = False,  # QK_NORM: the weight is 1 + w (Qwen3.5)
    GATE: tl.constexpr = False,         # decode: rows times sigmoid(gate)
):
    """Program (work item, KV head). Decode: work item i is sequence i, rows are its one
    query's GROUP heads. Prefill: work item i is (sequence, first query) from `work_ptr`,
    rows cover BLOCK_M // GROUP queries from there."""
    ops.launch_next(PDL)
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tl.program_id(0)
        first = 0
    else:
        seq = tl.load(work_ptr + 2 * tl.program_id(0))
        first = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    ctx_len = tl.load(context_lens_ptr + seq)
    if SPLITS > 1:
        # Decode over up to SPLITS programs along the context (`decode_split`); the split
        # holding the new position writes it (the others do not read it).
        n_split, lo, hi = decode_split(ctx_len, tl.program_id(2), SPLITS, SPLIT_MIN)
        writes_new = (hi == ctx_len) & (lo < hi)
    else:
        n_split, lo, hi, writes_new = 1, 0, ctx_len, True
    if SEQ_ROW:
        # Decode: sequence i's one query is row i (query_starts is 0, 1, ..., B).
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(query_starts_ptr + seq)
        q_len = tl.load(query_starts_ptr + seq + 1) - q_start

    rows = tl.arange(0, BLOCK_M)
    q_local = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_local < q_len
    q_pos = ctx_len - q_len + q_local
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token = (q_start + q_local).to(tl.int64)
    q_rows = q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if QK_NORM:
        q_scale = rms_scale(q.to(tl.float32), HEAD_DIM, norm_eps)[:, None]
        q = rms_apply(q, q_scale, tl.load(q_norm_ptr + d, mask=d_ok, other=0.0)[None, :],
                      NORM_OFFSET)
    if ROPE:
        # rotate-half: channel d < HALF pairs with d + HALF (sign -), d < 2 HALF with
        # d - HALF (sign +); channels from 2 HALF on are not rotated.
        rotated = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        cos, sin = rope_cos_sin(tl.load(positions_ptr + q_start),
                                tl.load(inv_freq_ptr + d % HALF, mask=rotated, other=0.0),
                                q.dtype)
        q_pair = tl.load(q_rows + partner[None, :],
                         mask=row_ok[:, None] & (d_ok & rotated)[None, :], other=0.0)
        if QK_NORM:
            q_pair = rms_apply(q_pair, q_scale, tl.load(q_norm_ptr + partner,
                                                        mask=d_ok & rotated,
                                                        other=0.0)[None, :], NORM_OFFSET)
        q = tl.where(rotated[None, :],
                     (q.to(tl.float32) * cos[None, :]
                      + sign[None, :] * q_pair.to(tl.float32) * sin[None, :]).to(q.dtype), q)
        k_row = k_new_ptr + q_start.to(tl.int64) * stride_k_new_token + \
            kv_head * stride_k_new_head
        k_new = tl.load(k_row + d, mask=d_ok, other=0.0)
        k_pair = tl.load(k_row + partner, mask=d_ok & rotated, other=0.0)
        if QK_NORM:
            k_scale = rms_scale(k_new.to(tl.float32)[None, :], HEAD_DIM, norm_eps)
            k_new = rms_apply(k_new, k_scale, tl.load(k_norm_ptr + d, mask=d_ok, other=0.0),
                              NORM_OFFSET)
            k_pair = rms_apply(k_pair, k_scale, tl.load(k_norm_ptr + partner,
                                                        mask=d_ok & rotated, other=0.0),
                               NORM_OFFSET)
        k_new = tl.where(rotated, (k_new.to(tl.float32) * cos + sign * k_pair.to(tl.float32)
                                   * sin).to(k_new.dtype), k_new)
        v_new = tl.load(v_new_ptr + q_start.to(tl.int64) * stride_v_new_token
                        + kv_head * stride_v_new_head + d, mask=d_ok, other=0.0)
        new_slot = tl.load(slot_mapping_ptr + q_start).to(tl.int64)
        new_at = new_slot * stride_cache_slot + kv_head * stride_cache_head + d
        tl.store(k_cache_ptr + new_at, k_new.to(k_cache_ptr.dtype.element_ty),
                 mask=d_ok & writes_new)
        tl.store(v_cache_ptr + new_at, v_new.to(v_cache_ptr.dtype.element_ty),
                 mask=d_ok & writes_new)
        tl.debug_barrier()
    if SPLITS > 1:
        # A split past the last returns here, its prologue's loads issued beside the others'
        # (returning before them would put them behind the split's arithmetic).
        if lo >= hi:
            return

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_M,), 0, dtype=tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0, dtype=tl.float32)
    # Keys past the last row's own position are masked for every row: stop there.
    end = tl.minimum(hi, ctx_len - q_len + first + BLOCK_M // GROUP)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start in tl.range(lo, end, BLOCK_N, num_stages=STAGES):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_offsets = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if V_EARLY:
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, ops.max_(scores, axis=1))
        # A row with no key yet keeps m = -inf; subtract 0 there instead (exp(-inf) = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + ops.sum_(p, axis=1)
        if not V_EARLY:
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out_at = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head \
        + d[None, :]
    out_mask = row_ok[:, None] & d_ok[None, :]
    gate_at = gate_ptr + token[:, None] * stride_gate_token + head[:, None] * stride_gate_head \
        + d[None, :]
    if SPLITS > 1:
        if n_split > 1:
            merge_splits(acc, m_i, l_i, partial_ptr, counter_ptr,
                         seq * tl.num_programs(1) + kv_head, n_split, out_at, out_mask,
                         gate_at, SPLITS, BLOCK_M, BLOCK_D, GATE)
        else:
            store_rows(out_at, acc, l_i, out_mask, gate_at, GATE)
    else:
        store_rows(out_at, acc, l_i, out_mask, gate_at, GATE)


@triton.jit
def store_rows(out_at, acc, l_i, out_mask, gate_at, GATE: tl.constexpr):
    """The attention rows: the accumulated values over their sums (0 for a row with no
    key), in the output's dtype; with GATE times sigmoid(gate), each rounded to that dtype
    as the torch steps round them."""
    dtype = out_at.dtype.element_ty
    rows = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(dtype)
    if GATE:
        gate = ops.sigmoid(tl.load(gate_at, mask=out_mask, other=0.0).to(tl.float32))
        rows = (rows.to(tl.float32) * gate.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_at, rows, mask=out_mask)


@triton.jit
def merge_splits(acc, m_i, l_i, partial_ptr, counter_ptr, pair, n_split, out_at, out_mask,
                 gate_at, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 GATE: tl.constexpr):
    """One split of a decode (`decode_split`) leaves its unnormalised rows `acc`, maxima
    and sums at its place of the (sequence, KV head) `pair`'s workspace; the last of the
    pair's splits to finish (the pair's counter) merges all of them in split order, so the
    bits do not depend on which that is, writes the rows and sets the counter back to 0."""
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_at = partial_ptr + (pair.to(tl.int64) * SPLITS * BLOCK_M + rows) * (BLOCK_D + 2)
    split_stride = BLOCK_M * (BLOCK_D + 2)
    mine = row_at + tl.program_id(2) * split_stride
    tl.store(mine[:, None] + d[None, :], acc)
    tl.store(mine + BLOCK_D, m_i)
    tl.store(mine + BLOCK_D + 1, l_i)
    tl.debug_barrier()   # every thread's part is written before the count says so
    if tl.atomic_add(counter_ptr + pair, 1, sem="acq_rel", scope="gpu") == n_split - 1:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.full((BLOCK_M,), 0, dtype=tl.float32)
        acc = tl.full((BLOCK_M, BLOCK_D), 0, dtype=tl.float32)
        for split in range(0, n_split):
            at = row_at + split * split_stride
            m_s = tl.load(at + BLOCK_D, cache_modifier=".cg")
            m_new = tl.maximum(m_i, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            beta = tl.exp(m_s - m_safe)
            l_i = l_i * alpha + tl.load(at + BLOCK_D + 1, cache_modifier=".cg") * beta
            acc = acc * alpha[:, None] + tl.load(at[:, None] + d[None, :],
                                                 cache_modifier=".cg") * beta[:, None]
            m_i = m_new
        store_rows(out_at, acc, l_i, out_mask, gate_at, GATE)
        tl.atomic_xchg(counter_ptr + pair, 0)


@triton.jit
def decode_split(ctx_len, split, SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr):
    """(splits, first position, end) of program `split` of a decode over `ctx_len`
    positions: each split takes the same whole number of SPLIT_MIN-position units, as few
    as make at most SPLITS splits; the range is empty for a split past the last. Shifts
    only before the range (SPLITS and SPLIT_MIN are powers of two); a function of the
    context alone, so a sequence's bits do not depend on its batch."""
    units = (ctx_len + SPLIT_MIN - 1) // SPLIT_MIN
    chunk = (units + SPLITS - 1) // SPLITS * SPLIT_MIN
    lo = split * chunk
    return (ctx_len + chunk - 1) // chunk, lo, tl.minimum(lo + chunk, ctx_len)
