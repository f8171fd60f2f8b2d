"""Launchers of the tensor-core NVFP4 decode kernels (`nvfp4_mma_jit`): 16-bit activations on
a GPU, a warp per 16 rows, warps splitting K when a launch has few warps. On sm_90+ the
second and third kernels of a call use programmatic dependent launch (`launches_early`)."""

from __future__ import annotations

import torch

from freetoken.kernels import jit_module, next_pow2
from freetoken.kernels.nvfp4_launch import (
    Tiles,
    capability,
    dequant_mode,
    uses_mma,
    weight_strides,
    word_vector,
)

_PDL_LAUNCH: dict[str, bool] = {}
"""{"supported": whether this Triton takes the `launch_pdl` launch option}, once a launch with
it was tried in this process."""


def launches_early(x: torch.Tensor, tiles: Tiles) -> bool:
    """Whether the mma decode's second and third kernels use programmatic dependent launch:
    on tensor-core decode (`uses_mma`) with compute capability 9.0+ (`griddepcontrol`), unless
    an earlier launch found that this Triton cannot launch with it (`_launch`). Each such
    kernel starts while the previous one finishes, loads its first weights, and waits for
    the previous kernel's outputs (`grid_wait`)."""
    return (tiles.pdl and x.is_cuda and uses_mma(x, tiles) and capability(x) >= (9, 0)
            and _PDL_LAUNCH.get("supported", True))


def pdl_args(on: bool) -> dict:
    """Kernel arguments for a launch with (or without) programmatic dependent launch."""
    return {"PDL": 1, "launch_pdl": True} if on else {}


def _launch(kernel, grid, pdl: bool, **kwargs) -> None:
    """`kernel[grid](**kwargs)`, with programmatic dependent launch when `pdl`. The first such
    launch of the process finds out whether this Triton has the `launch_pdl` option (one
    without it rejects the unknown option, naming it, before compiling anything); without it
    that launch, and every later one, is an ordinary launch."""
    if pdl and _PDL_LAUNCH.get("supported", True):
        try:
            kernel[grid](**kwargs, **pdl_args(True))
        except (KeyError, TypeError) as err:
            if "launch_pdl" not in str(err) or "supported" in _PDL_LAUNCH:
                raise
            _PDL_LAUNCH["supported"] = False
        else:
            _PDL_LAUNCH["supported"] = True
            return
    kernel[grid](**kwargs)


def mma_shape(units: int, rows: int, k_inputs: int, walk: int, tiles: Tiles,
              min_split: int = 1) -> tuple[int, int, int, int]:
    """(V, S, CHUNKS, TILES) of an mma decode launch: V words per lane and chunk (the largest of
    4, 2, 1 that divides the row into whole chunks of 32 V inputs), CHUNKS chunks per row,
    TILES 16-row tiles per program, and the K split S: warps per program, doubled (up to
    `mma_max_split`) while it is below `min_split` or the launch has fewer than `mma_warps`
    warps, as long as each warp keeps at least one of the `walk * CHUNKS` steps."""
    v = next((v for v in (4, 2) if k_inputs % (32 * v) == 0), 1)
    chunks = -(-k_inputs // (32 * v))
    row_tiles = min(tiles.mma_tiles, next_pow2(-(-rows // 16)))
    split, warps = 1, units * -(-rows // 16)
    while (split < tiles.mma_max_split and (split < min_split or warps * split < tiles.mma_warps)
           and 2 * split <= walk * chunks):
        split *= 2
    return v, split, chunks, row_tiles


def mma_full(rows: int, k_inputs: int, walk: int, v: int, split: int, row_tiles: int) -> bool:
    """Whether an mma launch needs no masks: whole row tiles, whole chunks, and the walk's
    steps (`walk` rows of chunks) shared evenly by the K split."""
    chunks, rem = divmod(k_inputs, 32 * v)
    return rows % (16 * row_tiles) == 0 and rem == 0 and (walk * chunks) % split == 0


def fragments(x: torch.Tensor, k_inputs: int, v: int, pdl: bool = False):
    """`to_fragments` of x's rows: (x16 [T, padded K] fp16, xf [T] float32). pdl: it lets
    the next kernel launch early (it is itself an ordinary launch)."""
    tokens, chunks = x.shape[0], -(-k_inputs // (32 * v))
    x16 = torch.empty(tokens, chunks * 32 * v, dtype=torch.float16, device=x.device)
    xf = torch.empty(tokens, dtype=torch.float32, device=x.device)
    jit_module("nvfp4_mma_jit").to_fragments[(tokens,)](
        x_ptr=x, x16_ptr=x16, xf_ptr=xf, k_inputs=k_inputs, stride_x_token=x.stride(0),
        stride_x16_token=x16.stride(0), V=v, BLOCK=next_pow2(x16.shape[1]), PDL=int(pdl),
        num_warps=4)
    return x16, xf


def gate_up_mma_launch(x, topk_ids, topk_weights, w13, s13, g13, g2, intermediate, top_k,
                       tiles, pdl=False) -> torch.Tensor:
    """gate_up on tensor cores: h (times the routing weight and down's global scale) as bf16
    fragments [pairs, padded I] for `down_mma_launch`. pdl: the call's `launches_early`,
    decided once for its kernels."""
    pairs, tokens, hidden = topk_ids.numel(), x.shape[0], x.shape[1]
    v, split, _, row_tiles = mma_shape(pairs, intermediate, hidden, 1, tiles)
    x16, xf = fragments(x, hidden, v, pdl)
    vh, _, chunks_h, _ = mma_shape(tokens, hidden, intermediate, top_k, tiles)
    h16 = torch.empty(pairs, chunks_h * 32 * vh, dtype=torch.bfloat16, device=x.device)
    word_vector("w13", w13)
    _launch(jit_module("nvfp4_mma_jit").gate_up_mma,
            (pairs, -(-intermediate // (16 * row_tiles))), pdl,
            x16_ptr=x16, xf_ptr=xf, topk_ids_ptr=topk_ids, topk_weights_ptr=topk_weights,
            w_ptr=w13, w_scale_ptr=s13, gate_up_global_ptr=g13, down_global_ptr=g2,
            h16_ptr=h16, intermediate=intermediate, k_words=hidden // 8, top_k=top_k,
            stride_x16_token=x16.stride(0), **weight_strides(w13, s13, word_bytes=4),
            stride_h16_pair=h16.stride(0), V=v, TILES=row_tiles, S=split, VH=vh,
            ASM=dequant_mode(x), FULL=mma_full(intermediate, hidden, 1, v, split, row_tiles),
            num_warps=split * row_tiles)
    return h16


def down_mma_launch(h16, hf, topk_ids, w2, s2, out, k_inputs, top_k, tiles, pdl=False):
    """down on tensor cores: out[t] = the sum over t's slots of w2[topk_ids[p]] @ h16[p]; h16
    bf16 fragments (gate_up's), or fp16 ones times hf [T] (`fragments`)."""
    tokens, n_rows = out.shape[0], w2.shape[1]
    v, split, chunks, row_tiles = mma_shape(tokens, n_rows, k_inputs, top_k, tiles,
                                            tiles.mma_down_min_split)
    word_vector("w2", w2)
    bf16 = h16.dtype == torch.bfloat16
    _launch(jit_module("nvfp4_mma_jit").down_mma,
            (tokens, -(-n_rows // (16 * row_tiles))), pdl,
            h16_ptr=h16, hf_ptr=h16 if bf16 else hf, topk_ids_ptr=topk_ids, w_ptr=w2,
            w_scale_ptr=s2, out_ptr=out, n_rows=n_rows, k_words=k_inputs // 8, top_k=top_k,
            stride_h16_pair=h16.stride(0), **weight_strides(w2, s2, word_bytes=4),
            stride_out_token=out.stride(0), V=v, TILES=row_tiles, S=split, CHUNKS=chunks,
            ASM=dequant_mode(h16), FULL=mma_full(n_rows, k_inputs, top_k, v, split, row_tiles),
            BF16=int(bf16), num_warps=split * row_tiles)
