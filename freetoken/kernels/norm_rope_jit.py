"""Triton kernels for the small per-token steps of every decoder layer, one launch each where
plain torch spends several (upcast, square, mean, rsqrt, scale, cast; cos, sin, halves,
rotation, concatenation). Arithmetic in float32, one rounding to the output dtype at each
point the torch path rounds.

- `rms_norm_kernel`: each program normalises ROWS rows (token, head) of N channels (one on
  a GPU; many in the interpreter, whose cost is per program and per operation):
  `w * (x * rsqrt(mean(x^2) + eps))` (the normalised row rounded to x's dtype before the
  weight, as HF's RMSNorm) or, with OFFSET, `x * rsqrt(...) * (1 + w)` in float32 (Gemma /
  Qwen3.5).
- `gated_rms_norm_kernel`: GatedDeltaNet's output norm, ROWS rows a program as above:
  `w * rms_norm(x)` (rounded to x's dtype twice, as the torch path) times `silu(z)` in
  float32, rounded once more.
- `silu_and_mul_kernel`: program (token, block) writes `silu(gate) * up` for `x = [gate | up]`.
- `rotary_kernel`: program t rotates the first ROTARY channels of every q and k head of
  token t in place (rotate-half layout), with cos and sin of `position * inv_freq` rounded
  to the activations' dtype first, as the torch path computes them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def rms_norm_kernel(
    # pointers
    x_ptr,
    weight_ptr,
    out_ptr,
    # sizes
    rows,
    heads,
    channels,
    eps,
    # strides
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    # meta
    OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[t, h] = rms_norm(x[t, h]) for the ROWS rows r = t * heads + h of block
    program_id(0)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token, head = r // heads, r % heads
    cols = tl.arange(0, BLOCK_N)
    ok = (r < rows)[:, None] & (cols < channels)[None, :]
    x = tl.load(x_ptr + (token * stride_x_token + head * stride_x_head)[:, None] + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(ops.sum_(x * x, axis=1) / channels + eps)
    w = tl.load(weight_ptr + cols, mask=cols < channels, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if OFFSET:
        y = x * scale[:, None] * (1.0 + w)
    else:
        y = (x * scale[:, None]).to(dtype).to(tl.float32) * w
    out = out_ptr + (token * stride_out_token + head * stride_out_head)[:, None] + cols[None, :]
    tl.store(out, y.to(dtype), mask=ok)


@triton.jit
def gated_rms_norm_kernel(
    # pointers
    x_ptr,
    z_ptr,
    weight_ptr,
    out_ptr,
    # sizes
    rows,
    channels,
    eps,
    # strides
    stride_x_row,
    stride_z_token,
    stride_z_head,
    stride_out_row,
    # meta
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The ROWS rows r of block program_id(0) (token r // HEADS, head r % HEADS) of x and
    their gates z."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (r < rows)[:, None] & (cols < channels)[None, :]
    x = tl.load(x_ptr + (r * stride_x_row)[:, None] + cols[None, :], mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(ops.sum_(xf * xf, axis=1) / channels + eps)
    w = tl.load(weight_ptr + cols, mask=cols < channels, other=0.0).to(tl.float32)[None, :]
    h = (w * (xf * scale[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    z_rows = (r // HEADS) * stride_z_token + (r % HEADS) * stride_z_head
    z = tl.load(z_ptr + z_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (r * stride_out_row)[:, None] + cols[None, :],
             (h * z * ops.sigmoid(z)).to(dtype), mask=ok)


@triton.jit
def silu_and_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    half,
    # strides
    stride_x_token,
    stride_out_token,
    # meta
    BLOCK_N: tl.constexpr,
):
    """Token program_id(0), columns of block program_id(1): silu(gate) * up, each rounded
    to x's dtype as the torch path rounds them."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < half
    gate = tl.load(x_ptr + token * stride_x_token + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + token * stride_x_token + half + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g * ops.sigmoid(g)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out_token + cols,
             (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)


@triton.jit
def _rotate_heads(ptr, stride_token, stride_head, token, heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate channels [0, 2 * HALF) of `heads` heads of one token in place."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    first = ptr + token * stride_token + h[:, None] * stride_head + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def rotary_kernel(
    # pointers
    q_ptr,
    k_ptr,
    positions_ptr,
    inv_freq_ptr,
    # sizes
    q_heads,
    k_heads,
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    # meta
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    """Token program_id(0): its q and k heads rotated by its position."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + d, mask=d < HALF, other=0.0)
    freqs = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    dtype = q_ptr.dtype.element_ty
    cos = tl.cos(freqs).to(dtype).to(tl.float32)
    sin = tl.sin(freqs).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, stride_q_token, stride_q_head, token, q_heads, cos, sin,
                  HALF=HALF, BLOCK_H=BLOCK_QH, BLOCK_HALF=BLOCK_HALF)
    _rotate_heads(k_ptr, stride_k_token, stride_k_head, token, k_heads, cos, sin,
                  HALF=HALF, BLOCK_H=BLOCK_KH, BLOCK_HALF=BLOCK_HALF)
