"""Launcher of `moe_rows_jit`: the routed experts of one token (the batch-1 decode step,
captured in CUDA graphs) without tensor cores, which `fused_moe.fused_moe` takes at one
token. Two launches: gate/up with SiLU-and-mul into h [top_k, I], then the down projection
with the routing weights and the slots' sum folded in; given the block's shared expert
(`SharedExpertRows`), the same two launches compute it and its sigmoid gate as one more
slot and add it to the sum, and the down launch may add the decoder layer's residual. The
scale arguments come from `fused_moe` (its `_scale_args`), which validates them for both
paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.kernels import interpreting, jit_module, next_pow2
from freetoken.kernels.quant_gemm import SM_PROGRAMS, scale_mode


@dataclass(frozen=True)
class RowMoeTiles:
    """Output features per program of the gate/up and of the down kernel, inputs per step
    (at most; a shorter row takes one step of its own length rounded up to a power of two)
    and warps."""

    gate_up_n: int = 4
    down_n: int = 4
    block_k: int = 1024
    num_warps: int = 4


@dataclass(frozen=True)
class SharedExpertRows:
    """A MoE block's shared expert and its sigmoid gate, this rank's weights: `w13`
    [2 * I_s, H] (gate rows, then up rows), `w2` [H, I_s] and `gate` [1, H]. I_s may differ
    from the routed experts' I. 16-bit (or float32) weights in the token's dtype; or, beside
    block-FP8 routed experts, `w13` and `w2` float8_e4m3fn with their block scales: element
    (n, k) of w13 is its code times `w13_scale[w13_scale_row[n], k // block_cols]`, of w2
    `w2_scale[w2_scale_row[n], (k + w2_col_offset) // block_cols]` (the scales float32, the
    row indices int32, `w2_col_offset` the rank's offset inside its first column block, as
    `BlockFP8Linear` holds them). The gate stays in the token's dtype."""

    w13: torch.Tensor
    w2: torch.Tensor
    gate: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w13_scale_row: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w2_scale_row: torch.Tensor | None = None
    block_cols: int = 0
    w2_col_offset: int = 0

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    def dense(self, dtype: torch.dtype) -> SharedExpertRows:
        """These weights in `dtype` (block FP8 dequantized: code times its block's scale, in
        float32, then rounded to `dtype`, as `BlockFP8Linear.dequantize`), the gate as it is:
        the torch reference's operands."""
        if not self.fp8:
            return SharedExpertRows(self.w13.to(dtype), self.w2.to(dtype), self.gate)
        return SharedExpertRows(
            dequantize_rows(self.w13, self.w13_scale, self.w13_scale_row, self.block_cols,
                            dtype=dtype),
            dequantize_rows(self.w2, self.w2_scale, self.w2_scale_row, self.block_cols,
                            self.w2_col_offset, dtype), self.gate)

    def check(self, x: torch.Tensor) -> None:
        """ValueError naming the tensor unless these fit the token x [1, H]."""
        hidden = x.shape[1]
        inter = self.w2.shape[-1]
        weight_dtype = torch.float8_e4m3fn if self.fp8 else x.dtype
        want = {"w13": ((2 * inter, hidden), weight_dtype), "w2": ((hidden, inter), weight_dtype),
                "gate": ((1, hidden), x.dtype)}
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1:
                raise ValueError(f"moe_rows: shared expert {name} {tuple(t.shape)} "
                                 f"{t.dtype} (stride {t.stride()}) does not fit a token "
                                 f"{tuple(x.shape)} {x.dtype}: want {shape} {dtype}, "
                                 "contiguous rows")
        if not self.fp8:
            return
        for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            scale, index = getattr(self, f"{name}_scale"), getattr(self, f"{name}_scale_row")
            offset = self.w2_col_offset if name == "w2" else 0
            blocks = -(-(cols + offset) // self.block_cols) if self.block_cols > 0 else -1
            if scale is None or index is None or scale.dtype != torch.float32 or \
                    scale.dim() != 2 or scale.shape[1] < blocks or \
                    index.dtype != torch.int32 or tuple(index.shape) != (rows,):
                raise ValueError(
                    f"moe_rows: shared expert {name}'s block scales do not fit its weight "
                    f"{rows} x {cols} (offset {offset}, column block {self.block_cols}): "
                    f"scale {_describe(scale)}, scale rows {_describe(index)}; want float32 "
                    f"[R, >= {blocks}] and int32 [{rows}]")


def _describe(t: torch.Tensor | None) -> str:
    return "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"


@dataclass
class RowHidden:
    """The gate/up launch's outputs: h [top_k, I] in x's dtype; with a shared expert also
    its SiLU(gate) * up `shared` [I_s] and its rounded sigmoid gate `gate` float32 [1]."""

    h: torch.Tensor
    shared: torch.Tensor | None = None
    gate: torch.Tensor | None = None


INTERPRETER_TILES = RowMoeTiles(gate_up_n=64, down_n=64, block_k=256)
"""The interpreter pays per program and per operation: few programs of large tiles."""


def choose_tiles(hidden: int, inter: int, top_k: int) -> RowMoeTiles:
    """Up to 4 features per program and steps of up to 1024 inputs (a gate/up program of
    Qwen3.5-35B-A3B: 8 rows of 2048 bf16 weights in two steps, 32 KiB, all in flight at
    once; block FP8 steps within its column blocks, 128 inputs for Qwen's), halving the
    features per program while a launch would have fewer than about two programs per SM of
    an H200 (the gate/up launch at TP 8: 8 slots of 64 features is 128 programs of 4, 512
    of 1)."""
    if interpreting():
        return INTERPRETER_TILES
    gate_up_n, down_n = 4, 4
    while gate_up_n > 1 and top_k * _cdiv(inter, gate_up_n) < SM_PROGRAMS:
        gate_up_n //= 2
    while down_n > 1 and _cdiv(hidden, down_n) < SM_PROGRAMS:
        down_n //= 2
    return RowMoeTiles(gate_up_n=gate_up_n, down_n=down_n)


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.jit_module`)."""
    return jit_module("moe_rows_jit")


def gate_up(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, tiles: RowMoeTiles,
            block_k: int, scale_args: dict, shared: SharedExpertRows | None = None
            ) -> RowHidden:
    """h = SiLU(gate) * up [top_k, I] in x's dtype for the one token x [1, H] and its slots'
    experts `ids` [1, top_k]; `scale_args` the kernel's SCALE arguments, `block_k` the step
    (in SCALE 1 one that a single scale column serves). With `shared` (of the routed
    experts' kind: 16-bit, or block FP8 with their column block), the shared expert's h
    and the gate as well, in the same launch."""
    hidden = x.shape[1]
    top_k = ids.shape[1]
    inter = w13.shape[1] // 2
    out = RowHidden(torch.empty(top_k, inter, dtype=x.dtype, device=x.device))
    shared_inter = 0
    if shared is not None:
        _check_joins(shared, scale_args, x)
        shared_inter = shared.w2.shape[1]
        out.shared = torch.empty(shared_inter, dtype=x.dtype, device=x.device)
        out.gate = torch.empty(1, dtype=torch.float32, device=x.device)
        shared_args = dict(shared_w13_ptr=shared.w13, shared_h_ptr=out.shared,
                           gate_weight_ptr=shared.gate, gate_ptr=out.gate,
                           stride_shared_row=shared.w13.stride(0))
        if shared.fp8:
            shared_args.update(shared_scale_ptr=shared.w13_scale,
                               shared_scale_row_ptr=shared.w13_scale_row,
                               stride_shared_scale_row=shared.w13_scale.stride(0))
    else:
        shared_args = dict(shared_w13_ptr=w13, shared_h_ptr=out.h, gate_weight_ptr=x,
                           gate_ptr=out.h, stride_shared_row=0)
    shared_args.setdefault("shared_scale_ptr", scale_args["scale_ptr"])
    shared_args.setdefault("shared_scale_row_ptr", scale_args["scale_row_ptr"])
    shared_args.setdefault("stride_shared_scale_row", 0)
    blocks = _cdiv(max(inter, shared_inter), tiles.gate_up_n)
    _jit().gate_up_rows_kernel[(top_k + (shared is not None), blocks)](
        x_ptr=x, w13_ptr=w13, h_ptr=out.h, ids_ptr=ids, hidden=hidden, inter=inter,
        top_k=top_k, shared_inter=shared_inter, stride_ids_slot=ids.stride(1),
        stride_w13_expert=w13.stride(0), stride_w13_row=w13.stride(1),
        stride_h_slot=out.h.stride(0), SHARED=shared is not None,
        EVEN_K=hidden % block_k == 0, STEPS=_cdiv(hidden, block_k), BLOCK_N=tiles.gate_up_n,
        BLOCK_K=block_k, num_warps=tiles.num_warps, **shared_args, **scale_args)
    return out


def down(hidden_rows: RowHidden, weights: torch.Tensor, ids: torch.Tensor, w2: torch.Tensor,
         tiles: RowMoeTiles, block_k: int, scale_args: dict, sum_slots: bool,
         dtype: torch.dtype, shared: SharedExpertRows | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """The token's weighted slots h[s] . w2[e_s]^T * weights[s]: summed in slot order in
    float32 and rounded once to `dtype`, [1, H]; or, without `sum_slots`, each slot's float32
    value [1, top_k, H]. With `shared` (and `sum_slots`), the routed sum plus the gated
    shared expert, rounded as `gemv.moe_combine` rounds them; `hidden_rows` then carries
    the shared h and gate of the gate/up launch that was given `shared`. With `residual`
    [1, H] (`dtype`, and `sum_slots`), `residual + ` that sum, each rounded to `dtype`."""
    h = hidden_rows.h
    top_k, inter = h.shape
    hidden = w2.shape[1]
    if residual is not None and (not sum_slots or tuple(residual.shape) != (1, hidden)
                                 or residual.dtype != dtype or residual.stride(-1) != 1):
        raise ValueError(f"moe_rows: residual {tuple(residual.shape)} {residual.dtype} does "
                         f"not fit the summed output {(1, hidden)} {dtype} (contiguous; "
                         f"sum_slots={sum_slots})")
    out = (torch.empty(1, hidden, dtype=dtype, device=h.device) if sum_slots
           else torch.empty(1, top_k, hidden, dtype=torch.float32, device=h.device))
    if shared is not None:
        if not sum_slots or hidden_rows.shared is None:
            raise ValueError("moe_rows: the shared expert is added to the summed slots "
                             "only, after a gate/up launch that computed it")
        if shared.fp8 and shared.block_cols != scale_args["BLOCK_COLS"]:
            raise ValueError(f"moe_rows: the shared expert's column block {shared.block_cols} "
                             f"differs from the routed down's {scale_args['BLOCK_COLS']}")
        shared_inter = shared.w2.shape[1]
        shared_k = min(block_k, next_pow2(shared_inter))
        shared_scale = 0
        if shared.fp8:
            # The shared dot picks its own scale mode: its rank offset may differ from the
            # routed experts'.
            shared_scale, shared_k = scale_mode(shared.block_cols, shared.w2_col_offset,
                                                shared_k)
        shared_args = dict(shared_h_ptr=hidden_rows.shared, shared_w2_ptr=shared.w2,
                           gate_ptr=hidden_rows.gate, shared_inter=shared_inter,
                           stride_shared_row=shared.w2.stride(0),
                           SHARED_SCALE=shared_scale,
                           SHARED_EVEN_K=shared_inter % shared_k == 0,
                           SHARED_STEPS=_cdiv(shared_inter, shared_k), SHARED_BLOCK_K=shared_k)
        if shared.fp8:
            shared_args.update(shared_scale_ptr=shared.w2_scale,
                               shared_scale_row_ptr=shared.w2_scale_row,
                               shared_col_offset=shared.w2_col_offset,
                               stride_shared_scale_row=shared.w2_scale.stride(0))
    else:
        shared_args = dict(shared_h_ptr=h, shared_w2_ptr=w2, gate_ptr=h, shared_inter=0,
                           stride_shared_row=0, SHARED_SCALE=0, SHARED_EVEN_K=True,
                           SHARED_STEPS=1, SHARED_BLOCK_K=1)
    shared_args.setdefault("shared_scale_ptr", scale_args["scale_ptr"])
    shared_args.setdefault("shared_scale_row_ptr", scale_args["scale_row_ptr"])
    shared_args.setdefault("shared_col_offset", 0)
    shared_args.setdefault("stride_shared_scale_row", 0)
    _jit().down_rows_kernel[(_cdiv(hidden, tiles.down_n),)](
        h_ptr=h, w2_ptr=w2, weights_ptr=weights, ids_ptr=ids, out_ptr=out,
        residual_ptr=residual if residual is not None else out, hidden=hidden,
        inter=inter, stride_ids_slot=ids.stride(1), stride_weights_slot=weights.stride(1),
        stride_h_slot=h.stride(0), stride_w2_expert=w2.stride(0), stride_w2_row=w2.stride(1),
        stride_out_slot=0 if sum_slots else out.stride(1), TOP_K=top_k,
        BLOCK_S=next_pow2(top_k), SUM_SLOTS=sum_slots, SHARED=shared is not None,
        RESIDUAL=residual is not None,
        EVEN_K=inter % block_k == 0, STEPS=_cdiv(inter, block_k), BLOCK_N=tiles.down_n,
        BLOCK_K=block_k, num_warps=tiles.num_warps, **shared_args, **scale_args)
    return out


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                    block_cols: int, col_offset: int = 0,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-FP8 codes [..., N, K] as values in `dtype`: each code times
    `scale[..., rows[n], (k + col_offset) // block_cols]` in float32 (the kernels' scale
    layout: a per-row index into the scale rows), then rounded."""
    cols = (torch.arange(codes.shape[-1], device=codes.device) + col_offset) // block_cols
    return (codes.float() * scale[..., rows.long(), :][..., cols]).to(dtype)


def _check_joins(shared: SharedExpertRows, scale_args: dict, x: torch.Tensor) -> None:
    """ValueError unless `shared` fits the token x and can share the gate/up launch's dot
    with the routed experts: both 16-bit, or both block FP8 with one column block (the
    launch's SCALE mode and its K step then serve the shared rows too; both read the whole
    hidden size, from offset 0)."""
    shared.check(x)
    routed_fp8 = scale_args["SCALE"] != 0
    if shared.fp8 != routed_fp8 or (routed_fp8 and (
            shared.block_cols != scale_args["BLOCK_COLS"] or scale_args["col_offset"] != 0)):
        raise ValueError(
            f"moe_rows: a {'block-FP8' if shared.fp8 else '16-bit'} shared expert (column "
            f"block {shared.block_cols}) cannot join {'block-FP8' if routed_fp8 else '16-bit'}"
            f" routed experts (column block {scale_args['BLOCK_COLS']}): both must be 16-bit, "
            "or both block FP8 with the same column block")


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
