"""The Qwen3.5-MoE text model: per layer either GatedDeltaNet or gated full attention (the
config's `layer_types`), then the MoE block; Gemma-style `1 + w` RMSNorms in fp32."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.context import uses_kernels
from freetoken.layers.norm import RMSNorm
from freetoken.models.base import CausalLM, DecoderModel
from freetoken.models.qwen3_5_moe.attention import GatedAttention
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
from freetoken.models.qwen3_5_moe.moe import SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35MoeConfig, layer: int):
        super().__init__()
        self.is_linear = cfg.is_linear_layer(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, f"model.layers.{layer}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, f"model.layers.{layer}.self_attn")
        self.mlp = SparseMoeBlock(cfg, f"model.layers.{layer}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if uses_kernels():
            return self._forward_fused(positions, h)
        x = self.input_layernorm(h)
        h = h + (self.linear_attn(x) if self.is_linear else self.self_attn(positions, x))
        return h + self.mlp(self.post_attention_layernorm(h))

    def _forward_fused(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The CUDA path: the input norm is applied inside the first projection and the
        residual add inside the last one of the mixer, where the batch is a decode step's
        (`freetoken.kernels.gemv`; otherwise the same steps unfused), and likewise the
        post-attention norm inside the MoE block's router and the residual add inside its
        experts (`SparseMoeBlock.forward_residual`). The mixer returns the residual sum, not
        its own output, so it is called through `forward`: as a module call its hooks would
        record that sum as the mixer's output (bisect compares a module's output with HF's,
        and the Llama path likewise never calls its attention module)."""
        norm = self.input_layernorm
        if self.is_linear:
            h = self.linear_attn.forward(h, norm=norm, residual=h)
        else:
            h = self.self_attn.forward(positions, h, norm=norm, residual=h)
        return self.mlp.forward_residual(h, self.post_attention_layernorm)


class Qwen35MoeForCausalLM(CausalLM):
    """Parameter names follow the text-only checkpoint layout (`model.layers.N...`) whichever
    layout the weights come from."""

    def __init__(self, cfg: Qwen35MoeConfig):
        super().__init__(cfg, DecoderModel(cfg, DecoderLayer, norm_offset=True))

    def linear_state_layers(self) -> list[GatedDeltaNet]:
        """Layers that keep a per-sequence state (the engine allocates it)."""
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]
