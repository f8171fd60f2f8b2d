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
same kernels on the weights dequantized to bf16 (twice the bytes). `rel_l2`: against the
torch path (each hit expert dequantized, float32); `graph`: a replay equals the eager call
bit for bit. `--sweep` also times other tiles (`fused_moe.MoeTiles`) per row and reports the
fastest. Exit 1 when an error passes 1e-2 or a replay differs."""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
from freetoken.kernels import fused_moe  # noqa: E402
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts  # noqa: E402
from freetoken_verify.checks.kernels.quant import engine_step  # noqa: E402

BLOCK = (128, 128)
TOLERANCE = 1e-2
SWEEP = dict(gate_up_n=(16, 32, 64), down_n=(32, 64, 128), block_k=(64, 128, 256),
             num_warps=(4, 8))


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


def copies_of(layer: BlockFP8FusedExperts, hit_bytes: int) -> list:
    """`layer` and clones, enough that a cycle of calls reads >= 4 x L2 (at most 32)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    count = min(32, max(2, -(-4 * l2 // max(hit_bytes, 1))))
    return [layer] + [copy.deepcopy(layer) for _ in range(count - 1)]


def routing(tokens: int, args, gen: torch.Generator):
    x = torch.randn(tokens, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, args.experts, generator=gen, device="cuda").topk(args.top_k).indices
    weights = torch.rand(tokens, args.top_k, generator=gen, device="cuda")
    return x, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16), ids


def expert_bytes(layer: BlockFP8FusedExperts) -> int:
    """Codes and scales of one expert."""
    return sum(getattr(layer, n)[0].numel() * getattr(layer, n).element_size()
               for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"))


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
        captured = {}
        graph = capture_graph([lambda: captured.update(out=calls[0]())])
        graph.replay()
        torch.cuda.synchronize()
        replay_equal = torch.equal(eager, captured["out"])
    want = layer(x.float(), weights.float(), ids)
    w13 = torch.stack([layer.dequantize_w13(e, torch.bfloat16) for e in range(args.experts)])
    w2 = torch.stack([layer.dequantize_w2(e, torch.bfloat16) for e in range(args.experts)])
    bf16_calls = [lambda: fused_moe.fused_moe(x, weights, ids, w13, w2)]
    bf16_us = graph_us(bf16_calls * 2)
    tiles = fused_moe.DECODE_TILES if tokens * args.top_k <= fused_moe.DECODE_MAX_PAIRS \
        else fused_moe.PREFILL_TILES
    best = sweep(layers, x, weights, ids, tiles) if args.sweep else (us, tiles)
    gbs = nbytes / us / 1e3
    return {"tp": tp, "I_local": layer.local_intermediate, "tokens": tokens, "experts_hit": hit,
            "MB": nbytes / 1e6, "us": us, "% copy": 100 * gbs / copy_gbs, "bf16_us": bf16_us,
            "rel_l2": rel_l2(eager, want), "graph": "equal" if replay_equal else "DIFFERS",
            "best_us": best[0], "best % copy": 100 * nbytes / best[0] / 1e3 / copy_gbs,
            "best tiles": f"{best[1].gate_up_n}/{best[1].down_n}/{best[1].block_k}/"
                          f"{best[1].num_warps}"}


def sweep(layers, x, weights, ids, default) -> tuple[float, fused_moe.MoeTiles]:
    """(us, tiles) of the fastest tile choice of SWEEP for one row."""
    scales = [m.block_scales() for m in layers]
    best = None
    for values in itertools.product(*SWEEP.values()):
        tiles = dataclasses.replace(default, **dict(zip(SWEEP, values)))
        calls = [lambda m=m, s=s, t=tiles: fused_moe.fused_moe(
            x, weights, ids, m.w13_weight, m.w2_weight, tiles=t, w13_scales=s[0],
            w2_scales=s[1]) for m, s in zip(layers, scales)]
        try:
            us = graph_us(calls)
        except Exception as e:  # a tile choice the compiler or the GPU refuses
            print(f"  {tiles}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if best is None or us < best[0]:
            best = (us, tiles)
    return best


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
    print(tabulate([[f"{v:.3g}" if isinstance(v, float) else v for v in r.values()]
                    for r in rows], headers=list(rows[0]), tablefmt="simple"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["rel_l2"] > TOLERANCE or r["graph"] != "equal"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
