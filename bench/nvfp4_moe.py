"""NVFP4 routed-expert kernels on one GPU: effective weight bandwidth and speedup over the torch
reference, at Qwen3.6-35B-A3B's expert dimensions.

    python bench/nvfp4_moe.py [--tp 1,2,4,8] [--decode 1,2,4,8,16] [--prefill 512,...,4096]
        [--experts 256] [--top-k 8] [--hidden 2048] [--intermediate 512] [--no-graphs]
        [--sweep] [--tiles JSON] [--json FILE]

Method. Rank 0's experts for each TP size (full I quantized per expert by the NVFP4 quantizer,
then cut to I / tp by the shard specs), bf16 activations, router ids drawn uniformly without
replacement per token. Times are CUDA-event medians over `--reps` runs after warm-up. Decode
runs as an engine runs a decode step: inside a CUDA graph, here one graph of L calls that
cycles through L copies of the expert weights (enough that one token's experts over a cycle
are >= 4 x the L2 cache, at most 64 copies; a cyclic sweep larger than the cache finds
nothing in it), timed per call; host launch latency is not counted, the gaps
between kernels in a graph are. `--no-graphs` times single eager calls instead. The header
also reports the floor: a graph of L x 3 trivial kernels, per 3 (a decode call launches 3).

* bytes read: packed weights + block scales + global scales of the experts the batch hits
  (each counted once, whatever the path re-reads from L2);
* GB/s: bytes read / kernel time; `% copy`: that over the copy bandwidth measured here by a
  1 GiB device-to-device copy, counted as bytes read + bytes written per second;
* speedup: the torch reference (`reference_moe`: dequantize each hit expert, float32 matmul;
  the engine's CPU backend) time over the kernel time; `rel_err` their relative L2 difference.
`--sweep` also tries other tile sizes per row and prints the fastest (`Tiles(...)`);
`--tiles '{"pdl": false}'` times other GPU tiles than the defaults (here: the mma decode
without programmatic dependent launch).
Target: decode at >= 60 % of copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import capture_graph, copy_bandwidth, time_ms  # noqa: E402
from freetoken.kernels import nvfp4_launch, nvfp4_moe  # noqa: E402
from freetoken.layers.quantization.nvfp4.reference import reference_moe  # noqa: E402
from freetoken_verify.checks.kernels.check import make_experts  # noqa: E402

DEVICE = "cuda"
SWEEP_DECODE = [dict(mma_warps=w, mma_max_split=s, mma_tiles=t, mma_maxnreg=r)
                for w in (1024, 2048, 4096) for s in (4, 8) for t in (1, 2) for r in (None, 88)]
SWEEP_PREFILL = [dict(prefill_m=m, prefill_n=n, prefill_groups=g, num_warps=w, num_stages=s)
                 for m, n in ((64, 64), (64, 128), (128, 64), (128, 128)) for g in (2, 4)
                 for w, s in ((4, 3), (8, 3), (4, 4))]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def time_graph_ms(fns: list, reps: int) -> float:
    """Median milliseconds per call of a CUDA graph that calls each of `fns` once, in order."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    return time_ms(capture_graph(fns).replay, reps) / len(fns)


def weight_copies(w: dict, hit_bytes: int, limit: int = 64) -> list[dict]:
    """`w` and clones of it, enough that a cycle reads >= 4 x L2 (at most `limit`)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    count = min(limit, max(2, -(-4 * l2 // max(hit_bytes, 1))))
    return [w] + [{k: v.clone() for k, v in w.items()} for _ in range(count - 1)]


def launch_floor_us(calls: int) -> float:
    """Per-3-kernel time of a graph of `calls` x 3 trivial kernels."""
    z = torch.zeros(16, device=DEVICE)
    return time_graph_ms([lambda: (z.add_(1), z.add_(1), z.add_(1))] * calls, 50) * 1e3


def bytes_read(w: dict, ids: torch.Tensor) -> int:
    """Packed weights + scales of the distinct experts in `ids`."""
    hit = int(torch.unique(ids).numel())
    per_expert = sum(w[k][0].numel() * w[k].element_size()
                     for k in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"))
    return hit * per_expert


def make_inputs(tokens: int, args, seed: int) -> tuple:
    """Activations, normalised routing weights and distinct expert ids per token."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, args.hidden, generator=gen, device=DEVICE).to(args.dtype)
    scores = torch.rand(tokens, args.experts, generator=gen, device=DEVICE)
    ids = scores.topk(args.top_k, dim=-1).indices
    weights = torch.rand(tokens, args.top_k, generator=gen, device=DEVICE)
    return x, (weights / weights.sum(-1, keepdim=True)).to(args.dtype), ids


def measure(copies: list[dict], inputs: tuple, args, copy_gbs: float, ref: torch.Tensor,
            tiles=None, reps: int | None = None) -> dict:
    """One row: kernel time, bandwidth, and relative L2 error against `ref`."""
    x, weights, ids = inputs
    tokens, w = x.shape[0], copies[0]
    path = "decode" if tokens <= nvfp4_launch.DECODE_MAX_TOKENS else "prefill"
    runs = [lambda c=c: nvfp4_moe.fused_moe(x, weights, ids, **c, tiles=tiles) for c in copies]
    if args.graphs and path == "decode":
        ms = time_graph_ms(runs, reps or args.reps)
    else:
        ms = time_ms(runs[0], reps or args.reps)
    out = runs[0]().float()
    nbytes = bytes_read(w, ids)
    gbs = nbytes / ms / 1e6
    return {"tokens": tokens, "path": path, "experts_hit": int(torch.unique(ids).numel()),
            "MiB": nbytes / 2**20, "us": ms * 1e3, "GB/s": gbs, "% copy": 100 * gbs / copy_gbs,
            "rel_err": float((out - ref).norm() / ref.norm())}


def sweep(copies, inputs, args, copy_gbs, ref) -> tuple[dict, dict]:
    """The fastest tile choice for one shape and its row ({} and the default's row when
    every alternative was refused)."""
    tokens = inputs[0].shape[0]
    options = SWEEP_DECODE if tokens <= nvfp4_launch.DECODE_MAX_TOKENS else SWEEP_PREFILL
    best = None
    for change in options:
        tiles = dataclasses.replace(nvfp4_launch.GPU_TILES, **change)
        try:
            row = measure(copies, inputs, args, copy_gbs, ref, tiles, reps=20)
        except Exception as e:  # a tile choice the compiler or the GPU refuses
            print(f"  tokens={tokens} {change}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if best is None or row["us"] < best[1]["us"]:
            best = (change, row)
    return best or ({}, measure(copies, inputs, args, copy_gbs, ref))


def row_for(copies: list[dict], tokens: int, args, copy_gbs: float, seed: int) -> dict:
    """Default tiles (or the sweep's best), the reference's time and the speedup."""
    inputs = make_inputs(tokens, args, seed)
    reference = lambda: reference_moe(*inputs, **copies[0])  # noqa: E731
    ref = reference().float()
    row = measure(copies, inputs, args, copy_gbs, ref)
    if args.sweep:
        change, best = sweep(copies, inputs, args, copy_gbs, ref)
        row = {**best, "tiles": change}
    if not args.no_reference:
        row["ref_ms"] = time_ms(reference, max(3, args.reps // 10))
        row["speedup"] = row["ref_ms"] * 1e3 / row["us"]
    return row


def _table(rows: list[dict]) -> str:
    from tabulate import tabulate

    keys = ["tp", "I_local", "path", "tokens", "experts_hit", "MiB", "us", "GB/s", "% copy",
            "ref_ms", "speedup", "rel_err", "tiles"]
    keys = [k for k in keys if any(k in r for r in rows)]
    fmt = {"MiB": "{:.1f}", "us": "{:.1f}", "GB/s": "{:.0f}", "% copy": "{:.1f}",
           "ref_ms": "{:.2f}", "speedup": "{:.1f}x", "rel_err": "{:.1e}"}
    body = [[fmt.get(k, "{}").format(r[k]) if k in r else "" for k in keys] for r in rows]
    return tabulate(body, headers=keys, tablefmt="simple", disable_numparse=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--decode", type=_ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--prefill", type=_ints, default=[512, 1024, 2048, 4096])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--dtype", type=lambda n: getattr(torch, n), default=torch.bfloat16,
                   help="activation dtype (bfloat16, float16, float32)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--sweep", action="store_true", help="also search tile sizes per row")
    p.add_argument("--tiles", type=json.loads, default={},
                   help="JSON object of Tiles fields replacing the GPU defaults")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    try:
        nvfp4_launch.GPU_TILES = dataclasses.replace(nvfp4_launch.GPU_TILES, **args.tiles)
    except (TypeError, ValueError) as e:
        fields = ", ".join(f.name for f in dataclasses.fields(nvfp4_launch.Tiles))
        p.error(f"--tiles: {e} (fields: {fields})")
    if not torch.cuda.is_available():
        print("bench/nvfp4_moe.py needs a CUDA GPU (the kernels' CPU interpreter is for "
              "correctness only); nothing measured.", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    floor = launch_floor_us(64)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB; "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}; copy "
          f"bandwidth {copy_gbs:.0f} GB/s (read + write); 3 trivial kernels in a graph "
          f"{floor:.1f} us; E={args.experts} top-{args.top_k} H={args.hidden} "
          f"I={args.intermediate}, {args.dtype} activations; {nvfp4_launch.GPU_TILES}", flush=True)
    rows = []
    for tp in args.tp:
        w = make_experts(args.experts, args.hidden, args.intermediate, tp, seed=tp,
                         device=DEVICE)
        one_token = bytes_read(w, torch.arange(args.top_k, device=DEVICE))
        copies = weight_copies(w, one_token) if args.graphs else [w]
        for tokens in args.decode + args.prefill:
            rows.append({"tp": tp, "I_local": args.intermediate // tp,
                         **row_for(copies, tokens, args, copy_gbs, seed=tokens)})
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print("\n" + _table(rows))
    decode = [r for r in rows if r["path"] == "decode"]
    met = [r for r in decode if r["% copy"] >= 60]
    print(f"\ndecode >= 60% of copy bandwidth: {len(met)} / {len(decode)} rows; worst relative "
          f"L2 error vs reference {max(r['rel_err'] for r in rows):.1e}")
    if args.json:
        args.json.write_text(json.dumps({"copy_GBps": copy_gbs, "device": props.name,
                                         "graph_floor_us": floor, "rows": rows}, indent=2,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
