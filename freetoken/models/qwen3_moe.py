"""Qwen3-MoE: Qwen3 attention, sparse MoE MLP (no shared expert) on the layers the config
marks, experts split on the intermediate dimension, one all-reduce per MoE block."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.distributed import get_communicator
from freetoken.formats.quant import NVFP4
from freetoken.layers import invariant
from freetoken.layers.linear import ReplicatedLinear
from freetoken.layers.moe import FusedExperts, route
from freetoken.models.decoder_modules import experts_format
from freetoken.models.llama import MLP, DecoderLayer, LlamaForCausalLM, mlp_formats


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = _routed_experts(cfg, experts_format(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        if self.experts.canonical is not None:
            return invariant.finish(self.experts.leaves(x, weights, ids), x.dtype)
        return get_communicator().all_reduce(self.experts(x, weights, ids))


def _routed_experts(cfg: ModelConfig, fmt) -> nn.Module:
    """The experts in their checkpoint format: unquantized, NVFP4 or block FP8."""
    sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    if fmt is None:
        return FusedExperts(*sizes)
    if fmt.kind == NVFP4:
        from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts

        return NVFP4FusedExperts(*sizes, global_scale_is_reciprocal=fmt.global_scale_is_reciprocal)
    from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts

    return BlockFP8FusedExperts(*sizes, fmt.block, fmt.input_scales)


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if cfg.is_moe_layer(layer):
            return SparseMoeBlock(cfg)
        return MLP(cfg.hidden_size, cfg.intermediate_size, mlp_formats(cfg, layer))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = MoeDecoderLayer
