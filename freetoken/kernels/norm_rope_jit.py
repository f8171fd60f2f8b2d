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
  to the activations' dtype first, as the torch path computes them; optionally it also
  stores the token's rotated key and its value at its paged-cache slot (the attention's
  cache write, one launch fewer per layer).
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
                mask=ok, other=0.0)
    scale = rms_scale(x.to(tl.float32), channels, eps)
    w = tl.load(weight_ptr + cols, mask=cols < channels, other=0.0)[None, :]
    out = out_ptr + (token * stride_out_token + head * stride_out_head)[:, None] + cols[None, :]
    tl.store(out, rms_apply(x, scale[:, None], w, OFFSET), mask=ok)


@triton.jit
def rms_scale(x, channels, eps):
    """1 / rms of each row of float32 x [rows, N] (padding zeros): `rsqrt(mean(x^2) + eps)`
    over `channels` channels."""
    return 1.0 / tl.sqrt(ops.sum_(x * x, axis=1) / channels + eps)


@triton.jit
def rms_apply(x, scale, w, OFFSET: tl.constexpr):
    """x (in its dtype) normalised by `scale` (`rms_scale`, broadcast to x) and weighted by
    w, in x's dtype: `(x * scale) * (1 + w)` in float32 with OFFSET, else the normalised x
    rounded to x's dtype before the weight, as HF's RMSNorm."""
    dtype = x.dtype
    h = x.to(tl.float32) * scale
    if OFFSET:
        return (h * (1.0 + w.to(tl.float32))).to(dtype)
    return (h.to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)


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
    LAUNCH_NEXT: tl.constexpr = 0,
):
    """The ROWS rows r of block program_id(0) (token r // HEADS, head r % HEADS) of x and
    their gates z. LAUNCH_NEXT: the stream's next kernel, where it is launched with
    programmatic dependent launch (GatedDeltaNet's out_proj on a 16-bit row kernel,
    `gemv.ROW_PDL`), may start as this one starts (`jit_ops.launch_next`)."""
    ops.launch_next(LAUNCH_NEXT)
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
def rope_cos_sin(position, inv_freq, dtype: tl.constexpr):
    """cos and sin of `position * inv_freq`, rounded to the activations' `dtype` (as the
    torch path's `RotaryEmbedding.cos_sin`) and widened back to float32: the one rounding
    every rotary launch (this module's and the decode attention's) applies."""
    freqs = position.to(tl.float32) * inv_freq
    return tl.cos(freqs).to(dtype).to(tl.float32), tl.sin(freqs).to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(ptr, stride_token, stride_head, token, heads, cos, sin, copy_ptr,
                  stride_copy_head, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, COPY: tl.constexpr):
    """Rotate channels [0, 2 * HALF) of `heads` heads of one token in place; with COPY the
    rotated channels also go to `copy_ptr` (head h at h * stride_copy_head)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    first = ptr + token * stride_token + h[:, None] * stride_head + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
    y2 = (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)
    if COPY:
        dst = copy_ptr + h[:, None] * stride_copy_head + d[None, :]
        tl.store(dst, y1.to(copy_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(copy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(src_ptr, stride_src_head, dst_ptr, stride_dst_head, heads, start, channels,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Channels [start, channels) of `heads` heads from src to dst (cast to dst's dtype)."""
    h = tl.arange(0, BLOCK_H)
    d = start + tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < channels)
    x = tl.load(src_ptr + h[:, None] * stride_src_head + d[None, :], mask=mask)
    tl.store(dst_ptr + h[:, None] * stride_dst_head + d[None, :],
             x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    # pointers
    q_ptr,
    k_ptr,
    positions_ptr,
    inv_freq_ptr,
    v_ptr,              # WRITE_KV: [tokens, k_heads, head_dim]
    k_cache_ptr,        # WRITE_KV: [slots, k_heads, head_dim]
    v_cache_ptr,        # WRITE_KV: [slots, k_heads, head_dim]
    slot_mapping_ptr,   # WRITE_KV: [tokens]
    # sizes
    q_heads,
    k_heads,
    head_dim,
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    # meta
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    WRITE_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token program_id(0): its q and k heads rotated by its position; with WRITE_KV its
    rotated key (the channels past the rotary ones as they are) and its value also stored
    at its cache slot."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + d, mask=d < HALF, other=0.0)
    cos, sin = rope_cos_sin(tl.load(positions_ptr + token), inv_freq, q_ptr.dtype.element_ty)
    _rotate_heads(q_ptr, stride_q_token, stride_q_head, token, q_heads, cos, sin, q_ptr, 0,
                  HALF=HALF, BLOCK_H=BLOCK_QH, BLOCK_HALF=BLOCK_HALF, COPY=False)
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64) * stride_cache_slot
        _rotate_heads(k_ptr, stride_k_token, stride_k_head, token, k_heads, cos, sin,
                      k_cache_ptr + slot, stride_cache_head, HALF=HALF, BLOCK_H=BLOCK_KH,
                      BLOCK_HALF=BLOCK_HALF, COPY=True)
        _copy_heads(k_ptr + token * stride_k_token, stride_k_head, k_cache_ptr + slot,
                    stride_cache_head, k_heads, 2 * HALF, head_dim, BLOCK_H=BLOCK_KH,
                    BLOCK_D=BLOCK_D)
        _copy_heads(v_ptr + token * stride_v_token, stride_v_head, v_cache_ptr + slot,
                    stride_cache_head, k_heads, 0, head_dim, BLOCK_H=BLOCK_KH,
                    BLOCK_D=BLOCK_D)
    else:
        _rotate_heads(k_ptr, stride_k_token, stride_k_head, token, k_heads, cos, sin, k_ptr,
                      0, HALF=HALF, BLOCK_H=BLOCK_KH, BLOCK_HALF=BLOCK_HALF, COPY=False)
