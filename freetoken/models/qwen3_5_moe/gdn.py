"""GatedDeltaNet, Qwen3.5's linear-attention layer, split by head across ranks.

`in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` are one column-parallel projection
here; each rank holds its key heads' q and k rows, its value heads' v, z, b and a rows, the
matching conv1d channels, `A_log` and `dt_bias` entries, and `out_proj`'s input columns (a
row-parallel layer, so one all-reduce). Value head j reads key head `j // (nv / nk)`; whole
groups land on one rank because both head counts are split evenly.

Each running sequence owns a linear-state slot (see `freetoken.engine.kv_cache.StatePool`):
the last `kernel - 1` conv inputs and an fp32 recurrent state [value heads, dk, dv]. A
sequence whose context starts in this step starts from zero state; otherwise it continues
from its slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import get_forward_context, uses_kernels
from freetoken.distributed import divide, get_tp_info
from freetoken.kernels.delta_rule import conv_update, gated_delta_decode
from freetoken.layers import invariant
from freetoken.layers.causal_conv import CausalConv1d
from freetoken.layers.delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from freetoken.layers.gated_norm import GatedRMSNorm
from freetoken.layers.layout import LocalRows
from freetoken.layers.linear import LinearBase, RowParallelLinear
from freetoken.layers.quantization import Split, linear_method
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig

GDN_SEGMENTS = ("q", "k", "v", "z", "b", "a")
"""The fused in_proj's row segments, in order (in_proj_qkv's three, then z, b and a)."""


class GatedDeltaNet(nn.Module):
    """[T, hidden] -> [T, hidden] over the flat batch the forward context describes."""

    def __init__(self, cfg: Qwen35MoeConfig, prefix: str = ""):
        super().__init__()
        rows = self.in_proj_layout(cfg, get_tp_info().size)
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = rows.size("q"), rows.size("v")
        self.num_k_heads, self.num_v_heads = self.key_dim // self.head_k_dim, rows.size("b")
        self.total_k_heads = cfg.linear_num_key_heads
        conv_dim = rows.size("q", "v")
        self.local_sizes = [conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj, self.in_proj_ba = in_projections(cfg, prefix, rows)
        self.conv1d = CausalConv1d(conv_dim, cfg.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(cfg.linear_num_value_heads * self.head_v_dim,
                                          cfg.hidden_size, what="linear_value_dim",
                                          fmt=cfg.format_of(f"{prefix}.out_proj"))
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)

    @staticmethod
    def in_proj_layout(cfg: Qwen35MoeConfig, tp: int) -> LocalRows:
        """The rank-local `[q | k | v | z | b | a]` rows of the fused in_proj at `tp` ranks:
        its key heads' q and k, its value heads' v and z, one b and one a row per value
        head (q through v are also conv1d's channels)."""
        key = divide(cfg.linear_num_key_heads, tp, "linear_num_key_heads") * \
            cfg.linear_key_head_dim
        heads = divide(cfg.linear_num_value_heads, tp, "linear_num_value_heads")
        value = heads * cfg.linear_value_head_dim
        return LocalRows(GDN_SEGMENTS, (key, key, value, value, heads, heads))

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device) -> None:
        """Conv state [slots, local channels, kernel - 1] in the activation dtype (as HF
        caches it) and recurrent state [slots, local value heads, dk, dv] in fp32."""
        self.conv_state = torch.zeros(num_slots, *self.conv1d.state_shape(), dtype=dtype,
                                      device=device)
        self.recurrent_state = torch.zeros(num_slots, self.num_v_heads, self.head_k_dim,
                                           self.head_v_dim, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `norm`, x is the residual stream and in_proj takes `norm(x)` (applied inside
        the projection on the CUDA path); with `residual`, the result is `residual + out`
        (added inside out_proj where it can be)."""
        ctx = get_forward_context()
        if ctx.seq_slots is None:
            raise RuntimeError("GatedDeltaNet needs linear-state slots in the forward context")
        tokens = x.shape[0]
        qkv, z, b, a = self._project(x, norm)
        starts = [c - q for q, c in zip(ctx.query_lens, ctx.context_lens)]
        slots = (ctx.device.seq_slots if ctx.device is not None
                 else torch.tensor(ctx.seq_slots, dtype=torch.long, device=x.device))
        decode = all(q == 1 for q in ctx.query_lens) and all(starts)
        if decode and uses_kernels():
            return self._output(self._fused_decode(qkv, a, b, slots), z, residual)
        beta, g = self._gates(a, b)
        if decode:
            # Decode: one token per sequence, all continuing; one batched step.
            core = self._mix(qkv[:, None], g[:, None], beta[:, None], slots, False)[:, 0]
        elif ctx.device is not None and not any(starts) and len(set(ctx.query_lens)) == 1:
            # Fresh prompts of one length (CUDA path): one batched chunked pass, not one per
            # sequence. The CPU path keeps the per-sequence loop, whose rounding is the oracle.
            batch = len(ctx.query_lens)
            core = self._mix(qkv.view(batch, -1, qkv.shape[-1]), g.view(batch, -1, g.shape[-1]),
                             beta.view(batch, -1, beta.shape[-1]), slots, True).flatten(0, 1)
        else:
            core = x.new_empty(tokens, self.num_v_heads, self.head_v_dim)
            offset = 0
            for i, (qlen, start) in enumerate(zip(ctx.query_lens, starts)):
                part = slice(offset, offset + qlen)
                core[part] = self._mix(qkv[None, part], g[None, part], beta[None, part],
                                       slots[i : i + 1], start == 0)[0]
                offset += qlen
        return self._output(core, z, residual)

    def _project(self, x: torch.Tensor, norm: nn.Module | None) -> tuple[torch.Tensor, ...]:
        """qkv, z, b, a of `norm(x)` (x as is when `norm` is None): from one GEMM (the input
        norm folded into it on the CUDA decode path), or from two where qkv|z is quantized
        and b|a not (the norm then inside qkv|z's launch where it can be, which stores
        norm(x) for b|a)."""
        if self.in_proj_ba is None:
            projected = self.in_proj(x) if norm is None else self.in_proj.forward_normed(x, norm)
            return projected.split(self.local_sizes, dim=-1)
        fused = None if norm is None else self.in_proj.forward_keeping_normed(x, norm)
        if fused is None:
            x = x if norm is None else norm(x)
            projected = self.in_proj(x)
        else:
            # The quantized qkv|z applied the norm and stored norm(x) for b|a.
            x, projected = fused
        qkv, z = projected.split(self.local_sizes[:2], dim=-1)
        b, a = self.in_proj_ba(x).split(self.local_sizes[2:], dim=-1)
        return qkv, z, b, a

    def _gates(self, a: torch.Tensor, b: torch.Tensor):
        """beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias), fp32."""
        canonical = self.out_proj.canonical
        beta = invariant.elementwise(canonical, torch.sigmoid, b)
        rate = invariant.elementwise(canonical, torch.exp, self.A_log.float())
        return beta, -rate * invariant.elementwise(canonical, F.softplus, a.float() + self.dt_bias)

    def _exp(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.elementwise(self.out_proj.canonical, torch.exp, x)

    def _output(self, core: torch.Tensor, z: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Gated norm of the mixed values [T, value heads, dv], then out_proj (plus the
        residual when given)."""
        tokens = core.shape[0]
        z = z.view(tokens, self.num_v_heads, self.head_v_dim)
        normed = self.norm(core, z).reshape(tokens, -1)
        if residual is None:
            return self.out_proj(normed)
        return self.out_proj.forward_residual(normed, residual)

    def _fused_decode(self, qkv, a, b, slots: torch.Tensor) -> torch.Tensor:
        """The CUDA path of a decode step in two launches: the conv update, then gating,
        normalisation and the delta rule, each reading and writing its slot's state once,
        in place."""
        batch = qkv.shape[0]
        mixed = conv_update(qkv, self.conv1d.weight, self.conv_state, slots)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        key_shape = (batch, self.num_k_heads, self.head_k_dim)
        out = gated_delta_decode(q.reshape(key_shape), k.reshape(key_shape),
                                 v.reshape(batch, self.num_v_heads, self.head_v_dim), a, b,
                                 self.A_log, self.dt_bias, self.recurrent_state, slots,
                                 out_dtype=qkv.dtype)
        return out

    def _mix(self, qkv, g, beta, slots: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Conv, then the delta rule, for B sequences of equal length T: qkv [B, T, C],
        g and beta [B, T, value heads]. Reads (unless `fresh`) and writes the slots' state.
        Returns [B, T, value heads, dv] in qkv's dtype."""
        mixed, conv_state = self.conv1d(qkv, None if fresh else self.conv_state[slots])
        self.conv_state[slots] = conv_state.to(self.conv_state.dtype)
        pad = self._padded_heads()
        q, k, v = self._heads(mixed, pad)
        initial = None if fresh else self.recurrent_state[slots]
        if pad:
            g, beta = (_pad_heads(t, pad * self.group) for t in (g, beta))
            initial = None if initial is None else _pad_heads(initial, pad * self.group, dim=1)
        # As HF: the recurrent rule for a single continuing token, the chunked rule otherwise.
        rule = recurrent_gated_delta_rule if qkv.shape[1] == 1 and not fresh \
            else chunk_gated_delta_rule
        out, state = rule(q, k, v, g, beta, initial, exp=self._exp)
        self.recurrent_state[slots] = state[:, :self.num_v_heads]
        return out[:, :, :self.num_v_heads].to(qkv.dtype)

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    def _padded_heads(self) -> int:
        """Key heads of zeros appended to this rank's for the delta rule: in the tp_invariant
        mode on the CUDA path, up to the model's count, so that the rule's batched GEMMs,
        triangular solves and norms have TP=1's shapes at every TP size (cuBLAS picks its
        algorithm by shape, batch count included, and a head's result moves with it; a
        zero head's result is zeros and is dropped). None elsewhere (0)."""
        if self.out_proj.canonical is None or not uses_kernels():
            return 0
        return self.total_k_heads - self.num_k_heads

    def _heads(self, mixed: torch.Tensor, pad: int = 0):
        """q, k: fp32 [B, T, value heads, dk], L2-normalised (q also scaled by dk^-0.5) and
        repeated so value head j sees key head j // group; v: [B, T, value heads, dv]; each
        with `pad` key heads' worth of zero heads appended (`_padded_heads`)."""
        batch, length, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        shape = (batch, length, self.num_k_heads, self.head_k_dim)
        q, k = (_pad_heads(t.reshape(shape).float(), pad) for t in (q, k))
        q = l2norm(q) * self.head_k_dim**-0.5
        k = l2norm(k)
        v = _pad_heads(v.reshape(batch, length, self.num_v_heads, self.head_v_dim),
                       pad * self.group)
        return q.repeat_interleave(self.group, dim=2), k.repeat_interleave(self.group, dim=2), v


def _pad_heads(t: torch.Tensor, pad: int, dim: int = 2) -> torch.Tensor:
    """`t` with `pad` zero heads appended along its heads dimension `dim` (as is for 0)."""
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def in_projections(cfg: Qwen35MoeConfig, prefix: str, rows: LocalRows):
    """(in_proj, in_proj_ba) over the local `rows`: one unquantized GEMM over [qkv | z | b |
    a] (in_proj_ba None), or, where the config quantizes in_proj_qkv and in_proj_z (b and a
    never are), in_proj over [qkv | z] in that format, each of q, k, v and z with its own
    scale rows, and an unquantized in_proj_ba over [b | a]."""
    fmt = cfg.format_of(f"{prefix}.in_proj", 0)
    if fmt is None:
        return LinearBase(cfg.hidden_size, rows.total), None
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    total = 2 * key + value
    splits = [Split(key, start=0, total=total, group=0),
              Split(key, start=key, total=total, group=0),
              Split(value, start=2 * key, total=total, group=0), Split(value, group=1)]
    quant = linear_method(fmt, splits, Split.whole(cfg.hidden_size))
    return (LinearBase(cfg.hidden_size, rows.size("q", "z"), quant=quant),
            LinearBase(cfg.hidden_size, rows.size("b", "a")))
