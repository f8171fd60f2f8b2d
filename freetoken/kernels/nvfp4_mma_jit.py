"""Tensor-core NVFP4 decode kernels for 16-bit activations on CUDA GPUs (W4A16: weights
decoded in registers, fp16 or bf16 products accumulated in float32 by `mma.m16n8k16`). The
launchers are in `freetoken.kernels.nvfp4_launch`; docs/performance.md has the instruction
counts and timings that motivate this design.

Why: on CUDA cores (`nvfp4_decode_jit`) turning a nibble into a float32 costs several
instructions per weight; here a warp's `mma` consumes 256 weights per instruction and a weight
becomes an fp16 value in about one and a half. float32 activations keep the CUDA-core kernels
(products exact in float32); these serve bf16 and fp16 ones.

Fragments. A warp computes a 16-row tile of the output; lane (g, t) = (lane / 4, lane % 4)
holds rows g and g + 8. The mma's K order within a 16-input step is free as long as A
(weights) and B (activations) agree, so each lane takes 8 *consecutive* inputs of its two
rows per int32 word, straight from the checkpoint's bytes (no repacked copy of the weights):
a chunk of 32 V inputs gives lane t the words t V .. t V + V - 1 of each row, and every word
is one inside one 16-input scale group. Of a word's bytes b0..b3 (element 2j in the low
nibble of b_j) the decoder builds four fp16 pairs, inputs (0, 4), (2, 6), (1, 5) and
(3, 7): two mma steps per word. The activations are stored in that order by
`to_fragments`, fp16, scaled per token by a power of two that keeps them in fp16's range:
exact for bf16 inputs down to 2^-29 of the row's largest magnitude (fp16 keeps 11
significant bits, bf16 has 8; smaller ones lose bits as fp16 subnormals).

Decode. An e2m1 code `s e1 e0 m` at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14
exactly (codes 0 and 1 on subnormals). A word's high nibbles are placed for both pairs they
feed by one bit-select of the word and the word shifted right by 3 (signs from the first,
magnitudes from the second), then a mask (and a shift by 8 for the even bytes); the low
nibbles likewise after a shift by 4. The block scale pair of rows (g, g + 8) converts with
`cvt.rn.f16x2.e4m3x2` and is multiplied by 2^7, so that e2m1 * 2^-14 * e4m3 * 2^7 (at most 6
significant bits, between 2^-17 and 21) is exact in fp16. bf16 operands (down on gate_up's
h): the code at bf16 bits 15 and 8..6 is e2m1 * 2^-126 exactly (codes 0 and 1 on
subnormals); sign and magnitude are 6 bits apart for every nibble, so one bit-select of the
word and the word shifted right by 6 places the odd bytes' nibbles (the low ones after a
shift by 4), and one of the word shifted left by 8 and by 2 the even bytes'. The scales
become e4m3 * 2^100 in bf16 (through fp16 and float32, exact), so that the products are
normal bf16 numbers (2^-36 .. 2^-15), exact, and the sums are multiplied by 2^26.

h between gate_up and down: gate_up stores h (already times the routing weight and down's
global scale) as bf16 fragments, rounded to nearest even (8 significant bits, as the
model's own h and the prefill kernels'; bf16 needs no scale, so no program waits for
another), and down, whose weights then decode to bf16, walks all of a token's slots as one
float32 dot product.

Registers. The weight bytes in flight, what a decode launch is bound by, are the warps an SM
runs times the two steps each loads ahead, and registers bound the warps. So a lane's V word
positions of a chunk are one PTX block chained through one accumulator (4 float32 per gate
or up, not 4 V), the token's fragments load in the step that uses them (every warp reads
the same row: L1 hits; only the weights run ahead), and launches with whole row tiles,
whole chunks and an even K split load without masks.

Launches (PDL). On sm_90+ gate_up and down are launched with programmatic dependent launch
and every kernel here lets the next one launch as it starts (`launch_next`): a kernel's
programs then start while the previous kernel finishes, load their first two steps of
weights, and wait (`grid_wait`) before they read the activations or h or write anything.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.jit_ops import max_
from freetoken.kernels.nvfp4_mma_ops_jit import (
    BF16_OUT,
    b_tile,
    bf16_bits,
    exp2i,
    frag_pos,
    grid_wait,
    lanes,
    launch_next,
    mma,
    rows_tile,
    tile_sum,
)

FP16_MAX_EXP = tl.constexpr(15)
"""Activations are scaled by 2^-e so that their largest magnitude is below 2^15."""
W_BIAS_EXP = tl.constexpr(7)
"""Decoded weights are e2m1 * e4m3 * 2^-7: outputs are multiplied by 2^(7 + e)."""


@triton.jit
def _exponent(amax):
    """e with amax * 2^-e < 2^15 (and >= 2^14 for amax > 0, unless amax < 2^-86, where e stops
    at -100 so that 2^-e stays a float32); 0 for amax == 0."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 1 - FP16_MAX_EXP
    return tl.where(amax > 0, tl.maximum(e, -100), 0)


@triton.jit
def to_fragments(
    # pointers
    x_ptr,                  # [tokens, >= k_inputs] activations
    x16_ptr,                # [tokens, padded k_inputs] fp16 fragments (out)
    xf_ptr,                 # [tokens] float32 factor that undoes the scaling (out)
    # sizes
    k_inputs,
    # strides
    stride_x_token,
    stride_x16_token,
    # meta-parameters
    V: tl.constexpr,        # words per lane and chunk (a chunk is 32 V inputs)
    BLOCK: tl.constexpr,    # >= the padded row length, a power of two
    PDL: tl.constexpr = 0,  # let the next kernel launch early
):
    """Each program computes one token's row: x as fp16 fragments (`frag_pos`) scaled by
    2^-e, e per row, and xf[t] = 2^(7 + e), which undoes both biases. Inputs past k_inputs up
    to the row's padded length are zeros."""
    launch_next(PDL)
    token = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + token.to(tl.int64) * stride_x_token + k, mask=k < k_inputs, other=0.0)
    x = x.to(tl.float32)
    e = _exponent(max_(tl.abs(x), 0))
    padded = (k_inputs + 32 * V - 1) // (32 * V) * (32 * V)
    tl.store(x16_ptr + token.to(tl.int64) * stride_x16_token + frag_pos(k, V),
             (x * exp2i(-e)).to(tl.float16), mask=k < padded)
    tl.store(xf_ptr + token, exp2i(e + W_BIAS_EXP))


@triton.jit
def _gate_up_load(expert, rows, intermediate, step, split, lane_t, k_words, V: tl.constexpr,
                  S: tl.constexpr, FULL: tl.constexpr):
    """Gate rows and up rows of `step` (chunk step S + split), and the chunk; `expert` =
    (w_ptr, w_scale_ptr, stride_w_row, stride_scale_row) of the pair's expert. FULL: every
    step of the warps is a whole chunk of whole row tiles, and the loads ahead of the last
    step re-read the last chunk (never used) instead of being masked."""
    w_ptr, w_scale_ptr, stride_w_row, stride_scale_row = expert
    chunk = step * S + split
    if FULL:
        chunk = tl.minimum(chunk, k_words // (4 * V) - 1)
    live = lane_t >= 0
    gate = rows_tile(w_ptr, w_scale_ptr, expert_words=0, expert_bytes=0, rows=rows,
                     rows_end=intermediate, live=live, chunk=chunk, lane_t=lane_t,
                     k_words=k_words, stride_w_row=stride_w_row,
                     stride_scale_row=stride_scale_row, V=V, FULL=FULL)
    up = rows_tile(w_ptr, w_scale_ptr, expert_words=intermediate * stride_w_row,
                   expert_bytes=intermediate * stride_scale_row, rows=rows,
                   rows_end=intermediate, live=live, chunk=chunk, lane_t=lane_t,
                   k_words=k_words, stride_w_row=stride_w_row,
                   stride_scale_row=stride_scale_row, V=V, FULL=FULL)
    return gate, up, chunk


@triton.jit
def _gate_up_step(acc_gate, acc_up, loaded, x16_row_ptr, lane_t, k_words, V: tl.constexpr,
                  NW: tl.constexpr, ASM: tl.constexpr, FULL: tl.constexpr):
    """The gate and up mma of a loaded step. The token's fragments load here, not with the
    weights two steps ahead: every warp of the SM reads the same row (L1), and registers
    held across steps are what limits the warps an SM runs."""
    b = b_tile(x16_row_ptr, loaded[2], lane_t, lane_t >= 0, k_words, V, FULL)
    return mma(acc_gate, loaded[0], b, NW, ASM), mma(acc_up, loaded[1], b, NW, ASM)


@triton.jit
def gate_up_mma(
    # pointers
    x16_ptr,                # [tokens, padded hidden] fp16 fragments (`to_fragments`)
    xf_ptr,                 # [tokens] float32 factor of the fragments
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    topk_weights_ptr,       # [pairs] routing weights
    w_ptr,                  # [experts, 2 * intermediate, k_words] int32 words (gate, up rows)
    w_scale_ptr,            # [experts, 2 * intermediate, k_words / 2] e4m3 bytes
    gate_up_global_ptr,     # [experts, 2] float32 (gate, up)
    down_global_ptr,        # [experts] float32
    h16_ptr,                # [pairs, padded intermediate] bf16 fragments (out)
    # sizes
    intermediate,
    k_words,
    top_k,
    # strides (w in int32 words, its scales in bytes, fragments in fp16 units)
    stride_x16_token,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_h16_pair,
    # meta-parameters
    V: tl.constexpr,        # words per lane and chunk
    TILES: tl.constexpr,    # 16-row tiles per program
    S: tl.constexpr,        # K split: warps per tile
    VH: tl.constexpr,       # words per lane and chunk of h's fragments (down's V)
    ASM: tl.constexpr,      # 1: PTX mma, 0: its emulation (interpreter)
    FULL: tl.constexpr,     # no masks: whole row tiles, whole chunks, even K split
    PDL: tl.constexpr = 0,  # programmatic dependent launch
):
    """Each program computes one (pair, block of 16 TILES rows) of h:
    h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) * topk_weights[p] * down_global[e] for
    pair p = (token t, slot) routed to expert e; its warps split K S ways. h is stored as
    bf16 fragments for down (`frag_pos` with VH words per lane). PDL: the first two steps'
    weights load before waiting for `to_fragments`."""
    launch_next(PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    lane_g, lane_t, tile, split = lanes(TILES * S, S)
    rows = tl.program_id(1) * (16 * TILES) + 16 * tile + lane_g
    w_expert_ptr = w_ptr.to(tl.pointer_type(tl.int32)) + expert * stride_w_expert
    scale_expert_ptr = w_scale_ptr + expert * stride_scale_expert
    x16_row_ptr = (x16_ptr.to(tl.pointer_type(tl.int64))
                   + token.to(tl.int64) * (stride_x16_token // 4))
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    acc_gate = (z, z, z, z)
    acc_up = (z, z, z, z)
    steps = ((k_words + 4 * V - 1) // (4 * V) + S - 1) // S
    # Loads run two steps ahead in three buffers that the loop body names (as in
    # nvfp4_decode_jit.gate_up_decode); Triton's own pipelining of these loads through
    # shared memory (tl.range num_stages) is slower (docs/performance.md).
    expert_w = (w_expert_ptr, scale_expert_ptr, stride_w_row, stride_scale_row)
    a = _gate_up_load(expert_w, rows, intermediate, step=0, split=split, lane_t=lane_t,
                      k_words=k_words, V=V, S=S, FULL=FULL)
    b = _gate_up_load(expert_w, rows, intermediate, step=1, split=split, lane_t=lane_t,
                      k_words=k_words, V=V, S=S, FULL=FULL)
    grid_wait(PDL)
    for j in range(0, steps - 2, 3):
        c = _gate_up_load(expert_w, rows, intermediate, step=j + 2, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, a, x16_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL)
        a = _gate_up_load(expert_w, rows, intermediate, step=j + 3, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, b, x16_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL)
        b = _gate_up_load(expert_w, rows, intermediate, step=j + 4, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, c, x16_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL)
    # the last steps % 3 steps are loaded (a, then b) but not computed yet
    if steps % 3 >= 1:
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, a, x16_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL)
    if steps % 3 == 2:
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, b, x16_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL)
    # lane (g, t) holds column 2t of rows g (d0) and g + 8 (d2): the pair is column 0
    xf = tl.load(xf_ptr + token)
    gate_factor = xf * tl.load(gate_up_global_ptr + 2 * expert)
    up_factor = xf * tl.load(gate_up_global_ptr + 2 * expert + 1)
    scale = (tl.load(down_global_ptr + expert)
             * tl.load(topk_weights_ptr + pair).to(tl.float32))
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    h_out = h16_ptr.to(tl.pointer_type(tl.int16)) + pair.to(tl.int64) * stride_h16_pair
    for half in tl.static_range(2):
        gate = tile_sum(acc_gate[2 * half], TILES, S) * gate_factor
        up = tile_sum(acc_up[2 * half], TILES, S) * up_factor
        h = gate / (1.0 + tl.exp(-gate)) * up * scale
        out_rows = n + 8 * half
        tl.store(h_out + frag_pos(out_rows, VH), bf16_bits(h),
                 mask=keep & (out_rows < intermediate))


@triton.jit
def _down_slot(token, top_k, q, CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """(pair, live, chunk) of walk step q (per tensor row): slot q / CHUNKS, chunk q % CHUNKS;
    not live past the last slot, or with FULL, where every step of the warps is a whole chunk
    of whole row tiles, the last step's again."""
    if FULL:
        q = tl.minimum(q, top_k * CHUNKS - 1)
    slot = q // CHUNKS
    return token * top_k + tl.minimum(slot, top_k - 1), slot < top_k, q % CHUNKS


@triton.jit
def _down_weights(experts, token, top_k, q, rows, n_rows, lane_t, k_words, V: tl.constexpr,
                  CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """Weights of walk step q (zeros where not live); `experts` = (topk_ids_ptr, w_ptr,
    w_scale_ptr, stride_w_expert, stride_w_row, stride_scale_expert, stride_scale_row)."""
    topk_ids_ptr, w_ptr, w_scale_ptr = experts[0], experts[1], experts[2]
    stride_w_expert, stride_w_row = experts[3], experts[4]
    stride_scale_expert, stride_scale_row = experts[5], experts[6]
    pair, live, chunk = _down_slot(token, top_k, q, CHUNKS, FULL)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    return rows_tile(w_ptr, w_scale_ptr, expert_words=expert * stride_w_expert,
                     expert_bytes=expert * stride_scale_expert, rows=rows, rows_end=n_rows,
                     live=live, chunk=chunk, lane_t=lane_t, k_words=k_words,
                     stride_w_row=stride_w_row, stride_scale_row=stride_scale_row, V=V,
                     FULL=FULL)


@triton.jit
def _down_acts(h_rows, token, top_k, q, lane_t, k_words, V: tl.constexpr,
               CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """h fragments of walk step q (zeros where not live); `h_rows` = (h16_ptr,
    stride_h16_pair)."""
    h16_ptr, stride_h16_pair = h_rows
    pair, live, chunk = _down_slot(token, top_k, q, CHUNKS, FULL)
    h16_row_ptr = (h16_ptr.to(tl.pointer_type(tl.int64))
                   + (pair.to(tl.int64) * (stride_h16_pair // 4))[:, None])
    return b_tile(h16_row_ptr, chunk, lane_t, live, k_words, V, FULL)


@triton.jit
def _down_load(experts, h_rows, token, top_k, q, rows, n_rows, lane_t, k_words,
               V: tl.constexpr, CHUNKS: tl.constexpr, FULL: tl.constexpr):
    """Weights and fragments of walk step q."""
    weights = _down_weights(experts, token, top_k, q=q, rows=rows, n_rows=n_rows,
                            lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
    acts = _down_acts(h_rows, token, top_k, q=q, lane_t=lane_t, k_words=k_words, V=V,
                      CHUNKS=CHUNKS, FULL=FULL)
    return weights, acts


@triton.jit
def down_mma(
    # pointers
    h16_ptr,                # [pairs, padded k] fragments: bf16 (BF16) or fp16
    hf_ptr,                 # [tokens] float32 factor of fp16 fragments (unused with BF16)
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    w_ptr,                  # [experts, n_rows, k_words] int32 words
    w_scale_ptr,            # [experts, n_rows, k_words / 2] e4m3 bytes
    out_ptr,                # [tokens, n_rows] (out)
    # sizes
    n_rows,
    k_words,
    top_k,
    # strides (w in int32 words, its scales in bytes, fragments in 16-bit units)
    stride_h16_pair,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_out_token,
    # meta-parameters
    V: tl.constexpr,        # words per lane and chunk
    TILES: tl.constexpr,    # 16-row tiles per program
    S: tl.constexpr,        # K split: warps per tile, taking every S-th walk step
    CHUNKS: tl.constexpr,   # chunks per slot
    ASM: tl.constexpr,      # 1: PTX mma, 0: its emulation (interpreter)
    FULL: tl.constexpr,     # no masks: whole row tiles, whole chunks, even K split
    BF16: tl.constexpr = 0,  # bf16 fragments (gate_up's h)
    PDL: tl.constexpr = 0,  # programmatic dependent launch
):
    """Each program computes one (token, block of 16 TILES rows) of out:
    out[t, n] = f * sum over t's slots p (routed to e) of w_e[n] . h16[p], walking all of
    the token's slots (CHUNKS chunks each) as one float32 dot product, its warps taking every
    S-th step of the walk. f = BF16_OUT for bf16 fragments (gate_up's h), hf[t] for fp16 ones.
    PDL: the first two steps' weights load before waiting for the kernel that writes h16."""
    launch_next(PDL)
    token = tl.program_id(0)
    lane_g, lane_t, tile, split = lanes(TILES * S, S)
    rows = tl.program_id(1) * (16 * TILES) + 16 * tile + lane_g
    w_words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    experts = (topk_ids_ptr, w_words_ptr, w_scale_ptr, stride_w_expert, stride_w_row,
               stride_scale_expert, stride_scale_row)
    h_rows = (h16_ptr, stride_h16_pair)
    steps = (top_k * CHUNKS + S - 1) // S
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    acc = (z, z, z, z)
    weights_a = _down_weights(experts, token, top_k, q=split, rows=rows, n_rows=n_rows,
                              lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
    weights_b = _down_weights(experts, token, top_k, q=split + S, rows=rows, n_rows=n_rows,
                              lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
    grid_wait(PDL)
    a = (weights_a, _down_acts(h_rows, token, top_k, q=split, lane_t=lane_t, k_words=k_words,
                               V=V, CHUNKS=CHUNKS, FULL=FULL))
    b = (weights_b, _down_acts(h_rows, token, top_k, q=split + S, lane_t=lane_t,
                               k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL))
    for j in range(0, steps - 2, 3):
        q = (j + 2) * S + split
        c = _down_load(experts, h_rows, token, top_k, q=q, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
        acc = mma(acc, a[0], a[1], TILES * S, ASM, BF16)
        a = _down_load(experts, h_rows, token, top_k, q=q + S, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
        acc = mma(acc, b[0], b[1], TILES * S, ASM, BF16)
        b = _down_load(experts, h_rows, token, top_k, q=q + 2 * S, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL)
        acc = mma(acc, c[0], c[1], TILES * S, ASM, BF16)
    if steps % 3 >= 1:
        acc = mma(acc, a[0], a[1], TILES * S, ASM, BF16)
    if steps % 3 == 2:
        acc = mma(acc, b[0], b[1], TILES * S, ASM, BF16)
    if BF16:
        f = BF16_OUT
    else:
        f = tl.load(hf_ptr + token)
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    out_row_ptr = out_ptr + token.to(tl.int64) * stride_out_token
    for half in tl.static_range(2):
        out_rows = n + 8 * half
        tl.store(out_row_ptr + out_rows, tile_sum(acc[2 * half], TILES, S) * f,
                 mask=keep & (out_rows < n_rows))
