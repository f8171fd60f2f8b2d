"""What each tensor of a quantized module costs a rank, per format, from the config alone
(the module's format from its quantization config, its TP-local rows and inputs from
`freetoken_verify.checks.quant_layout`), never from the engine's shard specs or what it
allocated: a rank that dequantizes at load, keeps a full-size scale, or expands what it
should not then holds other bytes than these.

- NVFP4: the packed weight, rows x inputs / 2 bytes; the e4m3 block scales, rows x inputs / 16
  bytes; the global scale (and a stored input scale the engine keeps), 4 bytes each, on every
  rank (one per checkpoint tensor, fused destinations included);
- FP8 per tensor: the e4m3 weight, rows x inputs bytes; `weight_scale` and a stored static
  `input_scale`, 4 bytes each (float32), on every rank;
- FP8 block: the e4m3 weight, rows x inputs bytes; the scale in float32 (bf16 in Qwen's
  checkpoints, held as float32), per output segment the block rows covering the rank's rows
  and the block columns covering its inputs, a block two ranks share counted on both, every
  rank holding the most any rank needs; Qwen3.5's q_proj one scale row per weight row; a
  stored static input scale (`activation_scale`, CT `input_scale`) 4 bytes on every rank.

A stored input scale the config declares unused (dynamic inputs, NVFP4) is not loaded, so
costs nothing (the engine's plan ignores it)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.formats.quant.format import FP8_BLOCK, FP8_TENSOR, NVFP4, ModuleFormat
from freetoken_verify.checks.quant_layout import (
    Experts,
    Layout,
    destination_layout,
    held_blocks,
    rows_on,
)

NVFP4_GROUP = 16
FLOAT32 = 4


@dataclass(frozen=True)
class Owner:
    """The quantized GEMM a checkpoint module belongs to: its format, engine destination and
    index among the GEMM's parts (the checkpoint tensor's place in a fused destination)."""

    fmt: ModuleFormat
    dest: str
    part: int


def owners(cfg) -> dict[str, Owner]:
    """Checkpoint module name -> its quantized GEMM, for every quantized module of `cfg`."""
    out = {}
    for dest, gemms in cfg.module_formats.items():
        for gemm in gemms:
            if gemm.format.quantized:
                out.update({p: Owner(gemm.format, dest, j) for j, p in enumerate(gemm.parts)})
    return out


def _module_layout(cfg, owner: Owner, module: str, size: int) -> tuple[Layout, int]:
    """(the layout of the GEMM `module` belongs to, its part index in it); routed experts by
    their projection's name."""
    layout = destination_layout(cfg, owner.dest, size)
    if not isinstance(layout, Experts):
        return layout, owner.part
    projection = module.rsplit(".", 1)[-1]
    if projection == "down_proj":
        return layout.down(), 0
    return layout.gate_up(), 0 if projection == "gate_proj" else 1


def tensor_bytes(cfg, owner: Owner, name: str, rank: int, size: int) -> tuple[int, str] | None:
    """(bytes rank `rank` of `size` holds of quantized checkpoint tensor `name`, how they were
    counted); None for a tensor the format does not name (the caller counts it as stored)."""
    module, _, suffix = name.rpartition(".")
    fmt = owner.fmt
    field = fmt.suffixes().get(suffix)
    if field is None:
        return None
    layout, part = _module_layout(cfg, owner, module, size)
    segments = layout.segments_of(part)
    rows = sum(rows_on(s, rank, size)[1] for s in segments)
    inputs = rows_on(layout.cols, rank, size)[1]
    what = f"{name}: {fmt.describe()} {field}"
    if field in ("weight_scale_2", "input_scale") or (field == "weight_scale"
                                                       and fmt.kind == FP8_TENSOR):
        return FLOAT32, f"{what}, one float32"
    if field == "weight":
        per = {NVFP4: 0.5, FP8_TENSOR: 1, FP8_BLOCK: 1}[fmt.kind]
        return int(rows * inputs * per), f"{what}, {rows} x {inputs} x {per} B"
    if fmt.kind == NVFP4:
        groups = inputs // NVFP4_GROUP
        return rows * groups, f"{what}, {rows} x {groups} groups of {NVFP4_GROUP} x 1 B"
    return _block_scale(fmt, layout, segments, size, what)


def _block_scale(fmt, layout: Layout, segments, size: int, what: str) -> tuple[int, str]:
    b0, b1 = fmt.block
    row_blocks = [held_blocks(s, size, layout.row_block(s, b0)) for s in segments]
    col_blocks = held_blocks(layout.cols, size, b1)
    rows = " + ".join(str(n) for n in row_blocks)
    per_row = " (per row)" if any(s.per_row for s in segments) else ""
    return (sum(row_blocks) * col_blocks * FLOAT32,
            f"{what}, ({rows}){per_row} x {col_blocks} blocks of {b0}x{b1} x {FLOAT32} B")
