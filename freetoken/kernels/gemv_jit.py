"""Triton kernels for the linear layers of a decode step (a few tokens against a whole
weight), with the small steps around them fused in, so a decoder layer takes fewer
launches: the RMSNorm before a projection, the SiLU-and-mul after a gate | up projection,
the residual add after an output projection, and the MoE block's combination of routed
experts, shared expert and its sigmoid gate. Arithmetic in float32, one rounding to the
activations' dtype at each point the torch path rounds (the projection's output, the
normalised row, the activation), so results match the unfused kernels closely.

- `gemv_kernel`: program (n, m) computes out[m-block, n-block] = x W^T for BLOCK_M tokens
  and BLOCK_N output features, walking the input features BLOCK_K at a time. With NORM the
  program first takes each token's RMS over the whole row (a second read of x, from L2)
  and normalises x as it loads it (NORM 1: `w * round(x * s)`, NORM 2: `x * s * (1 + w)`);
  with STORE_NORMED the programs of the first feature block also store the normalised rows
  they read (rounded to `normed`'s dtype), for the steps after the projection that take
  the same input (the MoE block's experts after its router).
  With GATED the weight is [gate | up] (2 * out_features rows) and the program keeps both
  accumulators and writes `silu(gate) * up`. With RESIDUAL it writes `residual + y`.
  With SPLIT the inputs are split over program_id(2) as well (more programs for a weight
  of few rows: a router, a shared expert, an output projection); each writes a float32
  partial sum and `gemv_reduce_kernel` adds them in split order and applies the same
  epilogue (the gate | up pairing included).
- `moe_combine_kernel`: program (t, block) writes, for token t and a block of hidden
  columns, `sum_k slots[t, k] + sigmoid(x[t] . g) * shared[t]`: the routed experts'
  weighted slots (float32, summed in slot order), the shared expert's output and its gate
  (a dot product over the whole row of x, taken again by every program of the token).

Every program's reduction order is fixed, so a launch gives the same bits each time
(graph replay equals eager).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def normalise(x, scale, norm_w, NORM: tl.constexpr):
    """x [M, K] (float32) times its row scale and the norm weight, rounded as RMSNorm."""
    dtype = norm_w.dtype
    w = norm_w.to(tl.float32)[None, :]
    if NORM == 2:
        return (x * scale[:, None] * (1.0 + w)).to(dtype)
    return ((x * scale[:, None]).to(dtype).to(tl.float32) * w).to(dtype)


@triton.jit
def load_residual(residual_ptr, rows, cols, row_ok, col_ok, stride_residual_token):
    """The residual [M, N] of the output block (rows, cols), zeros outside it."""
    return tl.load(residual_ptr + rows.to(tl.int64)[:, None] * stride_residual_token
                   + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def epilogue(acc, acc_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, out_ptr,
             out_features, stride_residual_token, stride_out_token,
             GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             residual=None):
    """Bias, SiLU-and-mul, residual and the store of a finished [M, N] block, each rounded
    where the torch path rounds; `residual`: the residual where it was loaded ahead
    (`load_residual`), else it is loaded here."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + out_features + cols, mask=col_ok,
                              other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype).to(tl.float32)
    if GATED:
        silu = (y * ops.sigmoid(y)).to(dtype).to(tl.float32)
        y = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        if residual is None:
            residual = load_residual(residual_ptr, rows, cols, row_ok, col_ok,
                                     stride_residual_token)
        y = y + residual.to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out_token + cols[None, :],
             y.to(dtype), mask=ok)


@triton.jit
def gemv_kernel(
    # pointers
    x_ptr,
    weight_ptr,
    bias_ptr,
    norm_weight_ptr,
    residual_ptr,
    partial_ptr,
    out_ptr,
    normed_ptr,
    # sizes
    tokens,
    out_features,
    in_features,
    split_features,
    eps,
    # strides
    stride_x_token,
    stride_weight_row,
    stride_residual_token,
    stride_partial_split,
    stride_out_token,
    stride_normed_token,
    # meta
    NORM: tl.constexpr,
    STORE_NORMED: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] for the tokens of block program_id(1) and the features of block
    program_id(0) (see the module docstring). With SPLIT, program_id(2) takes inputs
    [s * split_features, (s + 1) * split_features) only and stores its float32 sum at
    partial[s] for `gemv_reduce_kernel` to finish; `split_features` is a whole number of
    steps."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    if NORM:
        squares = tl.full([BLOCK_M], 0, dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < in_features)[None, :],
                         other=0.0).to(tl.float32)
            squares += ops.sum_(xv * xv, axis=1)
        scale = 1.0 / tl.sqrt(squares / in_features + eps)
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    acc = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = row_ok[:, None]
            w_mask = col_ok[:, None]
        else:
            x_mask = row_ok[:, None] & (ks < in_features)[None, :]
            w_mask = col_ok[:, None] & (ks < in_features)[None, :]
        xv = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if NORM:
            norm_w = tl.load(norm_weight_ptr + ks, mask=ks < in_features, other=0.0)
            xv = normalise(xv.to(tl.float32), scale, norm_w, NORM)
            if STORE_NORMED:
                tl.store(normed_ptr + rows.to(tl.int64)[:, None] * stride_normed_token
                         + ks[None, :], xv.to(normed_ptr.dtype.element_ty),
                         mask=x_mask & (ks < in_features)[None, :] & (tl.program_id(0) == 0))
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(xv.to(w.dtype), tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_rows + out_features * stride_weight_row + ks[None, :], mask=w_mask,
                           other=0.0)
            acc_up = tl.dot(xv.to(w.dtype), tl.trans(w_up), acc_up, input_precision=PRECISION)
    if SPLIT:
        partial = (partial_ptr + tl.program_id(2) * stride_partial_split
                   + rows.to(tl.int64)[:, None] * out_features + cols[None, :])
        tl.store(partial, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        epilogue(acc, acc_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, out_ptr,
                 out_features, stride_residual_token, stride_out_token,
                 GATED, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def gemv_reduce_kernel(
    # pointers
    partial_ptr,
    bias_ptr,
    residual_ptr,
    out_ptr,
    # sizes
    tokens,
    out_features,
    splits,
    # strides
    stride_partial_split,
    stride_residual_token,
    stride_out_token,
    # meta
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Finishes a split launch of `gemv_kernel`: program (n, m) sums the `splits` partial
    sums of its block in split order and applies the epilogue. Gated, the partials hold
    [gate | up] (`out_features` = 2 * the output's features)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = out_features // 2 if GATED else out_features
    row_ok = rows < tokens
    col_ok = cols < half
    ok = row_ok[:, None] & col_ok[None, :]
    at = partial_ptr + rows.to(tl.int64)[:, None] * out_features + cols[None, :]
    acc = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0, dtype=tl.float32)
    for split in range(0, splits):
        acc += tl.load(at + split * stride_partial_split, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(at + split * stride_partial_split + half, mask=ok, other=0.0)
    epilogue(acc, acc_up, rows, cols, row_ok, col_ok, bias_ptr, residual_ptr, out_ptr,
             half, stride_residual_token, stride_out_token, GATED, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def moe_combine_kernel(
    # pointers
    slots_ptr,
    x_ptr,
    gate_weight_ptr,
    shared_ptr,
    residual_ptr,
    out_ptr,
    # sizes
    hidden,
    top_k,
    # strides
    stride_slots_token,
    stride_slots_slot,
    stride_x_token,
    stride_shared_token,
    stride_residual_token,
    stride_out_token,
    # meta
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """Token program_id(0), hidden columns of block program_id(1): routed + gated shared,
    rounded, plus the residual (RESIDUAL), rounded again."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    dot = tl.full([BLOCK_D], 0, dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < hidden
        xv = tl.load(x_ptr + token * stride_x_token + ds, mask=d_ok, other=0.0)
        gv = tl.load(gate_weight_ptr + ds, mask=d_ok, other=0.0)
        dot += xv.to(tl.float32) * gv.to(tl.float32)
    gate = ops.sum_(dot, axis=0).to(dtype).to(tl.float32)
    sigmoid = ops.sigmoid(gate).to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + token * stride_shared_token + cols, mask=ok, other=0.0)
    gated = (sigmoid * shared.to(tl.float32)).to(dtype).to(tl.float32)
    routed = tl.full([BLOCK_N], 0, dtype=tl.float32)
    for k in range(0, top_k):
        routed += tl.load(slots_ptr + token * stride_slots_token + k * stride_slots_slot + cols,
                          mask=ok, other=0.0)
    routed = routed.to(dtype).to(tl.float32)
    out = (routed + gated).to(dtype)
    if RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual_token + cols, mask=ok,
                           other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * stride_out_token + cols, out, mask=ok)
