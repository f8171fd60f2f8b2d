"""Launchers of `norm_rope_jit`: RMSNorm, GatedDeltaNet's gated RMSNorm, SiLU-and-mul and
rotary embedding in one launch each, for the engine's CUDA path (its CPU path,
`freetoken.layers.norm`, `gated_norm`, `activation` and `rotary`, is the reference they are
checked against)."""

from __future__ import annotations

import torch

from freetoken.kernels import interpreting, jit_module, next_pow2, pdl

GATED_LAUNCH_NEXT = True
"""True: on sm_90+ the gated RMSNorm lets the next kernel launch as it starts
(`gated_rms_norm_kernel`'s LAUNCH_NEXT), so GatedDeltaNet's out_proj, a 16-bit row kernel
launched with programmatic dependent launch (`gemv.ROW_PDL`), loads its first weights while
the norm runs; False: it launches once the norm has finished (`bench/tile_ab.py` switch
`no-gnorm-launch-next`)."""


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("norm_rope_jit")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [tokens, heads, channels] with unit channel stride (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.unsqueeze(1) if x.dim() == 2 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim of x ([tokens, N] or [tokens, heads, N]); a new tensor of
    x's shape and dtype. `offset`: the weight is `1 + w` (applied in float32)."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    tokens, heads, channels = rows.shape
    if tokens:
        block = _rows_per_program(tokens * heads)
        _jit().rms_norm_kernel[(-(-tokens * heads // block),)](
            x_ptr=rows, weight_ptr=weight, out_ptr=out, rows=tokens * heads, heads=heads,
            channels=channels, eps=eps,
            stride_x_token=rows.stride(0), stride_x_head=rows.stride(1),
            stride_out_token=out.stride(0), stride_out_head=out.stride(1),
            OFFSET=offset, ROWS=block, BLOCK_N=next_pow2(channels),
            num_warps=4 if channels >= 1024 else 1)
    return out.view(x.shape)


def _rows_per_program(rows: int) -> int:
    """Rows per program of the norm kernels: one on a GPU (a row's reduction is one
    program's); up to 64 in the interpreter, which pays per program and per operation."""
    return min(64, next_pow2(rows)) if interpreting() else 1


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """`w * rms_norm(x) * silu(z)` over the last dim of x [tokens, heads, N]; z of the same
    shape (a view is fine). A new tensor of x's shape and dtype."""
    tokens, heads, channels = x.shape
    x = x.contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty_like(x)
    if tokens:
        block = _rows_per_program(tokens * heads)
        _jit().gated_rms_norm_kernel[(-(-tokens * heads // block),)](
            x_ptr=x, z_ptr=z, weight_ptr=weight, out_ptr=out, rows=tokens * heads,
            channels=channels, eps=eps,
            stride_x_row=channels, stride_z_token=z.stride(0), stride_z_head=z.stride(1),
            stride_out_row=channels, HEADS=heads, ROWS=block, BLOCK_N=next_pow2(channels),
            LAUNCH_NEXT=int(GATED_LAUNCH_NEXT and pdl.available(x)), num_warps=1)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for x = [gate | up] on the last dim of a [tokens, 2N] tensor."""
    tokens, width = x.shape
    half = width // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(tokens, half, dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(half))
    if tokens:
        _jit().silu_and_mul_kernel[(tokens, -(-half // block))](
            x_ptr=x, out_ptr=out, half=half, stride_x_token=x.stride(0),
            stride_out_token=out.stride(0), BLOCK_N=block, num_warps=4)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            inv_freq: torch.Tensor, rotary_dim: int,
            cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` channels of q [tokens, q_heads, d] and k
    [tokens, k_heads, d] in place (rotate-half); returns them. With `cache` = (v, k_cache,
    v_cache, slot_mapping) the same launch also stores the rotated k and v [tokens, k_heads,
    d] at cache slots `slot_mapping` [tokens] of k_cache and v_cache [blocks, block_size,
    k_heads, d]."""
    tokens, k_heads, head_dim = k.shape
    if not tokens:
        return q, k
    half = rotary_dim // 2
    v = k_flat = v_flat = slot_mapping = k
    stride_v, stride_cache = (0, 0), (0, 0)
    if cache is not None:
        v, k_cache, v_cache, slot_mapping = cache
        if v.shape != k.shape or k_cache.shape[-2:] != (k_heads, head_dim) or \
                v_cache.shape != k_cache.shape or slot_mapping.shape != (tokens,):
            raise ValueError(f"rotary_: k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} and slots "
                             f"{tuple(slot_mapping.shape)} do not fit one cache write")
        k_flat = k_cache.view(-1, k_heads, head_dim)
        v_flat = v_cache.view(-1, k_heads, head_dim)
        v = v if v.stride(-1) == 1 else v.contiguous()
        stride_v, stride_cache = (v.stride(0), v.stride(1)), (k_flat.stride(0),
                                                               k_flat.stride(1))
    _jit().rotary_kernel[(tokens,)](
        q_ptr=q, k_ptr=k, positions_ptr=positions, inv_freq_ptr=inv_freq, v_ptr=v,
        k_cache_ptr=k_flat, v_cache_ptr=v_flat, slot_mapping_ptr=slot_mapping,
        q_heads=q.shape[1], k_heads=k_heads, head_dim=head_dim,
        stride_q_token=q.stride(0), stride_q_head=q.stride(1),
        stride_k_token=k.stride(0), stride_k_head=k.stride(1),
        stride_v_token=stride_v[0], stride_v_head=stride_v[1],
        stride_cache_slot=stride_cache[0], stride_cache_head=stride_cache[1],
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_QH=next_pow2(q.shape[1]),
        BLOCK_KH=next_pow2(k_heads), WRITE_KV=cache is not None,
        BLOCK_D=next_pow2(head_dim), num_warps=1)
    return q, k
