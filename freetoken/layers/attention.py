"""Attention over a paged KV cache: plain torch on CPU (the reference), one Triton launch per
layer and step where the forward context carries device tensors (CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import ForwardContext, get_forward_context
from freetoken.kernels import paged_attention as kernel
from freetoken.layers.invariant import elementwise

FOLD_NORM_GATE = True
"""True: a decode step on the CUDA paths folds the per-head q/k RMSNorm and the output gate
given to `PagedAttention` into its attention launch (`paged_attention.QKNorm`, `gate`), two
and two launches fewer per layer of Qwen3.5's gated attention (outside the tp_invariant
mode); False: they run as launches of their own, before and after it (`bench/tile_ab.py`
switch `no-attn-fold`)."""


class PagedAttention(nn.Module):
    """Rotates this step's q and k, writes k and v into the paged cache, then attends each
    sequence's queries to its cached keys with a causal offset. Heads are rank-local; GQA
    groups are expanded."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Attach this layer's cache views: [num_blocks, block_size, num_kv_heads, head_dim]."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, rotary: nn.Module, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, qk_norm: tuple[nn.Module, nn.Module] | None
                = None, gate: torch.Tensor | None = None, canonical=None) -> torch.Tensor:
        """q: [T, heads, d], k and v: [T, kv_heads, d] -> [T, heads, d]: q and k normalised
        per head by `qk_norm` (q_norm, k_norm) where given and rotated by `rotary` at
        `positions`, this step's k and v written into the cache, then attention; with `gate`
        [T, heads, d] the output times `sigmoid(gate)` (through `invariant.elementwise` with
        `canonical`, the tp_invariant mode's reductions). On CPU plain torch; on the CUDA
        paths a decode step is one launch (the attention kernel normalises and rotates q and
        k, writes the cache first and gates its rows: `FOLD_NORM_GATE`; outside the
        tp_invariant mode, whose norms and gate keep their own launches, so that their bits
        do not depend on how many heads a program holds), a prefill two
        (`norm_rope.rotary_` with the cache write, then attention) besides the norms and the
        gate."""
        ctx = get_forward_context()
        if ctx.device is not None and not ctx.is_prefill:
            fold = FOLD_NORM_GATE and canonical is None
            norm = _folded_norm(qk_norm) if fold else None
            folded_gate = gate if fold else None
            if qk_norm is not None and norm is None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            out = self._kernel(q, ctx, kernel.DecodeRope(positions, rotary.inv_freq, k, v,
                                                         ctx.slot_mapping, norm), folded_gate)
            if folded_gate is not None:
                return out
        else:
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            out = self._unfolded(rotary, positions, q, k, v, ctx)
        return out if gate is None else out * elementwise(canonical, torch.sigmoid, gate)

    def _unfolded(self, rotary: nn.Module, positions: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Rotary, cache write and attention of a prefill on the CUDA paths (two launches)
        or of any step on CPU (torch)."""
        if ctx.device is not None:
            q, _ = rotary(positions, q, k, (v, self.k_cache, self.v_cache, ctx.slot_mapping))
            return self._kernel(q, ctx)
        q, k = rotary(positions, q, k)
        block_size = self.k_cache.shape[1]
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat[ctx.slot_mapping] = k.to(k_flat.dtype)
        v_flat[ctx.slot_mapping] = v.to(v_flat.dtype)
        if not ctx.is_prefill:
            return self._decode(q, k_flat, v_flat, *ctx.decode_layout(block_size, q.device))
        out = torch.empty_like(q)
        start = 0
        for qlen, clen, blocks in zip(ctx.query_lens, ctx.context_lens, ctx.block_tables):
            slots = _context_slots(blocks, clen, block_size, q.device)
            out[start : start + qlen] = self._attend(q[start : start + qlen], k_flat[slots],
                                                     v_flat[slots])
            start += qlen
        return out

    def _kernel(self, q: torch.Tensor, ctx: ForwardContext,
                rope: kernel.DecodeRope | None = None, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
        """All sequences in one launch, reading the block tables on the device."""
        work = None
        if ctx.is_prefill:
            rows = kernel.rows_per_program(self.num_heads, self.num_kv_heads, self.head_dim,
                                           decode=False)
            per = rows // (self.num_heads // self.num_kv_heads)
            work = ctx.cached(("prefill_work", per), lambda: kernel.prefill_work(
                ctx.query_lens, per, q.device))
        dev = ctx.device
        return kernel.paged_attention(q if q.stride(-1) == 1 else q.contiguous(), self.k_cache,
                                      self.v_cache, dev.block_tables, dev.query_starts,
                                      dev.context_lens, self.scale, work, rope, gate)

    def _decode(self, q, k_flat, v_flat, slots, valid) -> torch.Tensor:
        """One new token per sequence, all sequences in one call: keys padded to the longest
        context and masked."""
        groups = self.num_heads // self.num_kv_heads
        k = k_flat[slots].to(q.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
        v = v_flat[slots].to(q.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v,
                                             attn_mask=valid[:, None, None, :], scale=self.scale)
        return out[:, :, 0, :]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qlen, clen = q.shape[0], k.shape[0]
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1).to(q.dtype)
        v = v.repeat_interleave(groups, dim=1).to(q.dtype)
        q_pos = torch.arange(clen - qlen, clen, device=q.device)
        mask = q_pos[:, None] >= torch.arange(clen, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            scale=self.scale,
        )
        return out.transpose(0, 1)


def _folded_norm(qk_norm: tuple[nn.Module, nn.Module] | None) -> kernel.QKNorm | None:
    """The decode launch's `QKNorm` for (q_norm, k_norm), or None where they are not folded
    (none given, or norms that differ in eps or offset)."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    if q_norm.eps != k_norm.eps or q_norm.offset != k_norm.offset:
        return None
    return kernel.QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset)


def _context_slots(blocks: list[int], length: int, block_size: int, device) -> torch.Tensor:
    pos = torch.arange(length, device=device)
    table = torch.tensor(blocks, device=device, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
