"""Launchers of `quant_gemm_jit`: weight-only GEMMs `x W^T (+ b)` over block-FP8, per-tensor
FP8 and NVFP4 weights, for the quantized linear methods' CUDA path
(`freetoken.layers.quantization`). One kernel per format serves every token count: decode
tiles (up to DECODE_MAX_TOKENS tokens: 16 tokens per program, the inputs split over
programs while the weight gives too few of them) and prefill tiles (64 tokens per program,
each dequantized weight tile used for all of them). Nothing synchronises with the host, so
the calls can be captured in CUDA graphs.

The scale layout the kernels take is the linear methods' (per-row index buffers built at
layer construction): see `fp8_gemm` and `nvfp4_gemm`."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from freetoken.kernels import gemv, interpreting, jit_module, next_pow2, nvfp4_linear
from freetoken.kernels.gemv import NORM_BLOCK, Norm, check_normed
from freetoken.kernels.tile_table import parse_tiles, read_tile_table, spell_tiles

DECODE_MAX_TOKENS = 16
MMA_MIN_ROWS = 16384
"""A call of at most MMA_MAX_TOKENS tokens over an NVFP4 weight with one global and at least
this many rows (an LM head) takes the routed-expert kernels' tensor-core decode
(`nvfp4_linear`): at one token on an H200 it ran 1.7x (31040 rows) and 2.4x (248320 rows)
faster than `nvfp4_gemm_kernel`, and slower at 2048 rows and at 16 tokens (it streams the
weight once per token)."""
MMA_MAX_TOKENS = 2
"""The most tokens an LM head's NVFP4 call takes to the tensor-core decode (`MMA_MIN_ROWS`).
On an H100 (2026-12-08, `bench/quant_linear.py`'s layers, us a call against
`nvfp4_gemm_kernel`'s tiles of the table): 248320 rows 113.9 / 235.3 at one token, 167.5 /
248.7 at two, 238.8 / 249.4 at three, 310.8 / 248.9 at four; 31040 rows (the TP 8 shard)
20.0 / 36.8, 26.0 / 38.8, 35.5 / 38.5, 45.0 / 38.5. Decode graphs take batches of 1, 2, 4,
..., so three tokens are rare."""
DECODE_FUSIONS = True
"""True: a one-token FP8 or NVFP4 call on the row kernel takes the decoder layer's input
norm, a shared expert's SiLU-and-mul and the residual add (`fp8_gemm(norm=, gated=,
residual=)`, `nvfp4_gemm`'s, through `WeightOnlyMethod.apply_fused`); False keeps their
separate launches (an A/B of `bench/tile_ab.py`, switch `no-quant-fusions`)."""
DECODE_NORM = True
"""With DECODE_FUSIONS: False keeps the input norm's own launch before a quantized row-kernel
call while the gate and the residual stay fused (tile_ab switch `no-quant-norm`: the FP8
norm fusion measured near break-even per call, docs/performance.md)."""
SM_PROGRAMS = 264
"""About two programs per SM of an H200 (132 SMs): the decode split's target."""
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class QuantTiles:
    """Tokens, output rows and inputs per program step, warps, pipeline stages, and into
    how many parts the inputs are split (more than 1: a second launch adds them). `rows`:
    the kernels without tensor cores (`quant_gemm_rows_jit`, one token per program;
    `block_m` is then 1)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split: int = 1
    rows: bool = False

    def key(self) -> str:
        """The tile table's spelling: `tokens/rows/inputs/warps/stages/split`, with an `r`
        before it for the row kernel."""
        return spell_tiles((self.block_m, self.block_n, self.block_k, self.num_warps,
                            self.num_stages, self.split), self.rows)

    @classmethod
    def parse(cls, entry: str) -> QuantTiles:
        """The tiles a table entry spells (`key`'s inverse); ValueError naming the entry."""
        return parse_tiles(cls, entry, "[r]tokens/rows/inputs/warps/stages/split")


@functools.cache
def enabled() -> bool:
    """Whether the quantized linear methods take these kernels on CUDA: yes unless the
    environment sets FREETOKEN_QUANT_KERNELS=0 (then they dequantize and call F.linear, the
    CPU path), read once per process."""
    return os.environ.get("FREETOKEN_QUANT_KERNELS", "1") != "0"


def serves(x: torch.Tensor) -> bool:
    """Whether a quantized linear method runs `x` through these kernels: a CUDA tensor of a
    floating dtype they take, with the kernels enabled."""
    return x.is_cuda and x.dtype in _DTYPES and enabled()


def table_key(fmt: str, rows: int, in_features: int, tokens: int, norm: bool = False) -> str:
    """The measured table's key of a call: format kind (`fp8`, `nvfp4`, or a format of a kind
    measured apart: `fp8-block`, `fp8-tensor`), weight shape (`+norm` for a row kernel call
    with the input norm fused), token bucket (1, or 2..DECODE_MAX_TOKENS)."""
    return (f"{fmt}/{rows}x{in_features}{'+norm' if norm else ''}/"
            f"{1 if tokens == 1 else DECODE_MAX_TOKENS}")


@functools.cache
def _table() -> dict:
    """The tile table: FREETOKEN_QUANT_TABLE (a JSON file `bench/quant_linear.py --write`
    wrote) when set, else `quant_tiles.H200`."""
    return read_tile_table("FREETOKEN_QUANT_TABLE", _shipped)


def _shipped() -> dict:
    from freetoken.kernels.quant_tiles import H200

    return H200


def format_kind(fmt: str) -> str:
    """The kind ("fp8" or "nvfp4") of a tile table format ("fp8-block" -> "fp8")."""
    return fmt.split("-")[0]


def tiles_for(tokens: int, rows: int, in_features: int, fmt: str, norm: bool = False
              ) -> QuantTiles:
    """The tiles of a call in `fmt` (a kind, "fp8" or "nvfp4", or a format of one:
    "fp8-block", "fp8-tensor"): the measured table's entry for a decode call on a GPU, the
    format's own before its kind's, and with `norm` the entry measured with the norm fused
    before the plain call's; else `choose_tiles`."""
    kind = format_kind(fmt)
    if 0 < tokens <= DECODE_MAX_TOKENS and not interpreting():
        table = _table()
        for fused in ((True, False) if norm else (False,)):
            for name in dict.fromkeys((fmt, kind)):
                entry = table.get(table_key(name, rows, in_features, tokens, fused))
                if entry is not None:
                    return QuantTiles.parse(entry)
    return choose_tiles(tokens, rows, in_features, kind)


def choose_tiles(tokens: int, rows: int, in_features: int, fmt: str) -> QuantTiles:
    """Tiles for `tokens` tokens over a [rows, in_features] weight in `fmt` ("fp8" or
    "nvfp4"). Decode: 16 tokens, 32 rows per program (16 where that leaves less than two
    programs per SM), 256 inputs per step for FP8 and 128 for NVFP4 (the same bytes), the
    inputs split (up to 16 ways, each part at least one step) until about SM_PROGRAMS
    programs. Prefill: 64 tokens x 64 rows. The interpreter takes larger tiles (its
    programs run one after another)."""
    if interpreting():
        return QuantTiles(16 if tokens <= DECODE_MAX_TOKENS else 64, 64,
                          max(16, min(256, next_pow2(in_features))))
    if tokens > DECODE_MAX_TOKENS:
        return QuantTiles(64, 64, 128 if fmt == "nvfp4" else 64, num_warps=4, num_stages=3)
    block_k = max(16, min(256 if fmt == "fp8" else 128, next_pow2(in_features)))
    block_n = 32 if _cdiv(rows, 32) >= SM_PROGRAMS else 16
    programs, split = _cdiv(rows, block_n), 1
    while split < 16 and programs * split * 2 <= SM_PROGRAMS and \
            in_features >= 2 * split * block_k:
        split *= 2
    return QuantTiles(16, block_n, block_k, split=split)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             scale_row: torch.Tensor, block_cols: int, col_offset: int = 0,
             bias: torch.Tensor | None = None, tiles: QuantTiles | None = None, *,
             norm: Norm | None = None, residual: torch.Tensor | None = None,
             normed: torch.Tensor | None = None, gated: bool = False,
             tile_format: str = "fp8") -> torch.Tensor:
    """`x` [T, K] times an e4m3 weight [N, K] whose element (n, k) is scaled by
    `scale[scale_row[n], (k + col_offset) // block_cols]` (scale float32 [R, C], scale_row
    int32 [N]); FP8 per tensor is `scale` [G, 1] with `block_cols` >= K. Plus `bias`,
    float32 accumulation, one rounding to x's dtype. On the row kernel (`fusing_tiles`) also
    `norm`: x's RMSNorm applied as it is loaded (`normed`, x's shape and dtype: stored
    there too); `gated`: the weight stacks [gate | up] and the result is `silu(gate) * up`
    [T, N / 2]; `residual` [T, output features]: `residual + ` the rounded result
    (`gemv.linear`'s fusions and roundings). Without `tiles`, those `tiles_for` gives
    `tile_format` ("fp8", "fp8-block" or "fp8-tensor")."""
    tokens, in_features = _check(x, weight.shape[1], "fp8_gemm", weight)
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: weight must be float8_e4m3fn and scale float32, got "
                         f"{weight.dtype} and {scale.dtype}")
    _check_rows(scale_row, weight.shape[0], "fp8_gemm")
    rows = weight.shape[0]
    tiles = tiles or tiles_for(tokens, rows, in_features, tile_format)
    fused = _check_fusions(x, rows, tiles, "fp8_gemm", norm=norm, residual=residual,
                           normed=normed, gated=gated)
    if tiles.rows:
        return _fp8_rows(x, weight, scale, scale_row, block_cols, col_offset, bias, tiles,
                         fused)
    mode, block_k = _fp8_scale_mode(in_features, block_cols, col_offset, tiles.block_k)
    return _launch(jit_module("quant_gemm_jit").fp8_gemm_kernel, x, rows, in_features, bias,
                   tiles, block_k, dict(
                       weight_ptr=weight, scale_ptr=scale, scale_row_ptr=scale_row,
                       col_offset=col_offset, stride_weight_row=weight.stride(0),
                       stride_scale_row=scale.stride(0), SCALE=mode, BLOCK_COLS=block_cols,
                       EVEN_K=in_features % block_k == 0, BLOCK_K=block_k))


def fusing_tiles(tokens: int, rows: int, in_features: int, fmt: str = "fp8",
                 norm: bool = False) -> QuantTiles | None:
    """The tiles of a call in `fmt` (`tiles_for`'s) of `tokens` tokens over a
    [rows, in_features] weight (`norm`: with the input norm fused) where they name the row
    kernel, which takes the norm, gate and residual fusions (the measured table's one-token
    entries on a GPU); None where they do not."""
    tiles = tiles_for(tokens, rows, in_features, fmt, norm)
    return tiles if tiles.rows else None


def _check_fusions(x, rows, tiles, what, norm, residual, normed, gated) -> dict:
    """The row kernel's fusion arguments (empty: none asked), ValueError naming the tensor
    that does not fit, or the tiles when they are not the row kernel's."""
    if norm is None and residual is None and normed is None and not gated:
        return {}
    if not tiles.rows:
        raise ValueError(f"{what}: the norm, gate and residual fusions run on the row kernel, "
                         f"which tiles {tiles.key()} do not name (`fusing_tiles`)")
    if gated and rows % 2:
        raise ValueError(f"{what}: a gated weight stacks [gate | up], but its {rows} rows "
                         "are odd")
    tokens, in_features = x.shape
    rows = rows // 2 if gated else rows
    check_normed(x, norm, normed, what)
    if residual is not None and (tuple(residual.shape) != (tokens, rows)
                                 or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"{what}: residual {tuple(residual.shape)} {residual.dtype} is not "
                         f"the output's {(tokens, rows)} {x.dtype} (contiguous rows)")
    if norm is not None and tuple(norm.weight.shape) != (in_features,):
        raise ValueError(f"{what}: norm weight {tuple(norm.weight.shape)} does not fit "
                         f"{in_features} inputs")
    return dict(norm=norm, residual=residual, normed=normed, gated=gated)


def _fusion_args(fused: dict, in_features: int, x: torch.Tensor) -> dict:
    """The row kernels' norm arguments of `fused` (`_check_fusions`); placeholders where
    none is asked."""
    norm, normed = fused.get("norm"), fused.get("normed")
    return dict(norm_weight_ptr=norm.weight if norm is not None else x,
                normed_ptr=normed if normed is not None else x,
                eps=norm.eps if norm is not None else 0.0,
                stride_normed_token=normed.stride(0) if normed is not None else 0,
                NORM=0 if norm is None else (2 if norm.offset else 1),
                STORE_NORMED=normed is not None,
                NORM_BLOCK=min(NORM_BLOCK, next_pow2(in_features)))


def _fp8_rows(x, weight, scale, scale_row, block_cols, col_offset, bias, tiles, fused):
    """`fp8_gemm` through the row kernel: the scale per row (per tensor), per group of
    `block_step` inputs inside each step, or per element (`_fp8_scale_mode`: its step is the
    group, the row kernel's step stays `tiles.block_k`); the fusions `fused` asks."""
    in_features = x.shape[1]
    mode, sub = _fp8_scale_mode(in_features, block_cols, col_offset, tiles.block_k)
    return _launch(jit_module("quant_gemm_rows_jit").fp8_gemm_rows_kernel, x,
                   weight.shape[0], in_features, bias, tiles, tiles.block_k, dict(
                       weight_ptr=weight, scale_ptr=scale, scale_row_ptr=scale_row,
                       col_offset=col_offset, stride_weight_row=weight.stride(0),
                       stride_scale_row=scale.stride(0), SCALE=mode, BLOCK_COLS=block_cols,
                       SUB=sub, EVEN_K=in_features % tiles.block_k == 0,
                       BLOCK_K=tiles.block_k, **_fusion_args(fused, in_features, x)),
                   residual=fused.get("residual"), gated=fused.get("gated", False))


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
               global_scale: torch.Tensor, group: torch.Tensor, reciprocal: bool = False,
               bias: torch.Tensor | None = None, tiles: QuantTiles | None = None, *,
               norm: Norm | None = None, residual: torch.Tensor | None = None,
               normed: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """`x` [T, K] times an NVFP4 weight (packed uint8 [N, K / 2], block_scale e4m3
    [N, K / 16]) whose row n takes the global `global_scale[group[n]]` (float32 [G], group
    int32 [N]; `reciprocal`: the stored global divides). Plus `bias`, float32
    accumulation, one rounding to x's dtype. On the row kernel (`rows` tiles,
    `fusing_tiles`) also `fp8_gemm`'s `norm`, `normed`, `gated` and `residual`."""
    tokens, in_features = _check(x, packed.shape[1] * 2, "nvfp4_gemm", packed)
    rows = packed.shape[0]
    if packed.dtype != torch.uint8 or block_scale.dtype != torch.float8_e4m3fn or \
            tuple(block_scale.shape) != (rows, in_features // 16) or in_features % 16:
        raise ValueError(f"nvfp4_gemm: packed {packed.dtype} {tuple(packed.shape)} and block "
                         f"scale {block_scale.dtype} {tuple(block_scale.shape)} are not an "
                         "NVFP4 weight (uint8 [N, K / 2], e4m3 [N, K / 16], K a multiple "
                         "of 16)")
    if global_scale.dtype != torch.float32:
        raise ValueError(f"nvfp4_gemm: global scales must be float32, got "
                         f"{global_scale.dtype}")
    _check_rows(group, rows, "nvfp4_gemm")
    fusing = norm is not None or residual is not None or normed is not None or gated
    if tiles is None and not fusing and _takes_mma(x, rows, global_scale):
        g = 1.0 / global_scale if reciprocal else global_scale
        return nvfp4_linear.nvfp4_linear(x, packed, block_scale, g.reshape(()), bias)
    tiles = tiles or tiles_for(tokens, rows, in_features, "nvfp4")
    fused = _check_fusions(x, rows, tiles, "nvfp4_gemm", norm=norm, residual=residual,
                           normed=normed, gated=gated)
    words = packed.view(torch.int32)
    asm = int(x.is_cuda and not interpreting()
              and os.environ.get("FREETOKEN_NVFP4_PTX", "1") != "0")
    # At least 4 words (32 inputs) a step: with 2 (a 16-input layer, e.g. a tiny model's
    # row-parallel shard at TP 8) the GPU build's decoded tile came out wrong on an H200;
    # the masks cover the inputs past K.
    kw = max(4, tiles.block_k // 8)
    args = dict(weight_ptr=words, scale_ptr=block_scale.view(torch.uint8),
                global_ptr=global_scale, group_ptr=group, zero=0,
                stride_weight_row=words.stride(0), stride_scale_row=block_scale.stride(0),
                RECIPROCAL=reciprocal, ASM=asm, KW=kw)
    if tiles.rows:
        return _launch(jit_module("quant_gemm_rows_jit").nvfp4_gemm_rows_kernel, x, rows,
                       in_features, bias, tiles, 8 * kw, dict(
                           args, EVEN_K=in_features % (8 * kw) == 0,
                           **_fusion_args(fused, in_features, x)),
                       residual=fused.get("residual"), gated=fused.get("gated", False))
    return _launch(jit_module("quant_gemm_jit").nvfp4_gemm_kernel, x, rows, in_features, bias,
                   tiles, 8 * kw, args)


def _takes_mma(x: torch.Tensor, rows: int, global_scale: torch.Tensor) -> bool:
    """Whether an NVFP4 call goes to `nvfp4_linear` (see MMA_MIN_ROWS): at most
    MMA_MAX_TOKENS 16-bit tokens on a GPU (a decode batch with `nvfp4_linear.COLUMNS`, the
    tokens then the mma's columns), one global, an LM head's rows."""
    most = DECODE_MAX_TOKENS if nvfp4_linear.COLUMNS else MMA_MAX_TOKENS
    return (1 <= x.shape[0] <= most and rows >= MMA_MIN_ROWS and global_scale.numel() == 1
            and x.is_cuda and not interpreting() and x.dtype in (torch.bfloat16, torch.float16))


def block_step(block_cols: int, col_offset: int, block_k: int) -> int | None:
    """The largest K step of at least 16 inputs (at most `block_k`) that divides the column
    block and the shard's offset inside it, so one scale column serves each whole step;
    None when there is none (the scale then applies per element)."""
    step = block_k
    while step >= 16:
        if block_cols % step == 0 and col_offset % step == 0:
            return step
        step //= 2
    return None


def scale_mode(block_cols: int, col_offset: int, block_k: int) -> tuple[int, int]:
    """(SCALE, K step) of a block-FP8 dot: 1 with `block_step`'s step (one scale column over
    each step), else 2 (a scale per element) with `block_k`."""
    step = block_step(block_cols, col_offset, block_k)
    return (2, block_k) if step is None else (1, step)


def _fp8_scale_mode(in_features: int, block_cols: int, col_offset: int, block_k: int
                    ) -> tuple[int, int]:
    """(SCALE, BLOCK_K) of an FP8 launch: 0 when one column block covers every input (per
    tensor), else `scale_mode`'s."""
    if col_offset + in_features <= block_cols:
        return 0, block_k
    return scale_mode(block_cols, col_offset, block_k)


def _launch(kernel, x, rows, in_features, bias, tiles, block_k, args,
            residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """Run `kernel` over x [T, in_features] for `rows` weight rows with `tiles` (the K step
    `block_k`); a split launch is finished by `gemv_jit.gemv_reduce_kernel`. The row
    kernels' `residual`: added to the rounded output; `gated`: the rows stack
    [gate | up] and the output is `silu(gate) * up`, rows / 2 wide (a split launch sums
    every row and its reduction gates)."""
    tokens = x.shape[0]
    out_features = rows // 2 if gated else rows
    out = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    step = _cdiv(_cdiv(in_features, tiles.split), block_k) * block_k
    splits = _cdiv(in_features, step)
    partial = (torch.empty(splits, tokens, rows, dtype=torch.float32, device=x.device)
               if splits > 1 else out)
    launched = rows if splits > 1 else out_features
    if not tiles.rows:
        args = dict(args, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                    BLOCK_M=tiles.block_m)
    else:
        args = dict(args, residual_ptr=residual if residual is not None else out,
                    stride_residual_token=residual.stride(0) if residual is not None else 0,
                    HAS_RESIDUAL=residual is not None and splits == 1,
                    GATED=gated and splits == 1, EARLY=int(gemv.ROW_EARLY))
    kernel[(_cdiv(launched, tiles.block_n),
            tokens if tiles.rows else _cdiv(tokens, tiles.block_m), splits)](
        x_ptr=x, bias_ptr=bias if bias is not None else out, partial_ptr=partial, out_ptr=out,
        tokens=tokens, out_features=launched, in_features=in_features, split_features=step,
        stride_x_token=x.stride(0), stride_partial_split=tokens * rows,
        stride_out_token=out.stride(0), HAS_BIAS=bias is not None and splits == 1,
        SPLIT=splits > 1, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **args)
    if splits > 1:
        reduce_m = min(16, next_pow2(tokens))
        jit_module("gemv_jit").gemv_reduce_kernel[(_cdiv(out_features, 256),
                                                   _cdiv(tokens, reduce_m))](
            partial_ptr=partial, bias_ptr=bias if bias is not None else out,
            residual_ptr=residual if residual is not None else out, out_ptr=out,
            tokens=tokens, out_features=rows, splits=splits,
            stride_partial_split=tokens * rows,
            stride_residual_token=residual.stride(0) if residual is not None else 0,
            stride_out_token=out.stride(0), GATED=gated, HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None, BLOCK_M=reduce_m, BLOCK_N=256, num_warps=4)
    return out


def _check(x: torch.Tensor, in_features: int, what: str, weight: torch.Tensor
           ) -> tuple[int, int]:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{what}: x {tuple(x.shape)} does not fit the weight "
                         f"{tuple(weight.shape)} ({in_features} inputs)")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{what}: activations of dtype {x.dtype} (supported: bfloat16, "
                         "float16, float32)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"{what}: x and the weight need contiguous rows")
    return x.shape[0], in_features


def _check_rows(index: torch.Tensor, rows: int, what: str) -> None:
    if index.dtype != torch.int32 or tuple(index.shape) != (rows,):
        raise ValueError(f"{what}: the per-row index must be int32 [{rows}], got "
                         f"{index.dtype} {tuple(index.shape)}")


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
