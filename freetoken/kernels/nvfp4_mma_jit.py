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
nibble of b_j) the decoder builds four 16-bit pairs, inputs (0, 4), (2, 6), (1, 5) and
(3, 7): two mma steps per word. The activations stay in input order in memory (the model's
x, gate_up's h): a lane loads the same 8 inputs of its column as two int64s (16 contiguous
bytes, as two loads: one 16-byte load split in two went through shared memory with a
barrier every step, `bench/nvfp4_sass.py`) and four `prmt`s pair them as the weights are
paired. The operands are the activations' own type, fp16 or bf16, unscaled: a product of
two 16-bit values is exact in the mma's float32.

Decode. An e2m1 code `s e1 e0 m` at fp16 bits 15 and 11..9 is the fp16 number e2m1 * 2^-14
exactly (codes 0 and 1 on subnormals). A word's high nibbles are placed for both pairs they
feed by one bit-select of the word and the word shifted right by 3 (signs from the first,
magnitudes from the second), then a mask (and a shift by 8 for the even bytes); the low
nibbles likewise after a shift by 4. The block scale pair of rows (g, g + 8) converts with
`cvt.rn.f16x2.e4m3x2` and is multiplied by 2^7, so that e2m1 * 2^-14 * e4m3 * 2^7 (at most 6
significant bits, between 2^-17 and 21) is exact in fp16, and the sums are multiplied by
2^7. bf16 operands: the code at bf16 bits 15 and 8..6 is e2m1 * 2^-126 exactly (codes 0
and 1 on subnormals); sign and magnitude are 6 bits apart for every nibble, so one
bit-select of the word and the word shifted right by 6 places the odd bytes' nibbles (the
low ones after a shift by 4), and one of the word shifted left by 8 and by 2 the even
bytes'. The scales become e4m3 * 2^100 in bf16 (through fp16 and float32, exact), so that
the products are normal bf16 numbers (2^-36 .. 2^-15), exact, and the sums are multiplied
by 2^26.

h between gate_up and down: gate_up stores h (already times the routing weight and down's
global scale) in bf16, rounded to nearest even (8 significant bits, as the model's own h
and the prefill kernels'), and down, whose weights then decode to bf16, walks all of a
token's slots as one float32 dot product. The dense linear is down with one slot per token
on x itself, its global scale applied to the sums.

Registers. The weight bytes in flight, what a decode launch is bound by, are the warps an SM
runs times the two steps each loads ahead, and registers bound the warps. So a lane's V word
positions of a chunk are one PTX block chained through one accumulator (4 float32 per gate
or up, not 4 V), the token's activations load in the step that uses them (every warp reads
the same row: L1 hits; only the weights run ahead), and launches with whole row tiles,
whole chunks and an even K split load without masks.

Launches. A MoE call is two kernels, gate_up then down; a dense linear is down alone. On
sm_90+ down follows gate_up with programmatic dependent launch (PDL): gate_up lets it launch
as it starts (`launch_next`), down's programs start while gate_up finishes, load their first
two steps of weights, and wait (`grid_wait`) before they read h or write anything. gate_up
itself, and the dense linear's down, are ordinary launches: what they read first (the
routing ids, x) comes from the kernels before them.

Shared slot. With SHARED the MoE block's shared expert (NVFP4, the routed experts' shapes)
is slot top_k of every token: gate_up's programs for it take the shared weights, scales and
globals and weight h by sigmoid(gate . x) instead of a routing weight, and down walks it
after the routed slots, then adds the decoder layer's residual (RESIDUAL). down chooses the
rows per lane and step; ALIGNED tells it that both experts' rows start 16-byte aligned, which
keeps its wide weight loads (without it the choice costs them, and a layout conversion
through shared memory: 1167 against 729 inner-loop instructions at TP 1, one token).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.jit_ops import grid_wait, launch_next, sigmoid, sum_
from freetoken.kernels.nvfp4_mma_ops_jit import (
    b_tile,
    bf16_bits,
    lanes,
    mma,
    round_to,
    rows_tile,
    sum_factor,
    tile_sum,
)

GATE_BLOCK = tl.constexpr(256)
"""Inputs a shared-expert program takes per step of its sigmoid gate's dot product."""


@triton.jit
def _rows_load(w_ptr, w_scale_ptr, expert_words, expert_bytes, rows, n_rows, step, split,
               lane_t, k_words, stride_w_row, stride_scale_row, V: tl.constexpr,
               S: tl.constexpr, FULL: tl.constexpr):
    """Weight rows (`rows_tile`, at word offset `expert_words` and scale byte offset
    `expert_bytes`) of `step` (chunk step S + split), and the chunk. FULL: every step of the
    warps is a whole chunk of whole row tiles, and the loads ahead of the last step re-read
    the last chunk (never used) instead of being masked."""
    chunk = step * S + split
    if FULL:
        chunk = tl.minimum(chunk, k_words // (4 * V) - 1)
    return rows_tile(w_ptr, w_scale_ptr, expert_words=expert_words, expert_bytes=expert_bytes,
                     rows=rows, rows_end=n_rows, live=lane_t >= 0, chunk=chunk, lane_t=lane_t,
                     k_words=k_words, stride_w_row=stride_w_row,
                     stride_scale_row=stride_scale_row, V=V, FULL=FULL), chunk


@triton.jit
def _gate_up_load(expert, rows, intermediate, step, split, lane_t, k_words, V: tl.constexpr,
                  S: tl.constexpr, FULL: tl.constexpr):
    """Gate rows and up rows of `step` (`_rows_load`), and the chunk; `expert` = (w_ptr,
    w_scale_ptr, stride_w_row, stride_scale_row) of the pair's expert."""
    w_ptr, w_scale_ptr, stride_w_row, stride_scale_row = expert
    gate, chunk = _rows_load(w_ptr, w_scale_ptr, 0, 0, rows, intermediate, step, split,
                             lane_t, k_words, stride_w_row, stride_scale_row, V=V, S=S,
                             FULL=FULL)
    up, _ = _rows_load(w_ptr, w_scale_ptr, intermediate * stride_w_row,
                       intermediate * stride_scale_row, rows, intermediate, step, split,
                       lane_t, k_words, stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
    return gate, up, chunk


@triton.jit
def _gate_up_step(acc_gate, acc_up, loaded, x_row_ptr, lane_t, k_words, V: tl.constexpr,
                  NW: tl.constexpr, ASM: tl.constexpr, FULL: tl.constexpr, BF16: tl.constexpr):
    """The gate and up mma of a loaded step. The token's activations load here, not with the
    weights two steps ahead: every warp of the SM reads the same row (L1), and registers
    held across steps are what limits the warps an SM runs."""
    b = b_tile(x_row_ptr, loaded[2], lane_t, lane_t >= 0, k_words, V, FULL)
    return (mma(acc_gate, loaded[0], b, NW, ASM, BF16),
            mma(acc_up, loaded[1], b, NW, ASM, BF16))


@triton.jit
def gate_up_mma(
    # pointers
    x16_ptr,                # [tokens, >= hidden] 16-bit activations (bf16 with BF16, or fp16)
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    topk_weights_ptr,       # [pairs] routing weights
    w_ptr,                  # [experts, 2 * intermediate, k_words] int32 words (gate, up rows)
    w_scale_ptr,            # [experts, 2 * intermediate, k_words / 2] e4m3 bytes
    gate_up_global_ptr,     # [experts, 2] float32 (gate, up) global scales
    down_global_ptr,        # [experts] float32 (RECIPROCAL: the stored ones, which divide)
    h16_ptr,                # [tokens * (top_k + SHARED), >= intermediate] bf16 h (out)
    shared_w_ptr,           # with SHARED: the shared expert's [2 * intermediate, k_words] words
    shared_w_scale_ptr,     # and their e4m3 block scales (the routed experts' row strides)
    shared_global_ptr,      # its gate_up globals, float32 (gate at shared_gate_group, up at
    shared_down_global_ptr,     # shared_up_group), its down's global [1] float32
    shared_gate_ptr,        # [8 * k_words] the sigmoid gate's weights, x's dtype
    # sizes
    intermediate,
    k_words,
    top_k,
    shared_gate_group,
    shared_up_group,
    # strides (x and h in 16-bit units, w in int32 words, its scales in bytes)
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
    ASM: tl.constexpr,      # 1: PTX mma, 0: its emulation (interpreter)
    FULL: tl.constexpr,     # no masks: whole row tiles, whole chunks, even K split
    BF16: tl.constexpr,     # bf16 activations (else fp16)
    PDL: tl.constexpr = 0,  # let down launch early (programmatic dependent launch)
    SHARED: tl.constexpr = 0,   # each token's slot top_k is the gated shared expert
    SHARED_RECIPROCAL: tl.constexpr = 0,    # the shared expert's stored globals divide
    RECIPROCAL: tl.constexpr = 0,   # the routed experts' stored globals divide
):
    """Each program computes one (slot, block of 16 TILES rows) of h:
    h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) * topk_weights[q] * down_global[e] for
    slot p = (token t, slot s) routed to expert e (pair q = t top_k + s); its warps split K S
    ways. With SHARED a token has top_k + 1 slots, and its last is the shared expert's, whose
    h is silu(gate . x_t) * (up . x_t) * sigmoid(shared_gate . x_t) times its down's global
    (the gate's logit and sigmoid rounded to x's dtype, as the MoE block's combine rounds
    them). h is stored in bf16 for down. An ordinary launch: x and the routing ids come from
    the kernels before."""
    launch_next(PDL)
    slot_id = tl.program_id(0)
    token = slot_id // (top_k + SHARED)
    slot = slot_id % (top_k + SHARED)
    pair = token * top_k + tl.minimum(slot, top_k - 1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    lane_g, lane_t, tile, split = lanes(TILES * S, S)
    rows = tl.program_id(1) * (16 * TILES) + 16 * tile + lane_g
    w_expert_ptr = w_ptr.to(tl.pointer_type(tl.int32)) + expert * stride_w_expert
    scale_expert_ptr = w_scale_ptr + expert * stride_scale_expert
    if SHARED:
        w_expert_ptr = tl.where(slot < top_k, w_expert_ptr,
                                shared_w_ptr.to(tl.pointer_type(tl.int32)))
        scale_expert_ptr = tl.where(slot < top_k, scale_expert_ptr, shared_w_scale_ptr)
    x_row_ptr = (x16_ptr.to(tl.pointer_type(tl.int64))
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
    for j in range(0, steps - 2, 3):
        c = _gate_up_load(expert_w, rows, intermediate, step=j + 2, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, a, x_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL,
                                         BF16=BF16)
        a = _gate_up_load(expert_w, rows, intermediate, step=j + 3, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, b, x_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL,
                                         BF16=BF16)
        b = _gate_up_load(expert_w, rows, intermediate, step=j + 4, split=split, lane_t=lane_t,
                          k_words=k_words, V=V, S=S, FULL=FULL)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, c, x_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL,
                                         BF16=BF16)
    # the last steps % 3 steps are loaded (a, then b) but not computed yet
    if steps % 3 >= 1:
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, a, x_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL,
                                         BF16=BF16)
    if steps % 3 == 2:
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, b, x_row_ptr, lane_t=lane_t,
                                         k_words=k_words, V=V, NW=TILES * S, ASM=ASM, FULL=FULL,
                                         BF16=BF16)
    # lane (g, t) holds column 2t of rows g (d0) and g + 8 (d2): the pair is column 0
    f = sum_factor(BF16)
    gate_global = _global(gate_up_global_ptr + 2 * expert, RECIPROCAL)
    up_global = _global(gate_up_global_ptr + 2 * expert + 1, RECIPROCAL)
    scale = (_global(down_global_ptr + expert, RECIPROCAL)
             * tl.load(topk_weights_ptr + pair).to(tl.float32))
    if SHARED:
        if slot == top_k:
            gate_global = _global(shared_global_ptr + shared_gate_group, SHARED_RECIPROCAL)
            up_global = _global(shared_global_ptr + shared_up_group, SHARED_RECIPROCAL)
            scale = (_global(shared_down_global_ptr, SHARED_RECIPROCAL)
                     * _shared_gate(x16_ptr + token.to(tl.int64) * stride_x16_token,
                                    shared_gate_ptr, 8 * k_words))
    gate_factor = f * gate_global
    up_factor = f * up_global
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    h_out = h16_ptr.to(tl.pointer_type(tl.int16)) + slot_id.to(tl.int64) * stride_h16_pair
    for half in tl.static_range(2):
        gate = tile_sum(acc_gate[2 * half], TILES, S) * gate_factor
        up = tile_sum(acc_up[2 * half], TILES, S) * up_factor
        h = gate / (1.0 + tl.exp(-gate)) * up * scale
        out_rows = n + 8 * half
        tl.store(h_out + out_rows, bf16_bits(h), mask=keep & (out_rows < intermediate))


@triton.jit
def _global(ptr, RECIPROCAL: tl.constexpr):
    """A stored global scale as a multiplier (its reciprocal where the stored one divides,
    rounded to nearest as torch's `1.0 / g` is)."""
    g = tl.load(ptr)
    if RECIPROCAL:
        g = tl.math.div_rn(tl.full([], 1.0, tl.float32), g)
    return g


@triton.jit
def _shared_gate(x_row_ptr, gate_ptr, hidden):
    """sigmoid(gate . x) of a token's 16-bit row, the logit and the sigmoid each rounded to
    x's dtype (as `gemv.moe_combine` rounds them)."""
    offs = tl.arange(0, GATE_BLOCK)
    acc = tl.full([GATE_BLOCK], 0.0, tl.float32)
    for k0 in range(0, hidden, GATE_BLOCK):
        ok = k0 + offs < hidden
        acc += (tl.load(x_row_ptr + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                * tl.load(gate_ptr + k0 + offs, mask=ok, other=0.0).to(tl.float32))
    logit = round_to(sum_(acc, 0), x_row_ptr.dtype.element_ty)
    return round_to(sigmoid(logit), x_row_ptr.dtype.element_ty)


@triton.jit
def _down_slot(token, top_k, q, CHUNKS: tl.constexpr, FULL: tl.constexpr,
               SHARED: tl.constexpr):
    """(pair, h row, live, chunk, routed) of walk step q (per tensor row): slot q / CHUNKS
    of the token's top_k + SHARED, chunk q % CHUNKS; the pair (routing ids) and the h row of
    that slot; not live past the last slot, or with FULL, where every step of the warps is a
    whole chunk of whole row tiles, the last step's again; routed: not the shared slot."""
    if FULL:
        q = tl.minimum(q, (top_k + SHARED) * CHUNKS - 1)
    slot = q // CHUNKS
    last = tl.minimum(slot, top_k + SHARED - 1)
    return (token * top_k + tl.minimum(slot, top_k - 1), token * (top_k + SHARED) + last,
            slot < top_k + SHARED, q % CHUNKS, slot < top_k)


@triton.jit
def _down_weights(experts, token, top_k, q, rows, n_rows, lane_t, k_words, V: tl.constexpr,
                  CHUNKS: tl.constexpr, FULL: tl.constexpr, SHARED: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """Weights of walk step q (zeros where not live); `experts` = (topk_ids_ptr, w_ptr,
    w_scale_ptr, stride_w_expert, stride_w_row, stride_scale_expert, stride_scale_row,
    shared_w_ptr, shared_w_scale_ptr): the shared expert's rows for its slot (SHARED). The
    choice between the two loses the wide loads' alignment, which ALIGNED (both experts'
    rows start 16-byte aligned) restores."""
    topk_ids_ptr, w_ptr, w_scale_ptr = experts[0], experts[1], experts[2]
    stride_w_expert, stride_w_row = experts[3], experts[4]
    stride_scale_expert, stride_scale_row = experts[5], experts[6]
    pair, _, live, chunk, routed = _down_slot(token, top_k, q, CHUNKS, FULL, SHARED)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    w_rows_ptr = w_ptr + expert * stride_w_expert
    scale_rows_ptr = w_scale_ptr + expert * stride_scale_expert
    if SHARED:
        w_rows_ptr = tl.where(routed, w_rows_ptr, experts[7])
        scale_rows_ptr = tl.where(routed, scale_rows_ptr, experts[8])
        if ALIGNED:
            w_rows_ptr = tl.multiple_of(w_rows_ptr, 16)
            scale_rows_ptr = tl.multiple_of(scale_rows_ptr, 16)
    return rows_tile(w_rows_ptr, scale_rows_ptr, expert_words=0, expert_bytes=0, rows=rows,
                     rows_end=n_rows, live=live, chunk=chunk, lane_t=lane_t, k_words=k_words,
                     stride_w_row=stride_w_row, stride_scale_row=stride_scale_row, V=V,
                     FULL=FULL)


@triton.jit
def _down_acts(h_rows, token, top_k, q, lane_t, k_words, V: tl.constexpr,
               CHUNKS: tl.constexpr, FULL: tl.constexpr, SHARED: tl.constexpr):
    """h (or x) of walk step q (zeros where not live); `h_rows` = (h16_ptr,
    stride_h16_pair)."""
    h16_ptr, stride_h16_pair = h_rows
    _, h_row, live, chunk, _ = _down_slot(token, top_k, q, CHUNKS, FULL, SHARED)
    h16_row_ptr = (h16_ptr.to(tl.pointer_type(tl.int64))
                   + (h_row.to(tl.int64) * (stride_h16_pair // 4))[:, None])
    return b_tile(h16_row_ptr, chunk, lane_t, live, k_words, V, FULL)


@triton.jit
def _down_load(experts, h_rows, token, top_k, q, rows, n_rows, lane_t, k_words,
               V: tl.constexpr, CHUNKS: tl.constexpr, FULL: tl.constexpr,
               SHARED: tl.constexpr, ALIGNED: tl.constexpr):
    """Weights and fragments of walk step q."""
    weights = _down_weights(experts, token, top_k, q=q, rows=rows, n_rows=n_rows,
                            lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                            SHARED=SHARED, ALIGNED=ALIGNED)
    acts = _down_acts(h_rows, token, top_k, q=q, lane_t=lane_t, k_words=k_words, V=V,
                      CHUNKS=CHUNKS, FULL=FULL, SHARED=SHARED)
    return weights, acts


@triton.jit
def down_mma(
    # pointers
    h16_ptr,                # [slots, >= k] 16-bit activations: gate_up's bf16 h, or x
    out_scale_ptr,          # [1] float32 factor of the outputs (with SCALED)
    topk_ids_ptr,           # [pairs] expert of pair p = token * top_k + slot
    w_ptr,                  # [experts, n_rows, k_words] int32 words
    w_scale_ptr,            # [experts, n_rows, k_words / 2] e4m3 bytes
    shared_w_ptr,           # with SHARED: the shared expert's [n_rows, k_words] words and
    shared_w_scale_ptr,     # their block scales (the routed experts' row strides)
    residual_ptr,           # [tokens, n_rows] added to the output (with RESIDUAL)
    out_ptr,                # [tokens, n_rows] (out)
    # sizes
    n_rows,
    k_words,
    top_k,
    # strides (w in int32 words, its scales in bytes, activations in 16-bit units)
    stride_h16_pair,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_out_token,
    stride_residual_token,
    # meta-parameters
    V: tl.constexpr,        # words per lane and chunk
    TILES: tl.constexpr,    # 16-row tiles per program
    S: tl.constexpr,        # K split: warps per tile, taking every S-th walk step
    CHUNKS: tl.constexpr,   # chunks per slot
    ASM: tl.constexpr,      # 1: PTX mma, 0: its emulation (interpreter)
    FULL: tl.constexpr,     # no masks: whole row tiles, whole chunks, even K split
    BF16: tl.constexpr,     # bf16 activations (else fp16)
    SCALED: tl.constexpr = 0,   # outputs times out_scale[0] (a dense linear's global scale)
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch, after gate_up
    SHARED: tl.constexpr = 0,   # each token's slot top_k is the shared expert's
    ALIGNED: tl.constexpr = 0,  # with SHARED: every expert's rows start 16-byte aligned
    RESIDUAL: tl.constexpr = 0,     # out = residual + the sums rounded to out's dtype
):
    """Each program computes one (token, block of 16 TILES rows) of out:
    out[t, n] = f * sum over t's slots p (routed to e) of w_e[n] . h16[p], walking all of
    the token's top_k + SHARED slots (CHUNKS chunks each) as one float32 dot product, its
    warps taking every S-th step of the walk; f undoes the decode's weight scale (and is
    times out_scale[0] with SCALED). RESIDUAL: the sums are rounded to out's dtype and the
    residual added (as `residual + block(x)` rounds). PDL: the first two steps' weights load
    before waiting for gate_up."""
    launch_next(PDL)
    token = tl.program_id(0)
    lane_g, lane_t, tile, split = lanes(TILES * S, S)
    rows = tl.program_id(1) * (16 * TILES) + 16 * tile + lane_g
    experts = (topk_ids_ptr, w_ptr.to(tl.pointer_type(tl.int32)), w_scale_ptr,
               stride_w_expert, stride_w_row, stride_scale_expert, stride_scale_row,
               shared_w_ptr.to(tl.pointer_type(tl.int32)), shared_w_scale_ptr)
    h_rows = (h16_ptr, stride_h16_pair)
    steps = ((top_k + SHARED) * CHUNKS + S - 1) // S
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    acc = (z, z, z, z)
    weights_a = _down_weights(experts, token, top_k, q=split, rows=rows, n_rows=n_rows,
                              lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                              SHARED=SHARED, ALIGNED=ALIGNED)
    weights_b = _down_weights(experts, token, top_k, q=split + S, rows=rows, n_rows=n_rows,
                              lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                              SHARED=SHARED, ALIGNED=ALIGNED)
    grid_wait(PDL)
    a = (weights_a, _down_acts(h_rows, token, top_k, q=split, lane_t=lane_t, k_words=k_words,
                               V=V, CHUNKS=CHUNKS, FULL=FULL, SHARED=SHARED))
    b = (weights_b, _down_acts(h_rows, token, top_k, q=split + S, lane_t=lane_t,
                               k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL, SHARED=SHARED))
    for j in range(0, steps - 2, 3):
        q = (j + 2) * S + split
        c = _down_load(experts, h_rows, token, top_k, q=q, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                       SHARED=SHARED, ALIGNED=ALIGNED)
        acc = mma(acc, a[0], a[1], TILES * S, ASM, BF16)
        a = _down_load(experts, h_rows, token, top_k, q=q + S, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                       SHARED=SHARED, ALIGNED=ALIGNED)
        acc = mma(acc, b[0], b[1], TILES * S, ASM, BF16)
        b = _down_load(experts, h_rows, token, top_k, q=q + 2 * S, rows=rows, n_rows=n_rows,
                       lane_t=lane_t, k_words=k_words, V=V, CHUNKS=CHUNKS, FULL=FULL,
                       SHARED=SHARED, ALIGNED=ALIGNED)
        acc = mma(acc, c[0], c[1], TILES * S, ASM, BF16)
    if steps % 3 >= 1:
        acc = mma(acc, a[0], a[1], TILES * S, ASM, BF16)
    if steps % 3 == 2:
        acc = mma(acc, b[0], b[1], TILES * S, ASM, BF16)
    f = sum_factor(BF16)
    if SCALED:
        f = f * tl.load(out_scale_ptr)
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    keep = (lane % 4) == 0
    out_row_ptr = out_ptr + token.to(tl.int64) * stride_out_token
    residual_row_ptr = residual_ptr + token.to(tl.int64) * stride_residual_token
    for half in tl.static_range(2):
        out_rows = n + 8 * half
        ok = keep & (out_rows < n_rows)
        out = tile_sum(acc[2 * half], TILES, S) * f
        if RESIDUAL:
            out = (round_to(out, out_ptr.dtype.element_ty)
                   + tl.load(residual_row_ptr + out_rows, mask=ok, other=0.0).to(tl.float32))
        tl.store(out_row_ptr + out_rows, out, mask=ok)


@triton.jit
def _dense_step(accs, loaded, x_rows_ptr, lane_t, k_words, V: tl.constexpr,
                NW: tl.constexpr, ASM: tl.constexpr, FULL: tl.constexpr, BF16: tl.constexpr,
                COLS: tl.constexpr):
    """The mmas of a loaded step: the decoded weights times each block of eight tokens'
    activations (COLS / 8 blocks; each lane loads its column's token)."""
    b = b_tile(x_rows_ptr[0], loaded[1], lane_t, lane_t >= 0, k_words, V, FULL)
    first = mma(accs[0], loaded[0], b, NW, ASM, BF16)
    second = accs[1]
    if COLS == 16:
        b = b_tile(x_rows_ptr[1], loaded[1], lane_t, lane_t >= 0, k_words, V, FULL)
        second = mma(second, loaded[0], b, NW, ASM, BF16)
    return first, second


@triton.jit
def _dense_rows_ptr(x16_ptr, first, lane_g, tokens, stride_x16_token):
    """[R, 1] int64 pointers to the activations of the token lane (g, t) feeds in the block
    of eight from `first` (the last token's past the end: those columns are not stored)."""
    token = tl.minimum(first + lane_g, tokens - 1)
    return (x16_ptr.to(tl.pointer_type(tl.int64))
            + (token.to(tl.int64) * (stride_x16_token // 4))[:, None])


@triton.jit
def _dense_store(acc, first, f, out_ptr, tokens, n_rows, stride_out_token,
                 TILES: tl.constexpr, S: tl.constexpr):
    """One block of eight tokens' outputs: lane (g, t) holds columns 2t and 2t + 1 (tokens
    first + 2t and first + 2t + 1) of rows g and g + 8, all four accumulators stored."""
    lane = tl.arange(0, 32)[None, :]
    n = tl.program_id(1) * (16 * TILES) + 16 * tl.arange(0, TILES)[:, None] + lane // 4
    column = first + 2 * (lane % 4)
    for half in tl.static_range(2):
        out_rows = n + 8 * half
        for odd in tl.static_range(2):
            out_token = column + odd
            ok = (out_rows < n_rows) & (out_token < tokens)
            out = tile_sum(acc[2 * half + odd], TILES, S) * f
            tl.store(out_ptr + out_token.to(tl.int64) * stride_out_token + out_rows, out,
                     mask=ok)


@triton.jit
def dense_mma(
    # pointers
    x16_ptr,                # [tokens, >= k] 16-bit activations (bf16 with BF16, or fp16)
    out_scale_ptr,          # [1] float32 factor of the outputs (the weight's global scale)
    w_ptr,                  # [n_rows, k_words] int32 words
    w_scale_ptr,            # [n_rows, k_words / 2] e4m3 bytes
    out_ptr,                # [tokens, n_rows] (out)
    # sizes
    tokens,
    n_rows,
    k_words,
    # strides (x in 16-bit units, w in int32 words, its scales in bytes)
    stride_x16_token,
    stride_w_row,
    stride_scale_row,
    stride_out_token,
    # meta-parameters
    V: tl.constexpr,        # words per lane and chunk
    TILES: tl.constexpr,    # 16-row tiles per program
    S: tl.constexpr,        # K split: warps per tile
    ASM: tl.constexpr,      # 1: PTX mma, 0: its emulation (interpreter)
    FULL: tl.constexpr,     # no masks: whole row tiles, whole chunks, even K split
    BF16: tl.constexpr,     # bf16 activations (else fp16)
    COLS: tl.constexpr = 8,     # tokens per program: 8 (one mma a step) or 16 (two)
):
    """A dense linear of several tokens on tensor cores, the tokens as the mma's columns:
    each program computes out[t, n] = out_scale * w[n] . x[t] for the COLS tokens of block
    program_id(0) and the 16 TILES rows of block program_id(1). Lane (g, t) feeds column g
    of each block of eight, so it loads that token's activations, and a weight tile is read
    and decoded once for COLS tokens (two mmas a step on the same decoded tile for 16),
    where `down_mma`'s dense use (one slot per token) reads it once per token."""
    lane_g, lane_t, tile, split = lanes(TILES * S, S)
    rows = tl.program_id(1) * (16 * TILES) + 16 * tile + lane_g
    first = tl.program_id(0) * COLS
    x_rows_ptr = (_dense_rows_ptr(x16_ptr, first, lane_g, tokens, stride_x16_token),
                  _dense_rows_ptr(x16_ptr, first + 8, lane_g, tokens, stride_x16_token))
    w_words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    z = tl.full([32 * TILES * S], 0.0, tl.float32)
    accs = ((z, z, z, z), (z, z, z, z))
    steps = ((k_words + 4 * V - 1) // (4 * V) + S - 1) // S
    # Loads two steps ahead in three named buffers, as in gate_up_mma.
    a = _rows_load(w_words_ptr, w_scale_ptr, 0, 0, rows, n_rows, 0, split, lane_t, k_words,
                    stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
    b = _rows_load(w_words_ptr, w_scale_ptr, 0, 0, rows, n_rows, 1, split, lane_t, k_words,
                    stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
    for j in range(0, steps - 2, 3):
        c = _rows_load(w_words_ptr, w_scale_ptr, 0, 0, rows, n_rows, j + 2, split, lane_t, k_words,
                        stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
        accs = _dense_step(accs, a, x_rows_ptr, lane_t, k_words, V=V, NW=TILES * S, ASM=ASM,
                           FULL=FULL, BF16=BF16, COLS=COLS)
        a = _rows_load(w_words_ptr, w_scale_ptr, 0, 0, rows, n_rows, j + 3, split, lane_t, k_words,
                        stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
        accs = _dense_step(accs, b, x_rows_ptr, lane_t, k_words, V=V, NW=TILES * S, ASM=ASM,
                           FULL=FULL, BF16=BF16, COLS=COLS)
        b = _rows_load(w_words_ptr, w_scale_ptr, 0, 0, rows, n_rows, j + 4, split, lane_t, k_words,
                        stride_w_row, stride_scale_row, V=V, S=S, FULL=FULL)
        accs = _dense_step(accs, c, x_rows_ptr, lane_t, k_words, V=V, NW=TILES * S, ASM=ASM,
                           FULL=FULL, BF16=BF16, COLS=COLS)
    if steps % 3 >= 1:
        accs = _dense_step(accs, a, x_rows_ptr, lane_t, k_words, V=V, NW=TILES * S, ASM=ASM,
                           FULL=FULL, BF16=BF16, COLS=COLS)
    if steps % 3 == 2:
        accs = _dense_step(accs, b, x_rows_ptr, lane_t, k_words, V=V, NW=TILES * S, ASM=ASM,
                           FULL=FULL, BF16=BF16, COLS=COLS)
    f = sum_factor(BF16) * tl.load(out_scale_ptr)
    _dense_store(accs[0], first, f, out_ptr, tokens, n_rows, stride_out_token, TILES, S)
    if COLS == 16:
        _dense_store(accs[1], first + 8, f, out_ptr, tokens, n_rows, stride_out_token, TILES,
                     S)
