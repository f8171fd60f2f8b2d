"""Linear layers that own their TP split. Weights hold the rank-local shard; what goes where is
declared by each model's shard plan (`freetoken.loading.plan`). A layer built with a module
format (`fmt`, from the quantization config) gets a quantization method that creates its
parameters and computes the GEMM (`freetoken.layers.quantization.linear_method`: on CUDA a
weight-only Triton GEMM, elsewhere its dequantized weight and F.linear); the layer tells it
how its rows and inputs are split.

The TP-local sizes of each parallel layer are computed in one place, the layer's own `layout`
(`local_out`, `local_in`) taking the TP size as an argument: the layer sizes its weight from
it, and the shard rules take their slots (and the TP checks their divisibility) from the same
call, so a slot cannot drift from the parameter it fills."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.context import uses_kernels
from freetoken.distributed import divide, get_communicator, get_tp_info
from freetoken.kernels import gemv
from freetoken.layers import invariant
from freetoken.layers.activation import silu_and_mul
from freetoken.layers.layout import GATE_UP, LocalRows
from freetoken.layers.quantization import Split, linear_method

WHOLE = Split.whole


class LinearBase(nn.Module):
    """`y = x W^T (+ b)` with a rank-local weight of shape [local_out, local_in]. `quant`: the
    layer's quantization method (None: an unquantized `weight` in the model dtype). In the
    tp_invariant mode (`canonical` set) the output is computed in canonical tiles; the fused
    decode kernels (`gemv`) take unquantized weights only."""

    def __init__(self, local_in: int, local_out: int, bias: bool = False, quant=None):
        super().__init__()
        self.local_in, self.local_out = local_in, local_out
        self.quant = quant
        if quant is None:
            self.weight = nn.Parameter(torch.empty(local_out, local_in), requires_grad=False)
        else:
            quant.create_weights(self, local_in, local_out)
        self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False) if bias else None
        self.canonical = invariant.active_reductions()

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The rank-local weight as a dense matrix: the parameter itself, or its quantization
        method's dequantization to `dtype` (weight-only)."""
        return self.weight if self.quant is None else self.quant.dequantize(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.canonical is not None:
            return invariant.column_linear(x, self.dense_weight(x.dtype), self.bias,
                                           self.canonical.tile)
        if self.quant is not None:
            return self.quant.apply(self, x, self.bias)
        tiles = _gemv_tiles(self, x)
        if tiles is not None:
            return gemv.linear(x, self.weight, self.bias, tiles=tiles)
        return F.linear(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """`self(norm(x))` for an RMSNorm `norm`; on the CUDA path for a decode batch the
        norm is applied as the projection loads x (one launch; a quantized layer where its
        method's row kernel takes the call, `apply_fused`)."""
        if self.canonical is None:
            fused = dict(norm=_as_norm(norm))
            if self.quant is not None:
                y = self.quant.apply_fused(self, x, self.bias, **fused)
                if y is not None:
                    return y
            tiles = _gemv_tiles(self, x, **fused)
            if tiles is not None:
                return gemv.linear(x, self.weight, self.bias, tiles=tiles, **fused)
        return self(norm(x))

    def forward_keeping_normed(self, x: torch.Tensor, norm: nn.Module
                               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(norm(x), self(norm(x)))` in one launch on the CUDA path for a decode batch, the
        projection storing the normalised x it read, for the steps after it that take the
        same input (the MoE block's experts after its router, GatedDeltaNet's b|a after its
        quantized qkv|z); None where that launch does not run (the tile table lacks the
        fused call or found the unfused steps faster, a quantized call off its method's row
        kernel, a biased layer, no kernels), for the caller's unfused steps."""
        if self.canonical is not None or self.bias is not None:
            return None
        fused = dict(norm=_as_norm(norm))
        if self.quant is not None:
            normed = torch.empty_like(x, memory_format=torch.contiguous_format)
            y = self.quant.apply_fused(self, x, normed=normed, **fused)
            return None if y is None else (normed, y)
        tiles = _gemv_tiles(self, x, **fused)
        if tiles is None:
            return None
        normed = torch.empty_like(x, memory_format=torch.contiguous_format)
        return normed, gemv.linear(x, self.weight, tiles=tiles, normed=normed, **fused)


def _gemv_tiles(layer: LinearBase, x: torch.Tensor, **fused) -> gemv.GemvTiles | None:
    """The decode-step linear kernel's tiles for this call (`freetoken.kernels.gemv`), or
    None where the unfused path runs: a quantized layer, the tp_invariant mode (its tiles
    follow the shape), no kernels, a batch too large, or the measured tile table found the
    GEMM and the separate small kernels faster."""
    if layer.quant is not None or layer.canonical is not None or \
            not (uses_kernels() and gemv.enabled() and gemv.fits(x, layer.weight)):
        return None
    return gemv.tiles_for(x, layer.weight, **fused)


def _as_norm(norm: nn.Module) -> gemv.Norm:
    return gemv.Norm(norm.weight, norm.eps, norm.offset)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, full_in: int, full_out: int, bias: bool = False, fmt=None):
        quant = linear_method(fmt, [WHOLE(full_out)], WHOLE(full_in))
        super().__init__(full_in, full_out, bias, quant)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays rank-local."""

    def __init__(self, full_in: int, full_out: int, bias: bool = False, what: str = "out_features",
                 fmt=None):
        quant = linear_method(fmt, [Split(full_out)], WHOLE(full_in))
        super().__init__(full_in, self.local_out(full_out, get_tp_info().size, what), bias,
                         quant)

    @staticmethod
    def local_out(full_out: int, tp: int, what: str = "out_features") -> int:
        """Output rows per rank at `tp` ranks (ValueError naming `what` unless they split)."""
        return divide(full_out, tp, what)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs stacked in one weight (e.g. gate | up); each segment is
    split on its own, so rank r holds [seg0_r | seg1_r | ...]."""

    def __init__(self, full_in: int, full_sizes: list[int], bias: bool = False,
                 what: str = "out_features", fmt=None, names: tuple[str, ...] = GATE_UP):
        rows = self.layout(full_sizes, get_tp_info().size, what, names)
        self.local_sizes = list(rows.sizes)
        quant = linear_method(fmt, [Split(s) for s in full_sizes], WHOLE(full_in))
        super().__init__(full_in, rows.total, bias, quant)

    @staticmethod
    def layout(full_sizes: list[int], tp: int, what: str = "out_features",
               names: tuple[str, ...] = GATE_UP) -> LocalRows:
        """The local rows at `tp` ranks: each segment (`names`) split on its own."""
        return LocalRows(tuple(names), tuple(divide(s, tp, what) for s in full_sizes))

    def forward_gated(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """`silu(gate) * up` of `self(norm(x))` for a [gate | up] pair of equal segments;
        on the CUDA path for a decode batch in one launch, the norm (when given) included (a
        quantized layer where its method's row kernel takes the call, `apply_fused`)."""
        if len(self.local_sizes) != 2 or self.local_sizes[0] != self.local_sizes[1]:
            raise ValueError(f"forward_gated needs two equal segments, not {self.local_sizes}")
        fused = dict(gated=True, norm=None if norm is None else _as_norm(norm))
        if self.quant is not None and self.canonical is None:
            y = self.quant.apply_fused(self, x, self.bias, **fused)
            if y is not None:
                return y
        tiles = _gemv_tiles(self, x, **fused)
        if tiles is not None:
            return gemv.linear(x, self.weight, self.bias, tiles=tiles, **fused)
        return silu_and_mul(self(x if norm is None else norm(x)), self.canonical)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one weight, split by head. With fewer KV heads than ranks the
    KV heads are replicated: rank r holds KV head `r * total_kv_heads // tp_size`."""

    def __init__(self, hidden: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, fmt=None):
        rows = self.layout(head_dim, total_num_heads, total_num_kv_heads, get_tp_info().size)
        self.num_heads, self.num_kv_heads = rows.size("q") // head_dim, rows.size("k") // head_dim
        self.head_dim = head_dim
        self.local_sizes = list(rows.sizes)
        kv = Split(total_num_kv_heads * head_dim, heads=total_num_kv_heads)
        quant = linear_method(fmt, [Split(total_num_heads * head_dim), kv, kv], WHOLE(hidden))
        super().__init__(hidden, rows.total, bias, quant)

    @staticmethod
    def layout(head_dim: int, total_num_heads: int, total_num_kv_heads: int, tp: int
               ) -> LocalRows:
        """`[q | k | v]` rows at `tp` ranks: this rank's query heads, then its KV head(s)."""
        q = divide(total_num_heads, tp, "num_attention_heads") * head_dim
        kv = local_kv_heads(total_num_kv_heads, tp) * head_dim
        return LocalRows(("q", "k", "v"), (q, kv, kv))


def local_kv_heads(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank: split when there are at least as many heads as ranks, else one
    replicated head per rank (tp_size must then be a multiple of the head count)."""
    if total_num_kv_heads >= tp_size:
        return divide(total_num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % total_num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={total_num_kv_heads} cannot be replicated across "
            f"tp_size={tp_size} (tp_size must be a multiple of it)"
        )
    return 1


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by one all-reduce."""

    def __init__(self, full_in: int, full_out: int, bias: bool = False, what: str = "in_features",
                 reduce: bool = True, fmt=None):
        quant = linear_method(fmt, [WHOLE(full_out)], Split(full_in))
        super().__init__(self.local_in(full_in, get_tp_info().size, what), full_out, bias, quant)
        self.reduce = reduce

    @staticmethod
    def local_in(full_in: int, tp: int, what: str = "in_features") -> int:
        """Input columns per rank at `tp` ranks (ValueError naming `what` unless they split)."""
        return divide(full_in, tp, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.canonical is not None:
            return invariant.row_linear(x, self.dense_weight(x.dtype), self.bias, self.canonical,
                                        self.reduce)
        if self.quant is not None:
            return self._finish(self.quant.apply(self, x))
        tiles = _gemv_tiles(self, x)
        y = (gemv.linear(x, self.weight, tiles=tiles) if tiles is not None
             else F.linear(x, self.weight))
        return self._finish(y)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            y = get_communicator().all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def leaves(self, x: torch.Tensor) -> torch.Tensor:
        """tp_invariant mode: this rank's fp32 leaves [local chunks, .., out] (no bias), for a
        block that adds several row-parallel results before one canonical reduction."""
        return invariant.chunk_leaves(x, self.dense_weight(x.dtype), self.canonical.local_chunks)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`; on the CUDA path for a decode batch in one launch where no
        all-reduce comes between the projection and the add (TP 1, no bias)."""
        fusable = (not self.reduce or get_tp_info().size == 1) and self.bias is None
        if fusable and self.canonical is None and self.quant is not None:
            y = self.quant.apply_fused(self, x, residual=residual)
            if y is not None:
                return y
        if fusable and self.canonical is None:
            tiles = _gemv_tiles(self, x, residual=residual)
            if tiles is not None:
                return gemv.linear(x, self.weight, residual=residual, tiles=tiles)
        return residual + self(x)
