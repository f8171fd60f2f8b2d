"""Launcher of the routed-expert kernels for 16-bit, float32 or block-FP8 experts (`moe_jit`):
the whole routed computation of one rank without a host sync, so decode steps can be graphed.
One token (the batch-1 decode step) takes the kernels without tensor cores instead
(`moe_rows`), unless the caller names grouped tiles.

`fused_moe` is checked against `reference_moe`, the per-expert torch loop the engine runs on
CPU (`freetoken.layers.moe.FusedExperts`; for block FP8 on the dequantized weights,
`freetoken.layers.quantization.fp8.moe.BlockFP8FusedExperts`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.kernels import gemv, moe_rows
from freetoken.kernels.moe_align import align_pairs
from freetoken.kernels.moe_rows import RowMoeTiles, SharedExpertRows
from freetoken.kernels.quant_gemm import scale_mode


@dataclass(frozen=True)
class MoeTiles:
    """Pairs per block (BLOCK_M), output columns per program and inputs per step of each
    kernel; `small` for few pairs (decode: more programs over the weights), else `large`."""

    block_m: int
    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


DECODE_TILES = MoeTiles(block_m=16, gate_up_n=32, down_n=64, block_k=128)
PREFILL_TILES = MoeTiles(block_m=64, gate_up_n=64, down_n=64, block_k=64)
@dataclass(frozen=True)
class ExpertBlockScales:
    """The block scales of one stacked block-FP8 expert weight [E, N, K]: weight element
    (n, k) of expert e is its e4m3 code times `scale[e, rows[n], (k + col_offset) //
    block_cols]` (`scale` float32 [E, R, C], `rows` int32 [N]: each TP-local row's scale
    row; `col_offset`: the rank's offset inside its first column block)."""

    scale: torch.Tensor
    rows: torch.Tensor
    block_cols: int
    col_offset: int = 0


ROWS_AT_ONE_TOKEN = True
"""One token without `tiles` takes the row kernels (`moe_rows`); False keeps it on the grouped
kernels (an A/B of `bench/tile_ab.py`)."""

SHARED_IN_ROWS = True
"""True: a MoE block whose 16-bit (or block-FP8) routed experts take the row kernels
computes its shared expert of the same kind and its gate in them as well
(`fused_moe(shared=...)`): three launches a MoE layer fewer at batch 1, measured 990.9 ->
933.4 us a qwen3.5-moe-realdims 8-layer step on an H100 (docs/performance.md). False keeps
the shared expert's own launches and the separate combine (an A/B of `bench/tile_ab.py`,
switch `no-shared-rows`). NVFP4 routed experts on the tensor-core decode likewise take an
NVFP4 shared expert as one more slot (`nvfp4_mma_launch.SharedSlot`), at up to 16 tokens."""

DECODE_MAX_PAIRS = 1024
"""Up to this many (token, slot) pairs take DECODE_TILES."""


def _jit():
    """The kernel module, imported on first use (see `freetoken.kernels.use_interpreter`)."""
    return importlib.import_module("freetoken.kernels.moe_jit")


def _precision(dtype: torch.dtype) -> str:
    # float32 must stay float32 on tensor cores (tf32 would lose 13 bits of mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, tiles: MoeTiles | RowMoeTiles | None = None,
              sum_slots: bool = True, w13_scales: ExpertBlockScales | None = None,
              w2_scales: ExpertBlockScales | None = None,
              shared: SharedExpertRows | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert partial sum for `x` [T, H]: w13 [E, 2I, H] (gate rows, then up rows),
    w2 [E, H, I], `weights` and `ids` [T, top_k]. Each token's weighted slots are summed in
    float32 and rounded once to x's dtype; with `sum_slots=False` the weighted slots
    themselves, float32 [T, top_k, H], for a caller that sums them in its own launch.
    Rank-dependent through the TP-local I. Block-FP8 experts: w13 and w2 float8_e4m3fn
    with their `w13_scales` and `w2_scales`. One token without `tiles`, or any call with
    `RowMoeTiles` (one token only), takes the row kernels; `MoeTiles` the grouped ones.
    `shared` (one token on the row kernels, summed slots, the experts' kind): the MoE block's
    shared expert and gate computed in the same launches, and the result is the block's
    `reference_moe_shared`, as `gemv.moe_combine` gives it. `residual` [1, H] (the same
    row kernels): `residual + ` the result, added in the down launch (the decoder layer's
    residual add where no all-reduce comes between, TP 1)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    for name, given in (("shared expert", shared), ("residual", residual)):
        if given is not None and (tokens != 1 or not sum_slots or isinstance(tiles, MoeTiles)):
            raise ValueError(f"fused_moe: the {name} joins one token's summed row kernels, "
                             f"not {tokens} tokens (sum_slots={sum_slots}, {tiles})")
    if tokens == 0:
        return x.new_zeros(0, hidden) if sum_slots else x.new_zeros(0, top_k, hidden,
                                                                      dtype=torch.float32)
    if isinstance(tiles, RowMoeTiles) or (tiles is None and tokens == 1 and ROWS_AT_ONE_TOKEN) \
            or shared is not None or residual is not None:
        return _rows(x, weights, ids, w13, w2, tiles, sum_slots, w13_scales, w2_scales,
                     shared, residual)
    h, layout = _gate_up(x, ids, w13, w13_scales, tiles)
    inter = w2.shape[2]
    down_k = min(layout.tiles.block_k, _pow2(inter))
    out = _down(h, weights, w2, w2_scales, layout, 1, down_k, block_step_ok=True)[0]
    out = out.view(tokens, top_k, hidden)
    return out.sum(dim=1).to(x.dtype) if sum_slots else out


def _rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
          w2: torch.Tensor, tiles: RowMoeTiles | None, sum_slots: bool,
          w13_scales: ExpertBlockScales | None, w2_scales: ExpertBlockScales | None,
          shared: SharedExpertRows | None = None, residual: torch.Tensor | None = None
          ) -> torch.Tensor:
    """`fused_moe` of one token on the row kernels (`moe_rows`)."""
    tokens, hidden = x.shape
    if tokens != 1:
        raise ValueError(f"fused_moe: row tiles serve one token, got {tokens}")
    if tuple(ids.shape) != tuple(weights.shape):
        raise ValueError(f"fused_moe: ids {tuple(ids.shape)} and weights "
                         f"{tuple(weights.shape)} differ in shape")
    _check_scales(w13, w13_scales, "w13")
    _check_scales(w2, w2_scales, "w2")
    inter = w2.shape[2]
    tiles = tiles or moe_rows.choose_tiles(hidden, inter, ids.shape[1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up_scale, gate_up_k = _scale_args(w13_scales, min(tiles.block_k, _pow2(hidden)), w13)
    h = moe_rows.gate_up(x, ids, w13, tiles, gate_up_k, gate_up_scale, shared)
    down_scale, down_k = _scale_args(w2_scales, min(tiles.block_k, _pow2(inter)), w2)
    return moe_rows.down(h, weights, ids, w2, tiles, down_k, down_scale, sum_slots, x.dtype,
                         shared, residual)


def fused_moe_leaves(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, chunks: int,
                     w13_scales: ExpertBlockScales | None = None,
                     w2_scales: ExpertBlockScales | None = None) -> torch.Tensor:
    """The `tp_invariant` mode's routed experts: this rank's float32 leaves [chunks, T, H],
    leaf c each token's weighted slots of the down projection over the c-th of `chunks`
    equal chunks of the TP-local I, the slots added in slot order (routing is replicated,
    so the order is the same at every TP size). The chunks are canonical (the same length
    at every TP size) and every tile, K step and scale mode is chosen from that length,
    never from the TP-local I, so each leaf is the same bits as TP=1's leaf of that chunk.
    Same tensors as `fused_moe`."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w2.shape[2]
    if inter % chunks:
        raise ValueError(f"fused_moe_leaves: the local intermediate size {inter} does not "
                         f"split into {chunks} canonical chunks")
    if tokens == 0:
        return x.new_zeros(chunks, 0, hidden, dtype=torch.float32)
    h, layout = _gate_up(x, ids, w13, w13_scales, None)
    down_k = min(layout.tiles.block_k, _pow2(inter // chunks))
    slots = _down(h, weights, w2, w2_scales, layout, chunks, down_k,
                  block_step_ok=False).view(chunks, tokens, top_k, hidden)
    leaves = slots[:, :, 0]
    for slot in range(1, top_k):
        leaves = leaves + slots[:, :, slot]
    return leaves


@dataclass(frozen=True)
class _Layout:
    """The (token, slot) pairs sorted into blocks by expert, and the tiles they take."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    tiles: MoeTiles
    launch: dict


def _gate_up(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
             w13_scales: ExpertBlockScales | None, tiles: MoeTiles | None
             ) -> tuple[torch.Tensor, _Layout]:
    """h = SiLU(gate) * up [pairs, I] in x's dtype, and the pairs' layout."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    pairs = tokens * top_k
    inter = w13.shape[1] // 2
    tiles = tiles or (DECODE_TILES if pairs <= DECODE_MAX_PAIRS else PREFILL_TILES)
    if tokens == 1:
        rows, block_expert = one_token_layout(ids, tiles.block_m)
    else:
        rows, block_expert = align_pairs(ids.reshape(-1), w13.shape[0], tiles.block_m)
    layout = _Layout(rows, block_expert, tiles,
                     dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    x = x.contiguous()
    _check_scales(w13, w13_scales, "w13")
    gate_up_scale, gate_up_k = _scale_args(w13_scales, tiles.block_k, w13)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _jit().gate_up_kernel[(block_expert.shape[0], triton_cdiv(inter, tiles.gate_up_n))](
        x_ptr=x, w13_ptr=w13, h_ptr=h, rows_ptr=rows, block_expert_ptr=block_expert,
        num_pairs=pairs, hidden=hidden, inter=inter, top_k=top_k,
        stride_x_token=x.stride(0), stride_w13_expert=w13.stride(0),
        stride_w13_row=w13.stride(1), stride_h_pair=h.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.gate_up_n, BLOCK_K=gate_up_k,
        PRECISION=_precision(x.dtype), **gate_up_scale, **layout.launch)
    return h, layout


def _down(h: torch.Tensor, weights: torch.Tensor, w2: torch.Tensor,
          w2_scales: ExpertBlockScales | None, layout: _Layout, chunks: int, block_k: int,
          block_step_ok: bool) -> torch.Tensor:
    """float32 [chunks, pairs, H]: each pair's routing weight times h . w2 over each of
    `chunks` equal chunks of I, K steps of `block_k`. Without `block_step_ok` block scales
    multiply each weight element (SCALE 2): the per-step mode's step depends on the shard's
    offset inside its block, so it would differ between ranks."""
    pairs, inter = h.shape
    hidden = w2.shape[1]
    _check_scales(w2, w2_scales, "w2")
    down_scale, down_k = _scale_args(w2_scales, block_k, w2)
    if not block_step_ok and down_scale["SCALE"] == 1:
        down_scale, down_k = dict(down_scale, SCALE=2), block_k
    out = torch.empty(chunks, pairs, hidden, dtype=torch.float32, device=h.device)
    tiles = layout.tiles
    _jit().down_kernel[(layout.block_expert.shape[0], triton_cdiv(hidden, tiles.down_n),
                        chunks)](
        h_ptr=h, w2_ptr=w2, weights_ptr=weights.reshape(-1).contiguous(), out_ptr=out,
        rows_ptr=layout.rows, block_expert_ptr=layout.block_expert, num_pairs=pairs,
        hidden=hidden, k_chunk=inter // chunks, stride_h_pair=h.stride(0),
        stride_w2_expert=w2.stride(0), stride_w2_row=w2.stride(1),
        stride_out_chunk=out.stride(0), stride_out_pair=out.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_n, BLOCK_K=down_k,
        PRECISION=_precision(h.dtype), **down_scale, **layout.launch)
    return out


def _check_scales(weight: torch.Tensor, scales: ExpertBlockScales | None, name: str) -> None:
    """ValueError naming `name` unless 16-bit / float32 weights come without scales and
    float8_e4m3fn weights with float32 scales of one index per row."""
    if scales is None:
        if weight.dtype == torch.float8_e4m3fn:
            raise ValueError(f"fused_moe: {name} is float8_e4m3fn but has no block scales")
        return
    if weight.dtype != torch.float8_e4m3fn or scales.scale.dtype != torch.float32 or \
            scales.scale.dim() != 3 or scales.scale.shape[0] != weight.shape[0]:
        raise ValueError(f"fused_moe: {name} {weight.dtype} {tuple(weight.shape)} with scale "
                         f"{scales.scale.dtype} {tuple(scales.scale.shape)} is not block FP8 "
                         "(e4m3 [E, N, K], float32 [E, R, C])")
    if scales.rows.dtype != torch.int32 or tuple(scales.rows.shape) != (weight.shape[1],):
        raise ValueError(f"fused_moe: {name}'s scale row index must be int32 "
                         f"[{weight.shape[1]}], got {scales.rows.dtype} "
                         f"{tuple(scales.rows.shape)}")
    if scales.scale.stride(-1) != 1:
        raise ValueError(f"fused_moe: {name}'s block scale needs contiguous rows")


def _scale_args(scales: ExpertBlockScales | None, block_k: int, weight: torch.Tensor
                ) -> tuple[dict, int]:
    """(the kernel's scale arguments, its K step): SCALE 0 without scales, else
    `quant_gemm.scale_mode`'s."""
    if scales is None:
        return dict(scale_ptr=weight, scale_row_ptr=weight, col_offset=0,
                    stride_scale_expert=0, stride_scale_row=0, SCALE=0, BLOCK_COLS=1), block_k
    mode, step = scale_mode(scales.block_cols, scales.col_offset, block_k)
    return dict(scale_ptr=scales.scale, scale_row_ptr=scales.rows,
                col_offset=scales.col_offset, stride_scale_expert=scales.scale.stride(0),
                stride_scale_row=scales.scale.stride(1), BLOCK_COLS=scales.block_cols,
                SCALE=mode), step


ROUTE_WARPS = 1
"""Warps of the routing launch (one program per token; `bench/decode_kernels.py` times
1, 2, 4 and 8 at Qwen3.5's 256 experts). One warp needs no barrier between its block
reductions: 2.63 us a call against 3.61 at 4 warps (H100, docs/performance.md)."""


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 -> top-k -> optional renormalisation in one launch: weights [T, k]
    in `dtype` (descending) and expert ids [T, k] int64, as `freetoken.layers.moe.route`."""
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"fused_moe.route: top_k {top_k} of {num_experts} experts; the routing "
                         f"kernel takes 1 <= top_k <= experts")
    weights = torch.empty(tokens, top_k, dtype=dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _jit().route_kernel[(tokens,)](
            logits_ptr=logits, weights_ptr=weights, ids_ptr=ids, num_experts=num_experts,
            stride_logits_token=logits.stride(0), TOP_K=top_k,
            BLOCK_K=1 << max(0, (top_k - 1).bit_length()), BLOCK_E=_pow2(num_experts),
            RENORMALIZE=renormalize, num_warps=ROUTE_WARPS)
    return weights, ids


_ONE_TOKEN_ROWS: dict = {}


def one_token_layout(ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted layout of one token's pairs without sorting: its top-k experts are
    distinct, so each pair is alone in its expert's block whatever the order of the blocks.
    The rows (pair b first in block b) depend only on top_k and are made once per device,
    so a graphed step replays a single cast for the block experts."""
    top_k = ids.numel()
    key = (top_k, block_m, ids.device)
    if key not in _ONE_TOKEN_ROWS:
        rows = torch.full((top_k, block_m), top_k, dtype=torch.int32, device=ids.device)
        rows[:, 0] = torch.arange(top_k, dtype=torch.int32, device=ids.device)
        _ONE_TOKEN_ROWS[key] = rows.reshape(-1)
    return _ONE_TOKEN_ROWS[key], ids.reshape(-1).to(torch.int32)


def reference_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The torch loop over the experts hit (reads their ids back to the host): same shapes
    and result as `fused_moe`."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, h.float())
    return out.to(x.dtype)


def reference_moe_shared(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, shared: SharedExpertRows
                         ) -> torch.Tensor:
    """The torch steps `fused_moe(shared=...)` fuses, rounded as the engine's separate
    launches round them (`SparseMoeBlock`): the routed sum (`reference_moe`), the shared
    expert's SiLU-gated MLP (`gemv.reference_linear`) and their gated sum
    (`gemv.reference_moe_combine`, the rounded routed sum as its one float32 slot). A
    block-FP8 shared expert is dequantized to x's dtype first, as its torch path does."""
    shared = shared.dense(x.dtype)
    shared_out = gemv.reference_linear(gemv.reference_linear(x, shared.w13, gated=True),
                                       shared.w2)
    routed = reference_moe(x, weights, ids, w13, w2).float()[:, None]
    return gemv.reference_moe_combine(routed, x, shared.gate, shared_out)


def triton_cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, (int(n) - 1).bit_length()))
