"""Llama-family decoder (also the base of Qwen3 and Qwen3-MoE): attention with a fused,
head-split QKV projection and a row-parallel output; SiLU-gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.attention import PagedAttention
from freetoken.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from freetoken.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size,
                                        bias=cfg.attention_bias, what="num_attention_heads")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = RotaryEmbedding(hd, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        tokens, hd = x.shape[0], self.attn.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, hd)
        k = k.view(tokens, self.num_kv_heads, hd)
        v = v.view(tokens, self.num_kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2,
                                                       what="intermediate_size")
        self.down_proj = RowParallelLinear(intermediate, hidden, what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = self.make_mlp(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class CausalLM(nn.Module):
    """A decoder stack plus the vocab-parallel LM head: token ids and positions of a flat batch
    -> hidden states; `compute_logits` -> full vocab logits on every rank."""

    def __init__(self, cfg, model: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = model
        tied = model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tied=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]


class LlamaForCausalLM(CausalLM):
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderModel(cfg, self.layer_cls))
