"""Block-FP8 routed experts on one GPU (`BlockFP8FusedExperts` in a step that takes the CUDA
paths: `freetoken.kernels.fused_moe` with block scales), at Qwen3.5-35B-A3B's expert
dimensions and 128 x 128 blocks.

    python3 bench/fp8_moe.py [--tp 1,8] [--tokens 1,16] [--experts 256] [--top-k 8]
        [--hidden 2048] [--intermediate 512] [--sweep] [--json FILE]

Each layer is rank tp-1's of its TP size (at TP 8, I = 64: half a block, the last rank
half a block into its column block), random e4m3 codes and positive scales. Times are per
call from CUDA graphs of many calls, each on its own copy of the experts (together more
than four times the L2), so no call finds its weights cached. `MB` counts the codes and
scales of the experts the batch hits; `% copy` is that over the time against the
device-to-device copy bandwidth (read + write) measured in the same run. `bf16_us`: the
same launcher on the hit experts dequantized to bf16 (twice the bytes). At one token the
launcher takes the row kernels (`moe_rows`); `grouped_us` and `bf16_grouped_us` time the
grouped kernels it took before (`tiles=fused_moe.DECODE_TILES`) beside them. `rel_l2`
(block FP8) and `bf16_rel_l2`: against the torch path (each hit expert dequantized,
float32); `graph`: a replay equals the eager call bit for bit, for every path timed.
`--sweep` also times other tiles per row and reports the fastest: at one token the row
tiles (`moe_rows.RowMoeTiles`: features per program of each kernel, inputs per step,
warps; tiles whose step exceeds both rows are skipped as duplicates), for block FP8 and
bf16; at more tokens the grouped tiles (`fused_moe.MoeTiles`), for block FP8. A one-token
sweep compiles up to 192 tile choices per dtype: a minute or more per row. Exit 1 when an
error passes 1e-2 or a replay differs."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
from _common import capture_graph, copy_bandwidth, graph_us, int_list, rel_l2
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.distributed import TPInfo, acting_as  # noqa: E402
from freetoken.formats.fp8.block import FP8  # noqa: E402
from freetoken.kernels import fused_moe, moe_rows, next_pow2  # noqa: E402
from freetoken.kernels.moe_rows import RowMoeTiles  # noqa: E402
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts  # noqa: E402
from freetoken_verify.checks.kernels.quant import engine_step  # noqa: E402

BLOCK = (128, 128)
TOLERANCE = 1e-2
SWEEP = dict(gate_up_n=(16, 32, 64), down_n=(32, 64, 128), block_k=(64, 128, 256),
             num_warps=(4, 8))
ROW_SWEEP = dict(gate_up_n=(1, 2, 4, 8), down_n=(1, 2, 4, 8), block_k=(256, 512, 1024, 2048),
                 num_warps=(2, 4, 8))


def make_experts(args, tp: int, gen: torch.Generator) -> BlockFP8FusedExperts:
    """Rank tp-1's experts of TP `tp`, random codes (|code| <= 448) and scales."""
    with acting_as(TPInfo(tp - 1, tp)):
        layer = BlockFP8FusedExperts(args.experts, args.hidden, args.intermediate, BLOCK)
    layer = layer.to("cuda")
    for name in ("w13_weight", "w2_weight"):
        p = getattr(layer, name)
        codes = torch.randn(p.shape, generator=gen, device="cuda") * 64
        p.data.copy_(codes.clamp(-448, 448).to(FP8))
    for name in ("w13_weight_scale", "w2_weight_scale"):
        p = getattr(layer, name)
        p.data.copy_(torch.rand(p.shape, generator=gen, device="cuda") * 1e-3 + 1e-4)
    return layer


def copy_count(hit_bytes: int) -> int:
    """Copies of the experts for a cycle of calls to read >= 4 x L2 (2 to 32)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return min(32, max(2, -(-4 * l2 // max(hit_bytes, 1))))


def copies_of(layer: BlockFP8FusedExperts, hit_bytes: int) -> list:
    """`layer` and clones, `copy_count` of them."""
    return [layer] + [copy.deepcopy(layer) for _ in range(copy_count(hit_bytes) - 1)]


def bf16_copies(layer: BlockFP8FusedExperts, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
    """(copies of the hit experts dequantized to bf16, stacked [hit, ...] as (w13, w2); the
    ids renumbered into them): the bytes the kernels read, without the other experts."""
    hit, local_ids = torch.unique(ids, return_inverse=True)
    w13 = torch.stack([layer.dequantize_w13(e, torch.bfloat16) for e in hit.tolist()])
    w2 = torch.stack([layer.dequantize_w2(e, torch.bfloat16) for e in hit.tolist()])
    count = copy_count((w13.numel() + w2.numel()) * 2)
    return [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(count - 1)], local_ids


def routing(tokens: int, args, gen: torch.Generator):
    x = torch.randn(tokens, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, args.experts, generator=gen, device="cuda").topk(args.top_k).indices
    weights = torch.rand(tokens, args.top_k, generator=gen, device="cuda")
    return x, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16), ids


def expert_bytes(layer: BlockFP8FusedExperts) -> int:
    """Codes and scales of one expert."""
    return sum(getattr(layer, n)[0].numel() * getattr(layer, n).element_size()
               for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"))


def fp8_calls(layers, x, weights, ids, tiles=None) -> list:
    """One `fused_moe` call per copy of the block-FP8 experts, with `tiles`."""
    calls = []
    for m in layers:
        w13_scales, w2_scales = m.block_scales()
        calls.append(functools.partial(fused_moe.fused_moe, x, weights, ids, m.w13_weight,
                                       m.w2_weight, tiles=tiles, w13_scales=w13_scales,
                                       w2_scales=w2_scales))
    return calls


def bf16_calls(copies, x, weights, ids, tiles=None) -> list:
    """One `fused_moe` call per copy of the bf16 experts, with `tiles`."""
    return [functools.partial(fused_moe.fused_moe, x, weights, ids, w13, w2, tiles=tiles)
            for w13, w2 in copies]


def replays_equal(call) -> bool:
    """Whether a CUDA graph of `call` replays the eager call's bits."""
    eager = call()
    captured = {}
    graph = capture_graph([lambda: captured.update(out=call())])
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(eager, captured["out"])


def row(args, tp: int, tokens: int, copy_gbs: float, gen: torch.Generator) -> dict:
    layer = make_experts(args, tp, gen)
    x, weights, ids = routing(tokens, args, gen)
    hit = int(torch.unique(ids).numel())
    nbytes = hit * expert_bytes(layer)
    layers = copies_of(layer, nbytes)
    with engine_step(torch.device("cuda"), tokens):
        calls = [lambda m=m: m(x, weights, ids) for m in layers]
        eager = calls[0]()
        us = graph_us(calls)
        replay_equal = replays_equal(calls[0])
    want = layer(x.float(), weights.float(), ids)
    bf16, local_ids = bf16_copies(layer, ids)
    bf16_eager = bf16_calls(bf16, x, weights, local_ids)[0]()
    bf16_us = graph_us(bf16_calls(bf16, x, weights, local_ids))
    replay_equal &= replays_equal(bf16_calls(bf16, x, weights, local_ids)[0])
    grouped_us = bf16_grouped_us = None
    if tokens == 1:
        grouped = fused_moe.DECODE_TILES
        grouped_us = graph_us(fp8_calls(layers, x, weights, ids, grouped))
        bf16_grouped_us = graph_us(bf16_calls(bf16, x, weights, local_ids, grouped))
        replay_equal &= replays_equal(fp8_calls(layers, x, weights, ids, grouped)[0])
        default = row_default(args, tp)
    else:
        default = fused_moe.DECODE_TILES if tokens * args.top_k <= fused_moe.DECODE_MAX_PAIRS \
            else fused_moe.PREFILL_TILES
    best = bf16_best = (None, None)
    if args.sweep:
        best = sweep(lambda t: fp8_calls(layers, x, weights, ids, t),
                     candidates(default, args, tp), (us, default))
        if tokens == 1:
            bf16_best = sweep(lambda t: bf16_calls(bf16, x, weights, local_ids, t),
                              candidates(default, args, tp), (bf16_us, default))
    gbs = nbytes / us / 1e3
    return {"tp": tp, "I_local": layer.local_intermediate, "tokens": tokens, "experts_hit": hit,
            "MB": nbytes / 1e6, "us": us, "% copy": 100 * gbs / copy_gbs,
            "grouped_us": grouped_us, "bf16_us": bf16_us, "bf16_grouped_us": bf16_grouped_us,
            "rel_l2": rel_l2(eager, want), "bf16_rel_l2": rel_l2(bf16_eager, want),
            "graph": "equal" if replay_equal else "DIFFERS",
            "best_us": best[0],
            "best % copy": None if best[0] is None else 100 * nbytes / best[0] / 1e3 / copy_gbs,
            "best tiles": spell(best[1]), "bf16_best_us": bf16_best[0],
            "bf16 best tiles": spell(bf16_best[1])}


def row_default(args, tp: int) -> RowMoeTiles:
    """The row tiles `fused_moe` takes at one token for this row's shapes."""
    return moe_rows.choose_tiles(args.hidden, args.intermediate // tp, args.top_k)


def candidates(default, args, tp: int) -> list:
    """The tiles a sweep times: the row tiles of ROW_SWEEP (one per distinct launch: a step
    past both rows' lengths is the same launch as the shorter one) for `RowMoeTiles`,
    else the grouped tiles of SWEEP."""
    if not isinstance(default, RowMoeTiles):
        return [dataclasses.replace(default, **dict(zip(SWEEP, v)))
                for v in itertools.product(*SWEEP.values())]
    inter = args.intermediate // tp
    seen, out = set(), []
    for values in itertools.product(*ROW_SWEEP.values()):
        tiles = RowMoeTiles(**dict(zip(ROW_SWEEP, values)))
        key = (tiles.gate_up_n, tiles.down_n, min(tiles.block_k, next_pow2(args.hidden)),
               min(tiles.block_k, next_pow2(inter)), tiles.num_warps)
        if key not in seen:
            seen.add(key)
            out.append(tiles)
    return out


def sweep(calls_for, tiles_list, default: tuple) -> tuple:
    """(us, tiles) of the fastest of `default` (us, tiles) and every choice of `tiles_list`
    (`calls_for(tiles)`: the calls to time)."""
    best = default
    for tiles in tiles_list:
        try:
            us = graph_us(calls_for(tiles))
        except Exception as e:  # a tile choice the compiler or the GPU refuses
            print(f"  {tiles}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if us < best[0]:
            best = (us, tiles)
    return best


def spell(tiles) -> str | None:
    """Row tiles `r<gate_up_n>/<down_n>/<block_k>/<warps>`, grouped ones without the `r`."""
    if tiles is None:
        return None
    return ("r" if isinstance(tiles, RowMoeTiles) else "") + \
        f"{tiles.gate_up_n}/{tiles.down_n}/{tiles.block_k}/{tiles.num_warps}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int_list, default=[1, 8])
    p.add_argument("--tokens", type=int_list, default=[1, 16])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--sweep", action="store_true", help="also search tile sizes per row")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/fp8_moe.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    print(f"{props.name}; torch {torch.__version__}, triton {__import__('triton').__version__};"
          f" copy bandwidth {copy_gbs:.0f} GB/s; E={args.experts} top-{args.top_k} "
          f"H={args.hidden} I={args.intermediate}, blocks {BLOCK}, bf16 activations",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [row(args, tp, t, copy_gbs, gen) for tp in args.tp for t in args.tokens]
    print(tabulate([[f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else v)
                     for v in r.values()] for r in rows], headers=list(rows[0]),
                   tablefmt="simple"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if max(r["rel_l2"], r["bf16_rel_l2"]) > TOLERANCE
           or r["graph"] != "equal"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
