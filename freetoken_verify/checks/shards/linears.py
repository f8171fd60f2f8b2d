"""Layout statements of the tensors of linear modules in every storage format, from the
module's geometry (its weight's split dim, that dim's segments, [out, in]) and the format's
definition (the tensors and dtypes each producer writes, `freetoken.formats.quant.format`),
never from the engine's shard specs.

The engine fuses checkpoint modules into destinations (`Gemm`: q | k | v into `qkv_proj`,
gate | up into `gate_up_proj` or an expert's `w13`, GatedDeltaNet `[qkv | z]` into `in_proj`)
and keeps, per segment (`Part`) of a destination, its own rows in every tensor:

- `weight` (any format): the part's rows (column-parallel) or input columns (row-parallel);
- NVFP4 packed `weight` / `weight_packed` and `weight_scale`: rows as the weight's; a split
  input dim by whole 16-input groups (8 packed bytes, 1 scale column);
- NVFP4 `weight_scale_2` / `weight_global_scale`: whole, entry k of `weight_scale_2` (part k);
- FP8 per tensor 0-d `weight_scale`, and the `input_scale` (HF `fp8`: `activation_scale`)
  of FP8 per tensor or block whose config stores static input scales (ModelOpt's FP8 always,
  HF `activation_scheme: static`, compressed-tensors static input activations): whole,
  entry k of the destination's `weight_scale` / `input_scale` (an expert's: `[e, k]`);
- FP8 block `weight_scale_inv` (CT `weight_scale`): the blocks covering the part's rows
  (columns) on the rank, padded to the most any rank holds, into the part's scale rows;
  q_proj's interleaved heads one scale row per weight row (expanded at load).

Input scales of NVFP4, and of FP8 whose config declares dynamic inputs, are unused by the
weight-only engine and not loaded, stated as dropped scalars (`()` / `[1]`); the stored static
FP8 ones are loaded but unused too. Both are checked finite and above 0 by the plan's rule.
A tensor whose dtype does not fit its module's declared format, or a suffix the format does
not write, is a LayoutError naming the tensor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from freetoken.formats.quant.format import (
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    QUANTIZED_DTYPES,
    UNQUANTIZED,
    ModuleFormat,
)
from freetoken_verify.checks.shards.layouts import LayoutError, Segment, Statement, ignored

NVFP4_GROUP = 16
"""Inputs per NVFP4 block scale; a packed byte holds 2 inputs."""
_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPES = {
    (NVFP4, "weight"): (torch.uint8,),
    (NVFP4, "weight_scale"): (torch.float8_e4m3fn,),
    (NVFP4, "weight_scale_2"): (torch.float32,),
    (NVFP4, "input_scale"): (torch.float32,),
    (FP8_TENSOR, "weight"): (torch.float8_e4m3fn,),
    (FP8_TENSOR, "weight_scale"): _SCALES,
    (FP8_TENSOR, "input_scale"): _SCALES,
    (FP8_BLOCK, "weight"): (torch.float8_e4m3fn,),
    (FP8_BLOCK, "weight_scale"): _SCALES,
    (FP8_BLOCK, "input_scale"): _SCALES,
}
"""The dtypes each format stores each normalised field in (bf16: any unquantized float)."""
SCALAR = ((), (1,))
"""Shapes of a per-tensor scale (producers write either)."""


@dataclass(frozen=True)
class Part:
    """One checkpoint linear module `module` inside a destination: its weight [out_features,
    in_features] is split on `dim` (0: output rows, column-parallel; 1: input columns,
    row-parallel) by `segments`; `interleaved`: its rows interleave heads' parts (q_proj's
    `[q_h | gate_h]`), which the engine regroups, so a block scale is held per row."""

    module: str
    segments: tuple[Segment, ...]
    dim: int
    out_features: int
    in_features: int
    interleaved: bool = False


@dataclass(frozen=True)
class Gemm:
    """An engine destination `dest` (its parameters are `dest.weight`, `dest.weight_scale`...;
    an expert's `experts.w13` names them `w13`, `w13_weight`, `w13_weight_scale`...)
    filled by `parts` in row order, all stored in `format`. `expert`: the expert index, the
    leading slot of every parameter."""

    dest: str
    parts: tuple[Part, ...]
    format: ModuleFormat
    expert: int | None = None

    def param(self, field: str) -> str:
        if self.expert is None or field == "bias":
            return f"{self.dest}.{field}"
        return self.dest if not self.format.quantized else f"{self.dest}_{field}"

    def scalar_slot(self, k: int) -> tuple:
        """Part k's entry of a per-tensor scale (an expert's single-part w2: its own)."""
        if self.expert is None:
            return (k,)
        return (self.expert, k) if len(self.parts) > 1 else (self.expert,)

    def lead(self) -> tuple:
        return () if self.expert is None else (self.expert,)


def check_dtype(name: str, fmt: ModuleFormat, field: str, dtype: torch.dtype | None,
                declared: str) -> None:
    """LayoutError naming `name` when `dtype` is not what `fmt` stores `field` in;
    `declared` says who gave the module its format (`<config> makes its module`)."""
    if dtype is None:
        return
    allowed = _DTYPES.get((fmt.kind, field))
    if allowed is None:
        ok = dtype.is_floating_point and dtype not in QUANTIZED_DTYPES
        want = "an unquantized float"
    else:
        ok, want = dtype in allowed, " or ".join(str(d).removeprefix("torch.") for d in allowed)
    if not ok:
        raise LayoutError(f"{name} is {str(dtype).removeprefix('torch.')}, but {declared} "
                          f"{fmt.describe()}, which stores {field} as {want}")


def statement(name: str, suffix: str, gemm: Gemm, k: int, tp: int, dtype: torch.dtype | None,
              declared: str) -> Statement:
    """The statement of checkpoint tensor `name` (`<part k's module>.<suffix>`) of `gemm` at
    `tp` ranks; LayoutError naming it for a suffix or dtype its format does not write."""
    fmt = gemm.format
    field = "bias" if suffix == "bias" else fmt.suffixes().get(suffix)
    if field is None:
        raise LayoutError(f"{name}: {declared} {fmt.describe()}, whose tensors are "
                          f"{', '.join(fmt.suffixes())}; {suffix!r} is none of them")
    check_dtype(name, UNQUANTIZED if field == "bias" else fmt, field, dtype, declared)
    return _build(name, field, gemm, k, tp)


def _build(name: str, field: str, gemm: Gemm, k: int, tp: int) -> Statement:
    """Per-tensor scales whole into their part's entry; everything else split like the
    weight, into the part's rows of the destination (after the parts before it)."""
    fmt, part = gemm.format, gemm.parts[k]
    if field in ("weight_scale_2", "input_scale") or (field == "weight_scale"
                                                       and fmt.kind == FP8_TENSOR):
        if field == "input_scale" and not fmt.input_scales:
            return ignored(name, SCALAR)
        return Statement(name, gemm.param(field), gemm.scalar_slot(k), shapes=SCALAR)
    if field == "bias" and part.dim == 1:
        return Statement(name, gemm.param(field), gemm.lead())
    local = _local(name, field, gemm, k, tp)
    if part.dim == 1 or len(gemm.parts) == 1:
        return local
    start = sum(len(_local(name, field, gemm, j, tp).index(0, tp)) for j in range(k))
    count = len(local.index(0, tp))
    return dataclasses.replace(local, slot=gemm.lead() + (slice(start, start + count),))


def _local(name: str, field: str, gemm: Gemm, k: int, tp: int) -> Statement:
    """Part k's `field` tensor as a statement with the gemm's leading slot only (rows of a
    fused destination get their offset from the parts before)."""
    fmt, part = gemm.format, gemm.parts[k]
    out, inputs = part.out_features, part.in_features
    param, lead, dim = gemm.param(field), gemm.lead(), part.dim
    if field == "bias":
        return Statement(name, param, lead, 0, part.segments, shapes=((out,),))
    if fmt.kind == NVFP4:
        per_group = NVFP4_GROUP // 2 if field == "weight" else 1
        segments = part.segments if dim == 0 else _groups(name, part, per_group)
        return Statement(name, param, lead, dim, segments,
                         shapes=((out, inputs * per_group // NVFP4_GROUP),))
    if field == "weight":
        return Statement(name, param, lead, dim, part.segments, shapes=((out, inputs),))
    rows, cols = fmt.block
    grid = ((-(-out // rows), -(-inputs // cols)),)
    return Statement(name, param, lead, dim, part.segments, block=rows if dim == 0 else cols,
                     per_row=part.interleaved, shapes=grid)


def _groups(name: str, part: Part, per_group: int) -> tuple[Segment, ...]:
    """A split NVFP4 input dim as whole 16-input groups of `per_group` entries (8 packed
    bytes, 1 scale column): a rank's share must be whole groups."""
    if part.in_features % NVFP4_GROUP:
        raise LayoutError(f"{name}: {part.in_features} NVFP4 inputs are not whole "
                          f"{NVFP4_GROUP}-input groups")
    label = " + ".join(s.label for s in part.segments)
    return (Segment(label, 0, part.in_features // NVFP4_GROUP, per_group,
                    f"{NVFP4_GROUP}-input group"),)


def gemm_format(parts: tuple[Part, ...], formats: list[ModuleFormat], what: str
                ) -> ModuleFormat:
    """The one format `parts` share; LayoutError naming two that differ."""
    for part, fmt in zip(parts, formats):
        if fmt != formats[0]:
            raise LayoutError(f"{what}: {parts[0].module} is {formats[0].describe()} but "
                              f"{part.module} is {fmt.describe()}; the engine fuses them into "
                              "one GEMM, which has one format")
    return formats[0]
