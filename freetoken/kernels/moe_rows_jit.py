"""The routed experts of one token without tensor cores (`gate_up_rows_kernel`,
`down_rows_kernel`), for the batch-1 decode step: `moe_jit`'s grouped kernels give each of
the token's top_k pairs a 16-row dot tile of its own (15 rows of padding) and at least 16
output features per program, so the launch has few programs and most of their work is
padding; here a program holds any number of output features (1, 2, 4, ...) of one token,
widens its weights to float32 and multiplies them elementwise with the input, so an expert
of a few hundred rows still fills the GPU. The slots' expert ids are read where the router
wrote them (int64 [1, top_k]), so nothing is sorted or cast first; each is a valid expert
(a token's top-k: no -1 such as the grouped layout's unused blocks carry).

Each program computes one dot of ROWS weight rows (`_row_dots`): the products of every step
are added elementwise into a [ROWS, BLOCK_K] float32 tile and reduced along the inputs once.
The steps (STEPS, a constexpr) are unrolled and nothing between the loads synchronises the
program's threads, so all of its weight loads are in flight before the first sum (a sum per
step, or per slot, waits for the threads to exchange partial sums before the next loads).
Every program's order of additions is fixed, so a launch gives the same bits each time
(graph replay equals eager).

Block FP8 (SCALE > 0): weight element (n, k) of expert e is its e4m3 code times
`scale[e, scale_row[n], (k + col_offset) // BLOCK_COLS]`, as in `moe_jit`. SCALE 1: every K
step lies inside one column block (BLOCK_K divides BLOCK_COLS and col_offset), so each row
loads one scale per step; SCALE 2: each weight element loads its own (any block size and
offset). The scale multiplies the float32 product (`moe_jit` multiplies SCALE 1's step dot,
and rounds SCALE 2's scaled weight to the activations' dtype for its dot).

- `gate_up_rows_kernel`: grid (top_k, features): program (slot, block) computes BLOCK_N gate
  features and the matching up features of h[slot] = SiLU(gate) * up over the whole hidden
  size (rows [gate | up] of one dot), in float32, rounded once to h's dtype as
  `gate_up_kernel` rounds it.
- With SHARED, the MoE block's shared expert is one more slot of both launches (the layer
  at one token: two launches where the shared expert's two projections and the separate
  combine took three more). Beside block-FP8 experts the shared expert is block FP8 too,
  with scales of its own: the gate/up launch selects its scale pointers as it selects its
  weights (same SCALE mode, column block and offset 0: both read the whole hidden size), and
  the down launch's shared dot takes its own mode (SHARED_SCALE) and column offset.
  `gate_up_rows_kernel`'s grid has top_k + 1 slots; the last reads the shared gate/up rows
  (its own length, shared_inter, may differ from inter) into shared_h, and its first program
  also computes the sigmoid gate of the block's input, rounded as the engine's separate
  steps round it (the gate's dot, then its sigmoid, to h's dtype), into `gate_ptr` (float32
  [1]). `down_rows_kernel` adds, after the routed sum (SUM_SLOTS), the shared down
  projection of shared_h times that gate, with the rounding chain of
  `gemv.moe_combine_kernel` (routed sum, shared output and gated shared each rounded to
  out's dtype before the last addition).
- With RESIDUAL (summed slots, TP 1: no all-reduce between the block and the decoder
  layer's residual add), `down_rows_kernel` stores residual + the block's rounded output,
  rounded as the separate add rounds it.
- `down_rows_kernel`: grid (features,): program (block) computes BLOCK_N outputs n of every
  slot (rows (slot, n) of one dot), weight[s] * (h[s] . w2[e_s, n]) in float32, and either
  adds the slots in slot order and stores the sum rounded once to out's dtype (SUM_SLOTS:
  the torch path's float32 sum of the slots, with no second launch) or stores each slot's
  float32 value. The slots stay in one program rather than on a grid axis: their sum then
  needs no second launch and no atomics (whose order would vary between launches), and
  hidden / BLOCK_N programs already fill the GPU (512 at 2048 outputs and 4 per program).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def _row_dots(x_rows, w_rows, s_rows, length, col_offset, row_ok,
              SCALE: tl.constexpr, BLOCK_COLS: tl.constexpr, EVEN_K: tl.constexpr,
              STEPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [ROWS]: row r's input (`x_rows` [ROWS, 1] pointers) . its weight row
    (`w_rows` [ROWS, 1]) over `length` inputs in STEPS steps, with the row's block scales
    (`s_rows` [ROWS]: its scale row, SCALE > 0); rows past `row_ok` give 0."""
    acc = tl.full([ROWS, BLOCK_K], 0, dtype=tl.float32)
    for step in tl.static_range(STEPS):
        k0 = step * BLOCK_K
        ks = (k0 + tl.arange(0, BLOCK_K))[None, :]
        if EVEN_K:
            w_mask = row_ok[:, None]
            xv = tl.load(x_rows + ks)
        else:
            w_mask = row_ok[:, None] & (ks < length)
            xv = tl.load(x_rows + ks, mask=ks < length, other=0.0)
        w = tl.load(w_rows + ks, mask=w_mask, other=0.0)
        prod = w.to(tl.float32) * xv.to(tl.float32)
        if SCALE == 2:
            prod *= tl.load(s_rows[:, None] + (ks + col_offset) // BLOCK_COLS, mask=w_mask,
                            other=0.0)
        elif SCALE == 1:
            prod *= tl.load(s_rows + (k0 + col_offset) // BLOCK_COLS, mask=row_ok,
                            other=0.0)[:, None]
        acc += prod
    return ops.sum_(acc, axis=1)


@triton.jit
def _pick(values, index, i):
    """Row `i` of `values` [R, C] as [C], exactly (the other rows add zeros); `index` [R, 1]
    each row's index."""
    return ops.sum_(tl.where(index == i, values, 0.0), axis=0)


@triton.jit
def gate_up_rows_kernel(
    # pointers
    x_ptr,                  # [1, hidden] the token
    w13_ptr,                # [E, 2 * inter, hidden] gate rows, then up rows
    h_ptr,                  # [top_k, inter] out, x's dtype
    ids_ptr,                # [1, top_k] expert ids (int64)
    scale_ptr,              # block FP8: [E, scale rows, scale columns] float32
    scale_row_ptr,          # block FP8: [2 * inter] int32, each w13 row's scale row
    shared_w13_ptr,         # SHARED: [2 * shared_inter, hidden], gate rows, then up rows
    shared_h_ptr,           # SHARED: [shared_inter] out, x's dtype
    gate_weight_ptr,        # SHARED: [hidden] the shared expert's sigmoid gate
    gate_ptr,               # SHARED: [1] out, float32: the rounded sigmoid gate
    shared_scale_ptr,       # SHARED, block FP8: [scale rows, scale columns] float32
    shared_scale_row_ptr,   # SHARED, block FP8: [2 * shared_inter] int32
    # sizes
    hidden,
    inter,
    col_offset,
    top_k,
    shared_inter,
    # strides
    stride_ids_slot,
    stride_w13_expert,
    stride_w13_row,
    stride_h_slot,
    stride_scale_expert,
    stride_scale_row,
    stride_shared_row,
    stride_shared_scale_row,
    # meta
    SHARED: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN_K: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[s, n] = silu(x . w13[e_s, n]) * (x . w13[e_s, inter + n]) for slot s =
    program_id(0), its expert e_s = ids[s], and the BLOCK_N features n of block
    program_id(1): rows [gate features | up features] of one dot. SHARED: slot top_k is
    the shared expert (its rows, length and output), and program (top_k, 0) also stores
    the gate."""
    slot = tl.program_id(0)
    routed = slot < top_k
    expert = tl.load(ids_ptr + slot * stride_ids_slot, mask=routed, other=0).to(tl.int64)
    w_base = w13_ptr + expert * stride_w13_expert
    row_stride = stride_w13_row
    length = inter
    h_row = h_ptr + slot * stride_h_slot
    if SHARED:
        # The shared slot's pointers and length are selected, not branched to: both are
        # valid addresses, and the program's loads stay one straight sequence.
        w_base = tl.where(routed, w_base, shared_w13_ptr)
        row_stride = tl.where(routed, row_stride, stride_shared_row)
        length = tl.where(routed, length, shared_inter)
        h_row = tl.where(routed, h_row, shared_h_ptr)
    r = tl.arange(0, 2 * BLOCK_N)
    half = r // BLOCK_N
    cols = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    row_ok = cols < length
    rows = cols + half * length
    w_rows = w_base + rows.to(tl.int64)[:, None] * row_stride
    s_rows = scale_ptr
    if SCALE > 0:
        s_base = scale_ptr + expert * stride_scale_expert
        s_index = scale_row_ptr
        s_stride = stride_scale_row
        if SHARED:
            # A block-FP8 shared slot reads its own scales, at the same column offset (0).
            s_base = tl.where(routed, s_base, shared_scale_ptr)
            s_index = tl.where(routed, s_index, shared_scale_row_ptr)
            s_stride = tl.where(routed, s_stride, stride_shared_scale_row)
        s_rows = s_base + tl.load(s_index + rows, mask=row_ok, other=0) * s_stride
    # The input is read per row, so that it takes the weight tile's register layout rather
    # than being moved into it through shared memory at every step.
    x_rows = x_ptr + tl.full([2 * BLOCK_N, 1], 0, dtype=tl.int32)
    both = tl.reshape(_row_dots(x_rows, w_rows, s_rows, hidden, col_offset, row_ok, SCALE,
                                BLOCK_COLS, EVEN_K, STEPS, 2 * BLOCK_N, BLOCK_K),
                      [2, BLOCK_N])
    index = tl.arange(0, 2)[:, None]
    gate = _pick(both, index, 0)
    up = _pick(both, index, 1)
    h = gate * ops.sigmoid(gate) * up
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_row + out_cols, h.to(h_ptr.dtype.element_ty), mask=out_cols < length)
    if SHARED:
        if (slot == top_k) & (tl.program_id(1) == 0):
            one = tl.full([1], 1, dtype=tl.int1)
            g_rows = gate_weight_ptr + tl.full([1, 1], 0, dtype=tl.int32)
            dot = _row_dots(x_ptr + tl.full([1, 1], 0, dtype=tl.int32), g_rows, scale_ptr,
                            hidden, 0, one, 0, BLOCK_COLS, EVEN_K, STEPS, 1, BLOCK_K)
            dtype = h_ptr.dtype.element_ty
            sig = ops.sigmoid(dot.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            tl.store(gate_ptr + tl.arange(0, 1), sig)


@triton.jit
def down_rows_kernel(
    # pointers
    h_ptr,                  # [top_k, inter] SiLU(gate) * up of each slot
    w2_ptr,                 # [E, hidden, inter]
    weights_ptr,            # [1, top_k] routing weights
    ids_ptr,                # [1, top_k] expert ids (int64)
    out_ptr,                # SUM_SLOTS: [1, hidden] x's dtype; else [top_k, hidden] float32
    scale_ptr,              # block FP8: [E, scale rows, scale columns] float32
    scale_row_ptr,          # block FP8: [hidden] int32, each w2 row's scale row
    shared_h_ptr,           # SHARED: [shared_inter] the shared expert's SiLU(gate) * up
    shared_w2_ptr,          # SHARED: [hidden, shared_inter]
    gate_ptr,               # SHARED: [1] float32, the rounded sigmoid gate
    residual_ptr,           # RESIDUAL: [1, hidden] added to the sum
    shared_scale_ptr,       # SHARED_SCALE > 0: [scale rows, scale columns] float32
    shared_scale_row_ptr,   # SHARED_SCALE > 0: [hidden] int32, each shared w2 row's scale row
    # sizes
    hidden,
    inter,
    col_offset,
    shared_inter,
    shared_col_offset,
    # strides
    stride_ids_slot,
    stride_weights_slot,
    stride_h_slot,
    stride_w2_expert,
    stride_w2_row,
    stride_out_slot,
    stride_scale_expert,
    stride_scale_row,
    stride_shared_row,
    stride_shared_scale_row,
    # meta
    TOP_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SUM_SLOTS: tl.constexpr,
    SHARED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN_K: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHARED_SCALE: tl.constexpr,
    SHARED_EVEN_K: tl.constexpr,
    SHARED_STEPS: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr,
):
    """For the BLOCK_N outputs n of block program_id(0) and every slot s (expert e_s =
    ids[s]): weight[s] * (h[s] . w2[e_s, n]) in float32, one dot of BLOCK_S x BLOCK_N rows
    (BLOCK_S: TOP_K to a power of two); added over s = 0, 1, ... in that order and stored
    rounded to out's dtype (SUM_SLOTS), or stored per slot at out[s]. RESIDUAL (with
    SUM_SLOTS): the rounded sum plus residual, rounded again (the decoder layer's add)."""
    r = tl.arange(0, BLOCK_S * BLOCK_N)
    # Padding slots read slot 0's expert and input; their weight rows are masked off.
    slot = tl.where(r // BLOCK_N < TOP_K, r // BLOCK_N, 0)
    cols = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    row_ok = (r // BLOCK_N < TOP_K) & (cols < hidden)
    expert = tl.load(ids_ptr + slot * stride_ids_slot).to(tl.int64)
    w_rows = w2_ptr + expert[:, None] * stride_w2_expert + cols.to(tl.int64)[:, None] * \
        stride_w2_row
    s_rows = scale_ptr
    if SCALE > 0:
        s_rows = (scale_ptr + expert * stride_scale_expert
                  + tl.load(scale_row_ptr + cols, mask=row_ok, other=0) * stride_scale_row)
    x_rows = h_ptr + slot[:, None] * stride_h_slot
    weight = tl.load(weights_ptr + slot * stride_weights_slot).to(tl.float32)
    values = _row_dots(x_rows, w_rows, s_rows, inter, col_offset, row_ok, SCALE, BLOCK_COLS,
                       EVEN_K, STEPS, BLOCK_S * BLOCK_N, BLOCK_K) * weight
    if SUM_SLOTS:
        out_cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ok = out_cols < hidden
        if SHARED:
            shared_rows = shared_w2_ptr + out_cols.to(tl.int64)[:, None] * stride_shared_row
            shared_s_rows = shared_scale_ptr
            if SHARED_SCALE > 0:
                shared_s_rows = shared_scale_ptr + tl.load(
                    shared_scale_row_ptr + out_cols, mask=out_ok, other=0) * \
                    stride_shared_scale_row
            shared = _row_dots(shared_h_ptr + tl.full([BLOCK_N, 1], 0, dtype=tl.int32),
                               shared_rows, shared_s_rows, shared_inter, shared_col_offset,
                               out_ok, SHARED_SCALE, BLOCK_COLS, SHARED_EVEN_K, SHARED_STEPS,
                               BLOCK_N, SHARED_BLOCK_K)
        per_slot = tl.reshape(values, [BLOCK_S, BLOCK_N])
        index = tl.arange(0, BLOCK_S)[:, None]
        total = tl.full([BLOCK_N], 0, dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            total += _pick(per_slot, index, s)
        dtype = out_ptr.dtype.element_ty
        if SHARED:
            gate = tl.load(gate_ptr)
            gated = (gate * shared.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            total = total.to(dtype).to(tl.float32) + gated
        if RESIDUAL:
            residual = tl.load(residual_ptr + out_cols, mask=out_ok, other=0.0)
            total = total.to(dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + out_cols, total.to(dtype), mask=out_ok)
    else:
        tl.store(out_ptr + slot * stride_out_slot + cols, values, mask=row_ok)
