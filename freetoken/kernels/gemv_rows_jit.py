"""The decode-step linear kernel without tensor cores (`gemv_rows_kernel`), for a token or
two against a whole weight: `gemv_jit.gemv_kernel` pads the tokens to a 16-row dot tile and
its programs hold at least 16 output features, so a small weight gives few programs and needs
a split-K launch and a second reduction launch; here a program holds any number of output
features (1, 2, 4, ...) for one token, multiplies elementwise in float32 and reduces each
step along the inputs, so a weight of 1024 rows fills the GPU with 256 programs and each
program issues its whole weight tile in one or two wide steps.

Same fusions and roundings as `gemv_kernel` (the RMSNorm prologue and the store of the
normalised input, SiLU-and-mul, bias, residual, the split form with
`gemv_jit.gemv_reduce_kernel` finishing it): the normalised input and the activation are
rounded where the torch path rounds them. Every program's reduction order is fixed, so a
launch gives the same bits each time (graph replay equals eager).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops
from freetoken.kernels.gemv_jit import epilogue, load_residual, normalise


@triton.jit
def row_scale(x_row, in_features, eps, NORM_BLOCK: tl.constexpr):
    """The RMSNorm scale `1 / sqrt(mean(x^2) + eps)` of one token's row, as a [1] tensor
    (`NORM_BLOCK` covers the whole row in one step up to 4096 inputs)."""
    squares = tl.full([NORM_BLOCK], 0, dtype=tl.float32)
    for k0 in range(0, in_features, NORM_BLOCK):
        ks = k0 + tl.arange(0, NORM_BLOCK)
        xv = tl.load(x_row + ks, mask=ks < in_features, other=0.0).to(tl.float32)
        squares += xv * xv
    total = ops.sum_(squares, axis=0)
    return tl.full([1], 0, dtype=tl.float32) + 1.0 / tl.sqrt(total / in_features + eps)


@triton.jit
def prefetch(w_rows, up_rows, norm_weight_ptr, k0, k_end, col_ok, GATED: tl.constexpr,
             NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile of the step at `k0` (and its up rows', GATED; else the same tile
    twice) and the norm weight's (NORM; else the step's inputs, unused), zeros past
    `k_end`: loaded a step ahead of their use (PREFETCH, `gemv.prefetches`), the first ones
    before the norm's full-row pass (and, with PDL, before the wait for the previous
    kernel), so that pass, and its barrier, run while they are in flight."""
    ks = k0 + tl.arange(0, BLOCK_K)
    w, up = load_pair(w_rows, up_rows, ks, col_ok[:, None] & (ks < k_end)[None, :], GATED)
    norm_w = ks   # unused without NORM (a jit function cannot return None)
    if NORM:
        norm_w = tl.load(norm_weight_ptr + ks, mask=ks < k_end, other=0.0)
    return w, up, norm_w


@triton.jit
def early_residual(residual_ptr, rows, cols, row_ok, col_ok, stride_residual_token,
                   EARLY: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr):
    """The residual of a row kernel's output block, loaded at the program's start (EARLY,
    `gemv.ROW_EARLY`), not after the norm's and the sums' cross-warp reductions; else None
    (the epilogue loads it)."""
    residual = None
    if EARLY and HAS_RESIDUAL and not SPLIT:
        residual = load_residual(residual_ptr, rows, cols, row_ok, col_ok,
                                 stride_residual_token)
    return residual


@triton.jit
def load_pair(w_rows, up_rows, ks, mask, GATED: tl.constexpr):
    """The weight tile of inputs `ks` (zeros outside `mask`) and, GATED, its up rows' (else
    the same tile twice)."""
    w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0)
    up = w
    if GATED:
        up = tl.load(up_rows + ks[None, :], mask=mask, other=0.0)
    return w, up


@triton.jit
def row_input(x_row, ks, in_features, col_ok, norm_weight_ptr, norm_scale, normed_row,
              EVEN_K: tl.constexpr, NORM: tl.constexpr, STORE_NORMED: tl.constexpr,
              norm_w=None):
    """(one step's input [1, BLOCK_K], normalised where NORM and stored to `normed_row` by
    the first feature block where STORE_NORMED; the weight tile's mask [BLOCK_N, BLOCK_K])
    of a row kernel's step `ks`; `norm_w`: the norm weight's step tile where it was loaded
    ahead (`prefetch`), else it is loaded here."""
    if EVEN_K:
        w_mask = col_ok[:, None]
        xv = tl.load(x_row + ks)[None, :]
    else:
        k_ok = ks < in_features
        w_mask = col_ok[:, None] & k_ok[None, :]
        xv = tl.load(x_row + ks, mask=k_ok, other=0.0)[None, :]
    if NORM:
        if norm_w is None:
            norm_w = tl.load(norm_weight_ptr + ks, mask=ks < in_features, other=0.0)
        xv = normalise(xv.to(tl.float32), norm_scale, norm_w, NORM)
        if STORE_NORMED:
            tl.store(normed_row + ks[None, :], xv.to(normed_row.dtype.element_ty),
                     mask=(ks < in_features)[None, :] & (tl.program_id(0) == 0))
    return xv, w_mask


@triton.jit
def gemv_rows_kernel(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr = 0,
    EARLY: tl.constexpr = 1,
):
    """out[t, n] for token t = program_id(1) and the features of block program_id(0). With
    SPLIT, program_id(2) takes inputs [s * split_features, (s + 1) * split_features) only
    and stores its float32 sum at partial[s]; `split_features` is a whole number of
    steps. PDL (a launch with programmatic dependent launch, `gemv.ROW_PDL`): the program
    lets the stream's next kernel launch, loads its first weight tile (PREFETCH is on) and
    waits for the previous kernel before it reads x or writes anything. EARLY
    (`gemv.ROW_EARLY`): the residual is loaded before the sums, and with PREFETCH the norm
    weight's tile beside the weights', so neither waits behind a cross-warp reduction."""
    ops.launch_next(PDL)
    token = tl.program_id(1)
    rows = token + tl.arange(0, 1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tokens
    col_ok = cols < out_features
    x_row = x_ptr + token.to(tl.int64) * stride_x_token
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight_row
    up_rows = w_rows + out_features * stride_weight_row
    k_start = tl.program_id(2) * split_features
    k_end = tl.minimum(k_start + split_features, in_features)
    if PREFETCH:
        w_next, up_next, norm_next = prefetch(w_rows, up_rows, norm_weight_ptr, k_start, k_end,
                                              col_ok, GATED, NORM * EARLY, BLOCK_K)
    ops.grid_wait(PDL)
    residual = early_residual(residual_ptr, rows, cols, row_ok, col_ok, stride_residual_token,
                              EARLY, HAS_RESIDUAL, SPLIT)
    scale = 1.0
    if NORM:
        scale = row_scale(x_row, in_features, eps, NORM_BLOCK)
    normed_row = normed_ptr + token.to(tl.int64) * stride_normed_token
    acc = tl.full([BLOCK_N], 0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_N], 0, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        norm_w = None   # the norm weight's tile where prefetched (EARLY), else row_input's
        if PREFETCH:
            w, w_up, step_norm = w_next, up_next, norm_next
            w_next, up_next, norm_next = prefetch(w_rows, up_rows, norm_weight_ptr,
                                                  k0 + BLOCK_K, k_end, col_ok, GATED,
                                                  NORM * EARLY, BLOCK_K)
            if EARLY:
                norm_w = step_norm
        xv, w_mask = row_input(x_row, ks, in_features, col_ok, norm_weight_ptr, scale,
                               normed_row, EVEN_K, NORM, STORE_NORMED, norm_w)
        if not PREFETCH:
            w, w_up = load_pair(w_rows, up_rows, ks, w_mask, GATED)
        xf = xv.to(w.dtype).to(tl.float32)
        acc += ops.sum_(w.to(tl.float32) * xf, axis=1)
        if GATED:
            acc_up += ops.sum_(w_up.to(tl.float32) * xf, axis=1)
    if SPLIT:
        partial = (partial_ptr + tl.program_id(2) * stride_partial_split
                   + rows.to(tl.int64)[:, None] * out_features + cols[None, :])
        tl.store(partial, acc[None, :], mask=row_ok[:, None] & col_ok[None, :])
    else:
        epilogue(acc[None, :], acc_up[None, :], rows, cols, row_ok, col_ok, bias_ptr,
                 residual_ptr, out_ptr, out_features, stride_residual_token, stride_out_token,
                 GATED, HAS_BIAS, HAS_RESIDUAL, residual)
