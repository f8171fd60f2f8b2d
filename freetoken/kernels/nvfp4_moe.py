"""The NVFP4 routed-expert computation of one rank, `fused_moe`: gate_up with SiLU-and-mul,
then down, weighted by the routing weights and summed over each token's top-k slots (a
partial sum; the MoE block all-reduces it). Few tokens take the decode kernels: on tensor
cores for 16-bit activations on a GPU (`nvfp4_mma_launch`), else the CUDA-core GEMVs
(`nvfp4_launch`, float32 activations and CPUs); more tokens take the prefill kernels, on
pairs sorted by expert into blocks. The tensor-core decode can also take an NVFP4 shared
expert as one more slot of every token and the decoder layer's residual
(`nvfp4_mma_launch.SharedSlot`, `takes_shared`): the MoE block is then two launches.
"""

from __future__ import annotations

import torch

from freetoken.formats.nvfp4.format import GROUP, NVFP4FormatError
from freetoken.kernels import nvfp4_launch, nvfp4_mma_launch
from freetoken.kernels.moe_align import align_pairs
from freetoken.kernels.nvfp4_mma_launch import SharedSlot


def _local_intermediate(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """The TP-local intermediate size the kernels are told: half of w13's rows."""
    return w13.shape[1] // 2


def _check(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global) -> None:
    hidden, experts, inter = x.shape[-1], w13.shape[0], w13.shape[1] // 2
    want = {"w13": (experts, 2 * inter, hidden // 2), "w13_scale": (experts, 2 * inter,
            hidden // GROUP), "w13_global": (experts, 2), "w2": (experts, hidden, inter // 2),
            "w2_scale": (experts, hidden, inter // GROUP), "w2_global": (experts,)}
    got = {"w13": w13, "w13_scale": w13_scale, "w13_global": w13_global, "w2": w2,
           "w2_scale": w2_scale, "w2_global": w2_global}
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise NVFP4FormatError(f"fused_moe: {name} has shape {tuple(got[name].shape)}, "
                                   f"expected {shape} for hidden={hidden}, local "
                                   f"intermediate={inter}, experts={experts}")
    if hidden % GROUP or inter % GROUP:
        raise NVFP4FormatError(f"fused_moe: hidden={hidden} and local intermediate={inter} "
                               f"must be multiples of the {GROUP}-element group")
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise NVFP4FormatError(f"fused_moe: packed weights must be uint8, got w13 "
                               f"{w13.dtype}, w2 {w2.dtype}")
    if topk_ids.shape[0] != x.shape[0]:
        raise NVFP4FormatError(f"fused_moe: topk_ids has {topk_ids.shape[0]} rows for "
                               f"{x.shape[0]} tokens")


def shared_mismatch(x: torch.Tensor, routed: dict, shared: SharedSlot) -> str | None:
    """Why `shared` cannot be a slot beside the routed experts `routed` (their w13,
    w13_scale, w2, w2_scale) for x, or None: it must have one routed expert's shapes and
    strides, float32 globals holding the groups it names, and a gate of x's width and
    dtype."""
    for name, experts in routed.items():
        got, like = getattr(shared, name), experts[0]
        if tuple(got.shape) != tuple(like.shape) or got.stride() != like.stride():
            return (f"shared expert {name} has shape {tuple(got.shape)} strides "
                    f"{got.stride()}, expected {tuple(like.shape)} {like.stride()} (a routed "
                    f"expert's)")
    groups = max(shared.gate_group, shared.up_group) + 1
    for name, g, need in (("w13_global", shared.w13_global, groups),
                          ("w2_global", shared.w2_global, 1)):
        if g.dtype != torch.float32 or g.numel() < need or not g.is_contiguous():
            return (f"shared expert {name} is {g.dtype} {tuple(g.shape)}, expected "
                    f">= {need} contiguous float32 values")
    if shared.gate_weight.numel() != x.shape[1] or shared.gate_weight.dtype != x.dtype:
        return (f"shared expert gate {tuple(shared.gate_weight.shape)} "
                f"{shared.gate_weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    return None


def takes_shared(x: torch.Tensor, tiles: nvfp4_launch.Tiles | None = None) -> bool:
    """Whether `fused_moe` serves x on the tensor-core decode, which alone takes a shared
    slot and the residual."""
    tiles = tiles or nvfp4_launch.tiles_for(x.device)
    return 0 < x.shape[0] <= nvfp4_launch.DECODE_MAX_TOKENS and nvfp4_launch.uses_mma(x, tiles)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor,
              w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor,
              path: str = "auto", tiles: nvfp4_launch.Tiles | None = None,
              shared: SharedSlot | None = None, residual: torch.Tensor | None = None,
              reciprocal: bool = False) -> torch.Tensor:
    """Routed-expert partial sum for `x` [T, H] with NVFP4 experts, in x's dtype; plus the
    gated shared expert `shared` (its partial sum: one more slot of every token) and then
    `residual` [T, H], where given, which only the tensor-core decode takes
    (`takes_shared`).

    Shapes as `NVFP4FusedExperts`: w13 [E, 2I, H/2] uint8 (gate rows, then up rows),
    w13_scale [E, 2I, H/16] e4m3, w13_global [E, 2] float32 (gate, up); w2 [E, H, I/2],
    w2_scale [E, H, I/16], w2_global [E]; `reciprocal`: the globals are stored ones that
    divide (compressed-tensors: the tensor-core decode inverts them in its kernel, the other
    paths first). `path`: "auto", "decode" or "prefill". Rank-dependent through the
    TP-local intermediate size I."""
    _check(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    tiles = tiles or nvfp4_launch.tiles_for(x.device)
    if shared is not None or residual is not None:
        if path == "prefill" or not takes_shared(x, tiles):
            raise ValueError("fused_moe: a shared slot or residual needs the tensor-core decode "
                             f"(x {tuple(x.shape)} {x.dtype} on {x.device}, path {path!r})")
        mismatch = None if shared is None else shared_mismatch(
            x, dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale), shared)
        if mismatch:
            raise NVFP4FormatError(f"fused_moe: {mismatch}")
        if residual is not None and tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"fused_moe: residual {tuple(residual.shape)} does not fit x "
                             f"{tuple(x.shape)}")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if path == "auto":
        path = "decode" if tokens <= nvfp4_launch.DECODE_MAX_TOKENS else "prefill"
    if path not in ("decode", "prefill"):
        raise ValueError(f"fused_moe: path must be auto, decode or prefill, got {path!r}")
    experts = dict(w13=w13, s13=w13_scale.view(torch.uint8), g13=w13_global.float().contiguous(),
                   w2=w2, s2=w2_scale.view(torch.uint8), g2=w2_global.float().contiguous())
    args = dict(x=x.contiguous(), topk_ids=topk_ids.reshape(-1).contiguous(),
                topk_weights=topk_weights.reshape(-1).contiguous(), **experts,
                intermediate=_local_intermediate(w13, w2), top_k=top_k, tiles=tiles)
    if tokens == 0:
        return x.new_zeros(0, hidden)
    if path == "decode" and nvfp4_launch.uses_mma(x, tiles):
        return _decode_mma(**args, shared=shared, residual=residual, reciprocal=reciprocal)
    if reciprocal:
        args["g13"], args["g2"] = 1.0 / args["g13"], 1.0 / args["g2"]
    if path == "decode":
        return _decode(**args)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _prefill(out=out, **args)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _decode(x, topk_ids, topk_weights, w13, s13, g13, w2, s2, g2, intermediate, top_k, tiles):
    """The CUDA-core decode: gate_up per pair, then down per token over its slots."""
    h, stride_h_nibble = nvfp4_launch.gate_up_decode_launch(
        x, topk_ids, topk_weights, w13, s13, g13, g2, intermediate=intermediate, top_k=top_k,
        tiles=tiles)
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    nvfp4_launch.down_decode_launch(h, stride_h_nibble, topk_ids, w2, s2, out,
                                    k_inputs=intermediate, top_k=top_k, tiles=tiles)
    return out


def _decode_mma(x, topk_ids, topk_weights, w13, s13, g13, w2, s2, g2, intermediate, top_k,
                tiles, shared=None, residual=None, reciprocal=False):
    """The tensor-core decode: gate_up per slot (the routed pairs and the shared expert's),
    down per token over its slots (and the residual)."""
    pdl = nvfp4_mma_launch.launches_early(x, tiles)
    h16 = nvfp4_mma_launch.gate_up_mma_launch(
        x, topk_ids, topk_weights, w13, s13, g13, g2, intermediate=intermediate, top_k=top_k,
        tiles=tiles, pdl=pdl, shared=shared, reciprocal=reciprocal)
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    nvfp4_mma_launch.down_mma_launch(h16, topk_ids, w2, s2, out, k_inputs=intermediate,
                                     top_k=top_k, tiles=tiles, pdl=pdl, shared=shared,
                                     residual=None if residual is None else residual.contiguous())
    return out


def _prefill(x, topk_ids, topk_weights, w13, s13, g13, w2, s2, g2, intermediate, top_k,
             tiles, out):
    """The prefill path: pairs sorted by expert, gate_up then down per block of pairs."""
    pairs = topk_ids.numel()
    sorted_pairs, block_expert = align_pairs(topk_ids, w13.shape[0], tiles.prefill_m)
    h = nvfp4_launch.gate_up_prefill_launch(
        x, sorted_pairs, block_expert, w13, s13, g13, num_pairs=pairs,
        intermediate=intermediate, top_k=top_k, tiles=tiles)
    nvfp4_launch.down_prefill_launch(h, sorted_pairs, block_expert, topk_weights, w2, s2, g2,
                                     out, num_pairs=pairs, k_inputs=intermediate, tiles=tiles)
