"""The quantized cases' data: checkpoint tensors as a producer writes them, one rank's
parameters cut from them as the layers document holding them, and the oracle's float64
weight of that rank (`freetoken_verify.checks.kernels.quant_oracle`).

Weights are heavy-tailed (Student-t) and deliberately unequal where a kernel could confuse
them: every checkpoint tensor of a fused destination has its own amax, set rather than
drawn, so their per-tensor and global scales differ by fixed ratios of 1.8x or more (q and
gate share q_proj's); every segment inside a tensor, every FP8 block (0.3x to 3.3x) and
every expert has its own magnitude, and each expert's up projection is 1.8-3x its gate.
They are quantized by the producers' rules (`freetoken.formats`' quantizers: the producer
side, not the engine's dequantizers): FP8 block with bf16 scales, Qwen's dtype;
compressed-tensors NVFP4 storing the reciprocal global. The rank's cut follows
`freetoken_verify.checks.quant_layout`: the rows and inputs of its slice, the block-scale
rows / columns covering it, zeros past its last block up to the most any rank holds."""

from __future__ import annotations

import math

import torch

from freetoken.formats.fp8.block import quantize as quantize_block
from freetoken.formats.fp8.tensor import quantize_per_tensor
from freetoken.formats.nvfp4.quantizer import quantize as quantize_nvfp4
from freetoken.formats.quant.format import FP8_BLOCK, FP8_TENSOR, NVFP4, ModuleFormat
from freetoken_verify.checks.kernels import quant_oracle as oracle
from freetoken_verify.checks.kernels.nvfp4_oracle import GROUP
from freetoken_verify.checks.quant_layout import (
    Experts,
    Layout,
    blocks_on,
    held_blocks,
    rows_on,
    tensor_of,
)

TENSOR_FACTORS = (1.0, 2.6, 0.45, 1.7, 0.8)
SEGMENT_FACTORS = (1.0, 1.9, 0.6, 1.3)
BLOCK_SPREAD = 1.2
"""FP8 block magnitudes are exp(U(-1.2, 1.2)) apart."""


def heavy_tailed(shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Student-t (4 degrees of freedom) by a ratio of normals, times `scale`."""
    z = torch.randn(shape, generator=gen, device=gen.device)
    chi2 = torch.randn((4, *shape), generator=gen, device=gen.device).pow(2).sum(0)
    return z / torch.sqrt(chi2 / 4) * scale


def _segments(layout: Layout, part: int) -> tuple[list[int], list[int], int]:
    """(indices of the segments checkpoint tensor `part` fills, where each begins in it, its
    rows): segments of a packed tensor (`total` set) where they start, others one after the
    other (Qwen3.5's q, then gate: the kernel sees them regrouped either way)."""
    idx = [i for i in range(len(layout.rows)) if tensor_of(layout.rows, i) == part]
    first = layout.rows[idx[0]]
    if first.total is not None:
        return idx, [0] * len(idx), first.total
    starts, at = [], 0
    for i in idx:
        starts.append(at)
        at += layout.rows[i].full_size
    return idx, starts, at


def _row_block(fmt: ModuleFormat, layout: Layout, part: int) -> int:
    return layout.row_block(layout.rows[_segments(layout, part)[0][0]], fmt.block[0])


def _weight(fmt: ModuleFormat, layout: Layout, part: int, factor: float,
            gen: torch.Generator) -> torch.Tensor:
    """Checkpoint tensor `part` in float32, each segment at its own magnitude."""
    idx, starts, rows = _segments(layout, part)
    cols = layout.cols.full_size
    w = heavy_tailed((rows, cols), 1.0, gen)
    for j, (i, start) in enumerate(zip(idx, starts)):
        first = start + layout.rows[i].start
        w[first:first + layout.rows[i].full_size] *= SEGMENT_FACTORS[j % len(SEGMENT_FACTORS)]
    # amax set, not drawn: per-tensor scales and globals then differ by the factors' ratios.
    w *= factor / math.sqrt(cols) / w.abs().max() * 8.0
    if fmt.kind == FP8_BLOCK:
        b0, b1 = _row_block(fmt, layout, part), fmt.block[1]
        grid = (-(-rows // b0), -(-cols // b1))
        spread = torch.rand(grid, generator=gen, device=gen.device) * 2 - 1
        factors = torch.exp(spread * BLOCK_SPREAD)
        w *= factors.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    return w


def _quantize(fmt: ModuleFormat, w: torch.Tensor, row_block: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensor in `fmt`, under the normalised field names."""
    if fmt.kind == NVFP4:
        q = quantize_nvfp4(w)
        g = q.global_scale.reshape(())
        if fmt.global_scale_is_reciprocal:
            g = (1.0 / g.to(torch.float64)).to(torch.float32)
        return {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": g}
    if fmt.kind == FP8_TENSOR:
        codes, scale = quantize_per_tensor(w)
        return {"weight": codes, "weight_scale": scale.to(w.device)}
    codes, scale = quantize_block(w, (row_block, fmt.block[1]), torch.bfloat16)
    return {"weight": codes, "weight_scale": scale}


def _values(fmt: ModuleFormat, t: dict, row_block: int) -> torch.Tensor:
    if fmt.kind == NVFP4:
        return oracle.nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"],
                            fmt.global_scale_is_reciprocal)
    if fmt.kind == FP8_TENSOR:
        return oracle.fp8_tensor(t["weight"], t["weight_scale"])
    return oracle.fp8_block(t["weight"], t["weight_scale"], (row_block, fmt.block[1]))


def linear_data(fmt: ModuleFormat, layout: Layout, rank: int, tp: int, gen: torch.Generator,
                scale: float = 1.0, factors=TENSOR_FACTORS
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(rank `rank`'s parameters of a `layout` layer in `fmt`, by name; the oracle's float64
    weight of that rank [local out, local in]) from freshly quantized checkpoint tensors."""
    parts = sorted({tensor_of(layout.rows, i) for i in range(len(layout.rows))})
    c0, m = rows_on(layout.cols, rank, tp)
    tensors, values, row_slices = {}, [], []
    for p in parts:
        w = _weight(fmt, layout, p, scale * factors[p % len(factors)], gen)
        tensors[p] = _quantize(fmt, w, _row_block(fmt, layout, p) if fmt.block else 1)
    for i, seg in enumerate(layout.rows):
        p = tensor_of(layout.rows, i)
        idx, starts, _ = _segments(layout, p)
        first, n = rows_on(seg, rank, tp)
        row_slices.append((p, first + starts[idx.index(i)], n))
    for p, first, n in row_slices:
        row_block = _row_block(fmt, layout, p) if fmt.block else 1
        values.append(_values(fmt, tensors[p], row_block)[first:first + n, c0:c0 + m])
    params = _cut(fmt, layout, tensors, row_slices, rank, tp)
    return params, torch.cat(values)


def _cut(fmt, layout, tensors, row_slices, rank, tp) -> dict[str, torch.Tensor]:
    """The rank's parameters: its rows of every segment, stacked; its inputs."""
    c0, m = rows_on(layout.cols, rank, tp)
    rows = [tensors[p]["weight"][first:first + n] for p, first, n in row_slices]
    parts = sorted(tensors)
    if fmt.kind == NVFP4:
        if c0 % GROUP or m % GROUP:
            raise ValueError(f"inputs [{c0}, {c0 + m}) do not fall on {GROUP}-element groups")
        scales = [tensors[p]["weight_scale"][first:first + n] for p, first, n in row_slices]
        return {"weight": torch.cat(rows)[:, c0 // 2:(c0 + m) // 2],
                "weight_scale": torch.cat(scales)[:, c0 // GROUP:(c0 + m) // GROUP],
                "weight_scale_2": torch.stack([tensors[p]["weight_scale_2"].reshape(())
                                               for p in parts])}
    weight = torch.cat(rows)[:, c0:c0 + m]
    if fmt.kind == FP8_TENSOR:
        held = {"weight": weight, "weight_scale": torch.stack(
            [tensors[p]["weight_scale"].reshape(()) for p in parts])}
    else:
        held = {"weight": weight, "weight_scale": _block_scales(fmt, layout, tensors,
                                                                row_slices, rank, tp)}
    if fmt.input_scales:  # stored static input scales: held whole, one per tensor, unused
        held["input_scale"] = torch.tensor([0.01 * (p + 1) for p in parts],
                                           device=weight.device)
    return held


def _block_scales(fmt, layout, tensors, row_slices, rank, tp) -> torch.Tensor:
    """Each segment's scale rows covering its slice (zero past them, up to the most any
    rank holds), then only the columns covering the rank's inputs, likewise."""
    b1 = fmt.block[1]
    first_col, col_count = blocks_on(layout.cols, rank, tp, b1)
    held_cols = held_blocks(layout.cols, tp, b1)
    out = []
    for seg, (p, first, n) in zip(layout.rows, row_slices):
        b0 = layout.row_block(seg, fmt.block[0])
        scale = tensors[p]["weight_scale"]
        top, count = first // b0, (first + n - 1) // b0 - first // b0 + 1
        part = scale.new_zeros(held_blocks(seg, tp, b0), held_cols)
        part[:count, :col_count] = scale[top:top + count, first_col:first_col + col_count]
        out.append(part)
    return torch.cat(out)


def experts_data(fmt: ModuleFormat, experts: Experts, rank: int, tp: int,
                 gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(rank `rank`'s routed-expert parameters in `fmt`, by name; the oracle's float64
    gate | up and down weights of that rank per expert)."""
    fields = {k: [] for k in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2",
                              "w13_input_scale", "w2_weight", "w2_weight_scale",
                              "w2_weight_scale_2", "w2_input_scale")}
    w13, w2 = {}, {}
    for e in range(experts.experts):
        spread = float(torch.empty((), device=gen.device).log_normal_(0.0, 0.5, generator=gen))
        ratio = 1.8 + 1.2 * float(torch.rand((), generator=gen, device=gen.device))
        gate_up, w13[e] = linear_data(fmt, experts.gate_up(), rank, tp, gen, spread,
                                      (1.0, ratio))
        down, w2[e] = linear_data(fmt, experts.down(), rank, tp, gen, spread)
        for prefix, part in (("w13_", gate_up), ("w2_", down)):
            for name, value in part.items():
                if prefix + name in fields:
                    fields[prefix + name].append(value)
    params = {k: torch.stack(v) for k, v in fields.items() if v}
    for single in ("w2_weight_scale_2", "w2_input_scale"):  # one per expert: [E]
        if single in params:
            params[single] = params[single].reshape(-1)
    return params, w13, w2
