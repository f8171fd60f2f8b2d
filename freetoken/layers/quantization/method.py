"""The quantization method of one linear layer, from its module format and how the layer
splits its rows and inputs across ranks. None for an unquantized module (the layer keeps a
plain weight in the model dtype); formats the engine does not run in a linear layer are
refused naming the format (the quantization config's resolution refuses them first, naming
the module)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.distributed import get_tp_info
from freetoken.formats.fp8.specs import BlockScaleSplit
from freetoken.formats.quant.format import FP8_BLOCK, FP8_TENSOR, NVFP4, ModuleFormat
from freetoken.layers.quantization.fp8.block_linear import BlockFP8Linear
from freetoken.layers.quantization.fp8.tensor_linear import FP8TensorLinear
from freetoken.layers.quantization.nvfp4.linear import NVFP4Linear


@dataclass(frozen=True)
class Split:
    """How one weight dim (or one output segment) is split across ranks: `full_size`
    elements in tp_size equal chunks, or by `heads` (fewer heads than ranks: each rank holds
    head `rank * heads // tp_size`, as KV heads are replicated); `whole(n)` is not split."""

    full_size: int
    heads: int | None = None
    start: int = 0
    """Where this segment begins in its checkpoint tensor (GDN in_proj_qkv's k and v)."""
    total: int | None = None
    """That checkpoint tensor's size along the dim (None: the segment is the tensor)."""
    per_row: bool = False
    """The scale is held one row per weight row (expanded at load: q_proj's interleave)."""
    group: int | None = None
    """The checkpoint tensor this segment comes from, for per-tensor scales (None: one per
    segment; Qwen3.5's q and gate share q_proj's, GDN's q, k and v in_proj_qkv's)."""

    def local(self, size: int) -> int:
        """This segment's rows (or inputs) on each rank."""
        return self.full_size // (self.heads if self.heads is not None and self.heads < size
                                  else size)

    @classmethod
    def whole(cls, full_size: int) -> Split:
        return cls(full_size, heads=1)


def linear_method(fmt: ModuleFormat | None, rows: list[Split], cols: Split):
    """The method for a layer whose output segments split as `rows` and whose input splits as
    `cols`, in format `fmt` (None or bf16: no method), for this process's rank."""
    tp = get_tp_info()
    return method_for(fmt, rows, cols, tp.rank, tp.size)


def method_for(fmt: ModuleFormat | None, rows: list[Split], cols: Split, tp_rank: int,
               tp_size: int):
    """`linear_method` for rank `tp_rank` of `tp_size` (tests and benchmarks build any
    rank's layer in one process)."""
    if fmt is None or not fmt.quantized:
        return None
    groups = tuple(i if r.group is None else r.group for i, r in enumerate(rows))
    local = tuple(r.local(tp_size) for r in rows)
    if fmt.kind == FP8_TENSOR:
        return FP8TensorLinear(local, groups, fmt.input_scales)
    if fmt.kind == NVFP4:
        return NVFP4Linear(local, groups, fmt.global_scale_is_reciprocal)
    if fmt.kind != FP8_BLOCK:
        raise ValueError(f"{fmt.describe()} linear layers are not supported yet")
    b_rows, b_cols = fmt.block
    return BlockFP8Linear(fmt.block,
                          tuple(BlockScaleSplit(0, 1 if r.per_row else b_rows, r.full_size,
                                                r.heads, r.start, r.total) for r in rows),
                          BlockScaleSplit(1, b_cols, cols.full_size, cols.heads),
                          tp_rank, tp_size, max(groups) + 1 if fmt.input_scales else 0)
