"""Rotary position embedding (rotate-half layout): default, llama3 scaling, partial rotary."""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken.context import uses_kernels
from freetoken.kernels import norm_rope


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # On CPU in fp32 whatever the default device and dtype: the same frequencies everywhere,
    # and building under the meta device stays fast.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    return 1.0 / (base ** (exponents.to(torch.float32) / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` channels of each head by position."""

    def __init__(self, head_dim: int, rotary_dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = default_inv_freq(rotary_dim, base)
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise NotImplementedError(f"rope_type={rope_type!r} is not supported")
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cache: tuple | None = None):
        """`q`, `k`: [tokens, heads, head_dim]; returns both rotated (in place, by one
        Triton launch, in steps that take the CUDA paths). `cache` (v, k_cache, v_cache,
        slot_mapping) is written in the same launch, on the CUDA paths only (see
        `PagedAttention.forward`)."""
        if uses_kernels():
            return norm_rope.rotary_(q, k, positions, self.inv_freq, self.rotary_dim, cache)
        if cache is not None:
            raise ValueError("RotaryEmbedding: a cache write belongs to the CUDA paths")
        cos, sin = self.cos_sin(positions, q.dtype)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
