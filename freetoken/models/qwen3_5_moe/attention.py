"""Qwen3.5 gated full attention: q, its per-head output gate, k and v in one column-parallel
projection (split by head, KV heads replicated when fewer than ranks); per-head q/k RMSNorm
with `1 + w`; partial rotary; `o_proj(attn * sigmoid(gate))`, o_proj row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.distributed import get_tp_info
from freetoken.layers.attention import PagedAttention
from freetoken.layers.layout import LocalRows
from freetoken.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.quantization import Split, linear_method
from freetoken.layers.rotary import RotaryEmbedding
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig


class QGateKVParallelLinear(LinearBase):
    """Rank-local weight `[q | gate | k | v]`: q and gate rows of this rank's heads (grouped,
    not interleaved as in the checkpoint), then its KV head(s). In block FP8 the q and gate
    scales are held one row per weight row (expanded at load, see
    `freetoken.formats.fp8.interleaved`), so they move with their heads whatever head_dim."""

    def __init__(self, cfg: Qwen35MoeConfig, fmt=None):
        rows = self.layout(cfg, get_tp_info().size)
        self.num_heads = rows.size("q") // cfg.head_dim
        self.num_kv_heads = rows.size("k") // cfg.head_dim
        self.local_sizes = list(rows.sizes)
        full_q = cfg.num_attention_heads * cfg.head_dim
        full_kv = Split(cfg.num_key_value_heads * cfg.head_dim, heads=cfg.num_key_value_heads,
                        group=1)
        q_rows = Split(full_q, per_row=True, group=0)
        quant = linear_method(fmt, [q_rows, q_rows, full_kv,
                                    Split(full_kv.full_size, full_kv.heads, group=2)],
                              Split.whole(cfg.hidden_size))
        super().__init__(cfg.hidden_size, rows.total, bias=cfg.attention_bias, quant=quant)

    @staticmethod
    def layout(cfg: Qwen35MoeConfig, tp: int) -> LocalRows:
        """`[q | gate | k | v]` rows at `tp` ranks (q_proj's shard fills q through gate)."""
        qkv = QKVParallelLinear.layout(cfg.head_dim, cfg.num_attention_heads,
                                       cfg.num_key_value_heads, tp)
        q, kv = qkv.size("q"), qkv.size("k")
        return LocalRows(("q", "gate", "k", "v"), (q, q, kv, kv))


class GatedAttention(nn.Module):
    """`prefix`: the module's engine name, which picks its projections' formats."""

    def __init__(self, cfg: Qwen35MoeConfig, prefix: str = ""):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QGateKVParallelLinear(cfg, cfg.format_of(f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size,
                                        bias=cfg.attention_bias, what="num_attention_heads",
                                        fmt=cfg.format_of(f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=True)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset=True)
        # Text positions are the same on every mrope axis, so mrope is plain rotary here.
        self.rotary = RotaryEmbedding(hd, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `norm`, x is the residual stream and the projection takes `norm(x)` (applied
        inside it on the CUDA path); with `residual`, the result is `residual + out` (added
        inside o_proj where it can be)."""
        tokens, hd = x.shape[0], self.attn.head_dim
        projected = self.qkv_proj(x) if norm is None else self.qkv_proj.forward_normed(x, norm)
        q, gate, k, v = projected.split(self.qkv_proj.local_sizes, dim=-1)
        heads, kv_heads = (tokens, self.num_heads, hd), (tokens, self.num_kv_heads, hd)
        gated = self.attn(self.rotary, positions, q.view(heads), k.view(kv_heads),
                          v.view(kv_heads), qk_norm=(self.q_norm, self.k_norm),
                          gate=gate.view(heads), canonical=self.qkv_proj.canonical
                          ).reshape(tokens, -1)
        if residual is None:
            return self.o_proj(gated)
        return self.o_proj.forward_residual(gated, residual)
