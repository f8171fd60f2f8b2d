"""Triton kernels for routed experts with 16-bit (or float32) weights, or block-FP8 weights
dequantized in registers: a grouped GEMM over (token, slot) pairs sorted by expert into
blocks of BLOCK_M (`freetoken.kernels.moe_align`), pair p = token * top_k + slot. Products
accumulate in float32.

Block FP8 (SCALE > 0): weight element (n, k) of expert e is its e4m3 code times
`scale[e, scale_row[n], (k + col_offset) // BLOCK_COLS]`; `scale_row` maps each TP-local row
to its scale row (gate and up segments, the shard's offset inside its first block), and
`col_offset` is the shard's offset inside its first column block (ranks sharing a block).
SCALE 1: every K step lies inside one column block, so the scale multiplies the step's dot
(one value per output column); SCALE 2: each weight element is scaled before the dot (any
block size and offset). The codes are exact in the activations' dtype.

- `gate_up_kernel`: program (block, columns) computes a tile of gate and the matching tile of
  up for its block's pairs and writes h = SiLU(gate) * up, rounded once to h's dtype.
- `down_kernel`: program (block, columns, chunk) computes a tile of h W_down^T over one
  chunk of the inputs for its block's pairs, times each pair's routing weight, and writes it
  in float32 (the launcher sums each token's slots in float32 and rounds once, as the torch
  reference does). One chunk of every input is the whole product; the `tp_invariant` mode
  launches the model's canonical chunks, one float32 leaf each.
Blocks whose expert is -1 (the unused tail of the upper-bound grid) return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def _scaled_dot(a, w, s_cols, acc, k0, ks, col_offset, w_mask, SCALE: tl.constexpr,
                BLOCK_COLS: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a . (codes w [BLOCK_K, BLOCK_N] of inputs `ks` from `k0` times their block
    scales), `s_cols` [BLOCK_N] the scale row pointers of the tile's output columns (see the
    module docstring for `col_offset`)."""
    if SCALE == 1:
        step = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        return acc + step * tl.load(s_cols + (k0 + col_offset) // BLOCK_COLS)[None, :]
    scale = tl.load(s_cols[None, :] + ((ks + col_offset) // BLOCK_COLS)[:, None],
                    mask=w_mask, other=0.0)
    return tl.dot(a, (w.to(tl.float32) * scale).to(a.dtype), acc, input_precision=PRECISION)


@triton.jit
def gate_up_kernel(
    # pointers
    x_ptr,
    w13_ptr,
    h_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,              # block FP8: [E, scale rows, scale columns] float32
    scale_row_ptr,          # block FP8: [2 * inter] int32, each w13 row's scale row
    # sizes
    num_pairs,
    hidden,
    inter,
    top_k,
    col_offset,
    # strides
    stride_x_token,
    stride_w13_expert,
    stride_w13_row,
    stride_h_pair,
    stride_scale_expert,
    stride_scale_row,
    # meta
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, inter + n]) for the
    BLOCK_M pairs of block program_id(0) and BLOCK_N columns n of program_id(1)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    token = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w = w13_ptr + expert.to(tl.int64) * stride_w13_expert
    if SCALE > 0:
        s = scale_ptr + expert.to(tl.int64) * stride_scale_expert
        s_gate = s + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_scale_row
        s_up = s + tl.load(scale_row_ptr + inter + cols, mask=col_ok, other=0) * \
            stride_scale_row
    gate = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.float32)
    up = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x_token + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_w13_row + ks[:, None], mask=w_mask,
                         other=0.0)
        w_up = tl.load(w + (cols + inter)[None, :] * stride_w13_row + ks[:, None], mask=w_mask,
                       other=0.0)
        if SCALE == 0:
            gate = tl.dot(a, w_gate, gate, input_precision=PRECISION)
            up = tl.dot(a, w_up, up, input_precision=PRECISION)
        else:
            gate = _scaled_dot(a, w_gate, s_gate, gate, k0, ks, col_offset, w_mask,
                               SCALE, BLOCK_COLS, PRECISION)
            up = _scaled_dot(a, w_up, s_up, up, k0, ks, col_offset, w_mask, SCALE,
                             BLOCK_COLS, PRECISION)
    h = gate * ops.sigmoid(gate) * up
    tl.store(h_ptr + pairs.to(tl.int64)[:, None] * stride_h_pair + cols[None, :],
             h.to(h_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def down_kernel(
    # pointers
    h_ptr,
    w2_ptr,
    weights_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,              # block FP8: [E, scale rows, scale columns] float32
    scale_row_ptr,          # block FP8: [hidden] int32, each w2 row's scale row
    # sizes
    num_pairs,
    hidden,
    k_chunk,
    col_offset,
    # strides
    stride_h_pair,
    stride_w2_expert,
    stride_w2_row,
    stride_out_chunk,
    stride_out_pair,
    stride_scale_expert,
    stride_scale_row,
    # meta
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[c, pair, n] = weight[pair] * (h[pair] . w2[e, n]) over the inputs of chunk c in
    float32 for the BLOCK_M pairs of block program_id(0), BLOCK_N output columns n of
    program_id(1) and chunk c = program_id(2) of `k_chunk` inputs (one chunk of all of
    them: the whole product)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w2_ptr + expert.to(tl.int64) * stride_w2_expert
    if SCALE > 0:
        s_rows = (scale_ptr + expert.to(tl.int64) * stride_scale_expert
                  + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_scale_row)
    chunk = tl.program_id(2)
    k_begin = chunk * k_chunk
    k_end = k_begin + k_chunk
    acc = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        a = tl.load(h_ptr + pairs[:, None] * stride_h_pair + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(w + cols[None, :] * stride_w2_row + ks[:, None], mask=b_mask, other=0.0)
        if SCALE == 0:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            acc = _scaled_dot(a, b, s_rows, acc, k0, ks, col_offset, b_mask, SCALE,
                              BLOCK_COLS, PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    out = out_ptr + chunk.to(tl.int64) * stride_out_chunk + pairs[:, None] * stride_out_pair
    tl.store(out + cols[None, :], acc * weight[:, None],
             mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def route_kernel(
    # pointers
    logits_ptr,
    weights_ptr,
    ids_ptr,
    # sizes
    num_experts,
    # strides
    stride_logits_token,
    # meta
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Token program_id(0): softmax of its router logits in float32, its TOP_K largest
    probabilities in descending order (the lowest index first among equals), optionally
    renormalised to sum to one, stored in weights' dtype with their expert ids (int64)."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    ok = experts < num_experts
    x = tl.load(logits_ptr + token * stride_logits_token + experts, mask=ok,
                other=float("-inf")).to(tl.float32)
    p = tl.exp(x - ops.max_(x, axis=0))
    p = tl.where(ok, p, 0.0)
    p = p / ops.sum_(p, axis=0)
    left = tl.where(ok, p, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.full((BLOCK_K,), 0, dtype=tl.float32)
    chosen_ids = tl.full((BLOCK_K,), 0, dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = ops.max_(left, axis=0)
        index = ops.min_(tl.where(left == best, experts, BLOCK_E), axis=0)
        chosen = tl.where(slots == j, best, chosen)
        chosen_ids = tl.where(slots == j, index.to(tl.int64), chosen_ids)
        left = tl.where(experts == index, -1.0, left)
    if RENORMALIZE:
        chosen = chosen / ops.sum_(chosen, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen.to(weights_ptr.dtype.element_ty),
             mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


@triton.jit
def align_kernel(
    # pointers
    ids_ptr,
    rows_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    num_blocks,
    expert_blocks,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TAIL_ROWS: tl.constexpr,
    TAIL_BLOCKS: tl.constexpr,
):
    """Program e, one per expert: the layout of `moe_align.align_by_expert` (pairs sorted by
    expert, stably, each expert's run padded to BLOCK_M rows; unused rows hold num_pairs,
    unused blocks expert -1). Every program counts all pairs by expert (a histogram of the
    BLOCK_P <= 1024 pairs), so it knows where expert e's run starts, then writes that run:
    its pairs in order (ranks from a prefix sum of `ids == e`), the run's padding rows and
    its blocks' expert. The rows and blocks past the last run are cut into one slice per
    program (TAIL_ROWS rows, TAIL_BLOCKS blocks). Runs and slices are disjoint, so no
    program waits for another."""
    e = tl.program_id(0)
    pairs = tl.arange(0, BLOCK_P)
    ok = pairs < num_pairs
    # Padding lanes count into the last bin and are taken out of it again.
    ids = tl.load(ids_ptr + pairs, mask=ok, other=BLOCK_E - 1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E)
    counts -= tl.where(experts == BLOCK_E - 1, BLOCK_P - num_pairs, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = ops.cumsum(padded, axis=0)
    total = ops.sum_(padded, axis=0)
    this = experts == e
    count = ops.sum_(tl.where(this, counts, 0), axis=0)
    run = ops.sum_(tl.where(this, padded, 0), axis=0)
    first = ops.sum_(tl.where(this, ends, 0), axis=0) - run
    mine = ok & (ids == e)
    rank = ops.cumsum(mine.to(tl.int32), axis=0) - 1
    tl.store(rows_ptr + first + rank, pairs.to(tl.int32), mask=mine)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(rows_ptr + first + pad, tl.full((BLOCK_M,), 0, dtype=tl.int32) + num_pairs,
             mask=pad < run)
    for b0 in range(0, expert_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert_ptr + first // BLOCK_M + blocks,
                 tl.full((BLOCK_B,), 0, dtype=tl.int32) + e, mask=blocks * BLOCK_M < run)
    rows = e * TAIL_ROWS + tl.arange(0, TAIL_ROWS)
    tl.store(rows_ptr + rows, tl.full((TAIL_ROWS,), 0, dtype=tl.int32) + num_pairs,
             mask=(rows >= total) & (rows < num_blocks * BLOCK_M))
    blocks = e * TAIL_BLOCKS + tl.arange(0, TAIL_BLOCKS)
    tl.store(block_expert_ptr + blocks, tl.full((TAIL_BLOCKS,), -1, dtype=tl.int32),
             mask=(blocks * BLOCK_M >= total) & (blocks < num_blocks))
