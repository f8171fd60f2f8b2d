"""Llama-family decoder layer (also the base of Qwen3 and Qwen3-MoE): attention with a fused,
head-split QKV projection and a row-parallel output; SiLU-gated MLP. The decoder stack and
the LM head are `freetoken.models.base`'s."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.context import uses_kernels
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.attention import PagedAttention
from freetoken.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken.models.base import CausalLM, DecoderModel


class Attention(nn.Module):
    """`prefix`: the module's name (`model.layers.L.self_attn`), which picks the formats of
    its projections from the quantization config."""

    def __init__(self, cfg: ModelConfig, prefix: str = ""):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias,
                                          fmt=cfg.format_of(f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size,
                                        bias=cfg.attention_bias, what="num_attention_heads",
                                        fmt=cfg.format_of(f"{prefix}.o_proj"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = RotaryEmbedding(hd, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention of the projected `qkv` [T, q + k + v], before `o_proj`: [T, heads * d]."""
        tokens, hd = qkv.shape[0], self.attn.head_dim
        q, k, v = qkv.split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, hd)
        k = k.view(tokens, self.num_kv_heads, hd)
        v = v.view(tokens, self.num_kv_heads, hd)
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        return self.attn(self.rotary, positions, q, k, v, qk_norm=qk_norm,
                         canonical=self.qkv_proj.canonical).reshape(tokens, -1)


class MLP(nn.Module):
    """`formats`: (gate_up_proj, down_proj) module formats, None for unquantized."""

    def __init__(self, hidden: int, intermediate: int, formats: tuple = (None, None)):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2,
                                                       what="intermediate_size", fmt=formats[0])
        self.down_proj = RowParallelLinear(intermediate, hidden, what="intermediate_size",
                                           fmt=formats[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.gate_up_proj.canonical))

    def forward_residual(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """`h + self(norm(h))` in two launches on the CUDA path (see `DecoderLayer`)."""
        return self.down_proj.forward_residual(self.gate_up_proj.forward_gated(h, norm), h)


def mlp_formats(cfg: ModelConfig, layer: int) -> tuple:
    """The (gate_up_proj, down_proj) formats of dense layer `layer`'s MLP."""
    mlp = f"model.layers.{layer}.mlp"
    return cfg.format_of(f"{mlp}.gate_up_proj"), cfg.format_of(f"{mlp}.down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, f"model.layers.{layer}.self_attn")
        self.mlp = self.make_mlp(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, mlp_formats(cfg, layer))

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if uses_kernels():
            return self._forward_fused(positions, h)
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))

    def _forward_fused(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The CUDA path: each norm is applied inside the projection after it, each residual
        add inside the projection before it and SiLU-and-mul inside gate_up, where the batch
        is a decode step's (`freetoken.kernels.gemv`; otherwise the same steps unfused)."""
        attn = self.self_attn
        qkv = attn.qkv_proj.forward_normed(h, self.input_layernorm)
        h = attn.o_proj.forward_residual(attn.attend(positions, qkv), h)
        if type(self.mlp) is MLP:
            return self.mlp.forward_residual(h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLM):
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderModel(cfg, self.layer_cls))
