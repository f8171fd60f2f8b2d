"""Linear layers that own their TP split. Weights hold the rank-local shard; what goes where is
declared by each model's shard plan (`freetoken.loading.plan`). A layer built with a module
format (`fmt`, from the quantization config) gets a quantization method that creates its
parameters and dequantizes them for the GEMM (`freetoken.layers.quantization.linear_method`);
the layer tells it how its rows and inputs are split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.distributed import divide, get_communicator, get_tp_info
from freetoken.layers.quantization import Split, linear_method

WHOLE = Split.whole


class LinearBase(nn.Module):
    """`y = x W^T (+ b)` with a rank-local weight of shape [local_out, local_in]. `quant`: the
    layer's quantization method (None: an unquantized `weight` in the model dtype)."""

    def __init__(self, local_in: int, local_out: int, bias: bool = False, quant=None):
        super().__init__()
        self.local_in, self.local_out = local_in, local_out
        self.quant = quant
        if quant is None:
            self.weight = nn.Parameter(torch.empty(local_out, local_in), requires_grad=False)
        else:
            quant.create_weights(self, local_in, local_out)
        self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False) if bias else None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The rank-local weight as a dense matrix: the parameter itself, or its quantization
        method's dequantization to `dtype` (weight-only)."""
        return self.weight if self.quant is None else self.quant.dequantize(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


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
        super().__init__(full_in, divide(full_out, get_tp_info().size, what), bias, quant)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs stacked in one weight (e.g. gate | up); each segment is
    split on its own, so rank r holds [seg0_r | seg1_r | ...]."""

    def __init__(self, full_in: int, full_sizes: list[int], bias: bool = False,
                 what: str = "out_features", fmt=None):
        size = get_tp_info().size
        self.local_sizes = [divide(s, size, what) for s in full_sizes]
        quant = linear_method(fmt, [Split(s) for s in full_sizes], WHOLE(full_in))
        super().__init__(full_in, sum(self.local_sizes), bias, quant)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one weight, split by head. With fewer KV heads than ranks the
    KV heads are replicated: rank r holds KV head `r * total_kv_heads // tp_size`."""

    def __init__(self, hidden: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, fmt=None):
        size = get_tp_info().size
        self.num_heads = divide(total_num_heads, size, "num_attention_heads")
        self.num_kv_heads = local_kv_heads(total_num_kv_heads, size)
        self.head_dim = head_dim
        self.local_sizes = [self.num_heads * head_dim] + [self.num_kv_heads * head_dim] * 2
        kv = Split(total_num_kv_heads * head_dim, heads=total_num_kv_heads)
        quant = linear_method(fmt, [Split(total_num_heads * head_dim), kv, kv], WHOLE(hidden))
        super().__init__(hidden, sum(self.local_sizes), bias, quant)


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
        super().__init__(divide(full_in, get_tp_info().size, what), full_out, bias, quant)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dense_weight(x.dtype))
        if self.reduce:
            y = get_communicator().all_reduce(y)
        return y + self.bias if self.bias is not None else y
