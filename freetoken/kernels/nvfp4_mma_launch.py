"""Launchers of the tensor-core NVFP4 decode kernels (`nvfp4_mma_jit`): 16-bit activations on
a GPU, read in place, a warp per 16 rows, warps splitting K when a launch has few warps. On
sm_90+ a MoE call's down uses programmatic dependent launch after its gate_up
(`launches_early`, `freetoken.kernels.pdl`). A MoE call may take an NVFP4 shared expert as
one more slot of every token (`SharedSlot`) and the decoder layer's residual in down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.kernels import jit_module, next_pow2
from freetoken.kernels.nvfp4_launch import (
    Tiles,
    dequant_mode,
    uses_mma,
    weight_strides,
    word_vector,
)
from freetoken.kernels.pdl import available as pdl_available
from freetoken.kernels.pdl import launch as pdl_launch


@dataclass(frozen=True)
class SharedSlot:
    """An NVFP4 shared expert and its sigmoid gate, for the MoE decode to compute as slot
    top_k of every token (h times sigmoid(gate . x) instead of a routing weight): the
    TP-local `w13` uint8 [2I, H/2] (gate rows, then up rows) and `w13_scale` e4m3
    [2I, H/16] with the routed experts' I and row strides, `w13_global` float32 [n] the
    checkpoint tensors' globals (`gate_group`, `up_group` index them); `w2` [H, I/2],
    `w2_scale` [H, I/16], `w2_global` float32 (its element 0); `gate_weight` [H] in x's
    dtype; `reciprocal`: the stored globals divide (compressed-tensors)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    gate_group: int
    up_group: int
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    gate_weight: torch.Tensor
    reciprocal: bool


def launches_early(x: torch.Tensor, tiles: Tiles) -> bool:
    """Whether a MoE call's down uses programmatic dependent launch after its gate_up: on
    tensor-core decode (`uses_mma`) where the GPU and this Triton have it (`pdl.available`).
    down then starts while gate_up finishes, loads its first weights, and waits for h
    (`jit_ops.grid_wait`)."""
    return tiles.pdl and x.is_cuda and uses_mma(x, tiles) and pdl_available(x)


def register_cap(tiles: Tiles) -> dict:
    """gate_up's launch option of `Tiles.mma_maxnreg` (none where unset). down keeps what
    ptxas chooses: with the shared slot it needs 128 registers at TP 1 and spills under 88."""
    return {} if tiles.mma_maxnreg is None else {"maxnreg": tiles.mma_maxnreg}


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


def activations(x: torch.Tensor) -> torch.Tensor:
    """x [T, >= K] as the mma kernels read it in place: 16-byte aligned rows of 16-bit values
    (a lane's word of 8 inputs is one 16-byte load); a copy where x's rows are not."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"NVFP4 mma decode: activations must be bf16 or fp16, got {x.dtype}")
    if x.stride(1) == 1 and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0:
        return x
    out = torch.empty(x.shape[0], -(-x.shape[1] // 8) * 8, dtype=x.dtype, device=x.device)
    out[:, :x.shape[1]].copy_(x)
    return out


def _shared_args(shared: SharedSlot | None, w: torch.Tensor, s: torch.Tensor,
                 which: str) -> dict:
    """The kernels' shared-expert pointers (`which`: "w13" or "w2"; the routed experts' own
    where there is no shared slot, never read)."""
    if shared is None:
        return dict(shared_w_ptr=w, shared_w_scale_ptr=s)
    sw, ss = getattr(shared, which), getattr(shared, f"{which}_scale").view(torch.uint8)
    word_vector(f"shared {which}", sw[None])
    return dict(shared_w_ptr=sw, shared_w_scale_ptr=ss)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every expert's rows of these weights and scales (routed [E, ...] ones, each
    expert at its stride, and shared ones) start 16-byte aligned."""
    return all(t.data_ptr() % 16 == 0 and (t.dim() < 3 or t.stride(0) % 16 == 0)
               for t in tensors)


def gate_up_mma_launch(x, topk_ids, topk_weights, w13, s13, g13, g2, intermediate, top_k,
                       tiles, pdl=False, shared: SharedSlot | None = None,
                       reciprocal: bool = False) -> torch.Tensor:
    """gate_up on tensor cores: h (times the routing weight and down's global scale) as bf16
    [slots, intermediate] for `down_mma_launch`, a token's top_k slots (and the shared
    expert's after them, where given) one after another; `reciprocal`: g13 and g2 are the
    stored globals that divide (inverted in the kernel). An ordinary launch; pdl (the
    call's `launches_early`): it lets down launch early."""
    hidden, slots = x.shape[1], x.shape[0] * (top_k + (shared is not None))
    v, split, _, row_tiles = mma_shape(slots, intermediate, hidden, 1, tiles)
    x16 = activations(x)
    h16 = torch.empty(slots, intermediate, dtype=torch.bfloat16, device=x.device)
    word_vector("w13", w13)
    if shared is None:
        gate = dict(shared_global_ptr=g13, shared_down_global_ptr=g2, shared_gate_ptr=x16,
                    shared_gate_group=0, shared_up_group=0)
    else:
        gate = dict(shared_global_ptr=shared.w13_global, shared_down_global_ptr=shared.w2_global,
                    shared_gate_ptr=shared.gate_weight, shared_gate_group=shared.gate_group,
                    shared_up_group=shared.up_group, SHARED=1,
                    SHARED_RECIPROCAL=int(shared.reciprocal))
    jit_module("nvfp4_mma_jit").gate_up_mma[(slots, -(-intermediate // (16 * row_tiles)))](
        x16_ptr=x16, topk_ids_ptr=topk_ids, topk_weights_ptr=topk_weights, w_ptr=w13,
        w_scale_ptr=s13, gate_up_global_ptr=g13, down_global_ptr=g2, h16_ptr=h16,
        **_shared_args(shared, w13, s13, "w13"), **gate,
        intermediate=intermediate, k_words=hidden // 8, top_k=top_k,
        stride_x16_token=x16.stride(0), **weight_strides(w13, s13, word_bytes=4),
        stride_h16_pair=h16.stride(0), V=v, TILES=row_tiles, S=split, ASM=dequant_mode(x),
        FULL=mma_full(intermediate, hidden, 1, v, split, row_tiles),
        BF16=int(x.dtype == torch.bfloat16), PDL=int(pdl), RECIPROCAL=int(reciprocal),
        num_warps=split * row_tiles, **register_cap(tiles))
    return h16


def down_mma_launch(h16, topk_ids, w2, s2, out, k_inputs, top_k, tiles, pdl=False,
                    out_scale=None, shared: SharedSlot | None = None,
                    residual: torch.Tensor | None = None):
    """down on tensor cores: out[t] = the sum over t's slots of w2[topk_ids[p]] @ h16[p]
    (times out_scale [1] float32 where given; the shared expert's down on its slot, after
    the token's top_k, where given; rounded to out's dtype and `residual` [tokens, n_rows]
    added, where given); h16 [slots, >= k_inputs] 16-bit: gate_up's h (pdl: launched with
    programmatic dependent launch after it), or a dense linear's x (one slot per token)."""
    tokens, n_rows = out.shape[0], w2.shape[1]
    walk = top_k + (shared is not None)
    v, split, chunks, row_tiles = mma_shape(tokens, n_rows, k_inputs, walk, tiles,
                                            tiles.mma_down_min_split)
    word_vector("w2", w2)
    h16 = activations(h16)
    pdl_launch(jit_module("nvfp4_mma_jit").down_mma,
               (tokens, -(-n_rows // (16 * row_tiles))), pdl,
               h16_ptr=h16, out_scale_ptr=h16 if out_scale is None else out_scale,
               topk_ids_ptr=topk_ids, w_ptr=w2, w_scale_ptr=s2,
               **_shared_args(shared, w2, s2, "w2"),
               residual_ptr=out if residual is None else residual, out_ptr=out, n_rows=n_rows,
               k_words=k_inputs // 8, top_k=top_k, stride_h16_pair=h16.stride(0),
               **weight_strides(w2, s2, word_bytes=4), stride_out_token=out.stride(0),
               stride_residual_token=0 if residual is None else residual.stride(0), V=v,
               TILES=row_tiles, S=split, CHUNKS=chunks, ASM=dequant_mode(h16),
               FULL=mma_full(n_rows, k_inputs, walk, v, split, row_tiles),
               BF16=int(h16.dtype == torch.bfloat16), SCALED=int(out_scale is not None),
               SHARED=int(shared is not None), RESIDUAL=int(residual is not None),
               ALIGNED=int(shared is not None and _aligned(w2, s2, shared.w2, shared.w2_scale)),
               num_warps=split * row_tiles)


def dense_mma_launch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor,
                     k_inputs: int, tiles: Tiles, out_scale: torch.Tensor) -> None:
    """A dense NVFP4 linear of several tokens on tensor cores, the tokens as the mma's
    columns (`nvfp4_mma_jit.dense_mma`): out [T, rows] = out_scale * (w[0] @ x.T).T for x
    [T, >= k_inputs] 16-bit, w [1, rows, k_inputs / 2] packed and s its block scales;
    each weight tile is read once per eight tokens, or per sixteen past eight tokens (two
    mmas a step on one decoded tile)."""
    tokens, n_rows = out.shape[0], w.shape[1]
    cols = 16 if tokens > 8 else 8
    column_blocks = -(-tokens // cols)
    v, split, chunks, row_tiles = mma_shape(column_blocks, n_rows, k_inputs, 1, tiles,
                                            tiles.mma_down_min_split)
    word_vector("w", w)
    x16 = activations(x)
    jit_module("nvfp4_mma_jit").dense_mma[(column_blocks, -(-n_rows // (16 * row_tiles)))](
        x16_ptr=x16, out_scale_ptr=out_scale, w_ptr=w, w_scale_ptr=s, out_ptr=out,
        tokens=tokens, n_rows=n_rows, k_words=k_inputs // 8,
        stride_x16_token=x16.stride(0), stride_w_row=w.stride(1) // 4,
        stride_scale_row=s.stride(1), stride_out_token=out.stride(0), V=v, TILES=row_tiles,
        S=split, ASM=dequant_mode(x16), FULL=mma_full(n_rows, k_inputs, 1, v, split, row_tiles),
        BF16=int(x16.dtype == torch.bfloat16), COLS=cols, num_warps=split * row_tiles)
