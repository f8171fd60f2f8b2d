"""The weight-only quantized GEMMs (`freetoken.kernels.quant_gemm`) on a GPU at Qwen3.5-35B-A3B's
projections: per format (block FP8 128x128, FP8 per tensor, NVFP4 in both producers'
conventions), TP-local shape and token count, the kernel's time, the bytes it reads and
their share of the copy bandwidth, its error against the torch path, and graph replay
against eager.

    python3 bench/quant_linear.py [--tp 1,8] [--tokens 1,16] [--formats ...] [--only ...]
        [--sweep] [--json FILE]
    python3 bench/quant_linear.py --check [--tp 1,2,4,8] [--json FILE]

Each layer is rank tp-1's of its TP size (the last rank: offsets inside shared blocks),
built as the model builds it (`bench/_quant_layers.py`), with random contents. Times are
per call from CUDA graphs of many calls, each on its own copy of the layer (the copies
filling more than twice the L2), so no call finds its weights cached. `MB` counts every
tensor the call reads (weights, scales, the per-row index); `% copy` is that over the time
against the device-to-device copy bandwidth (read + write) measured in the same run.
`bf16_us` is cuBLAS on the same weights dequantized to bf16 (twice FP8's bytes), and for
NVFP4 layers of one global `mma_us` the routed-expert kernels' dense path
(`freetoken.kernels.nvfp4_linear`) and, at 2-16 tokens, `columns_us` and `columns_rel_l2`
that path with the tokens as the mma's columns (`nvfp4_linear.COLUMNS`). `rel_l2` is
against float32 on the torch path's dequantized weights. `--sweep` also times other tiles
per decode row and keeps the fastest (`--write`: as a tile table), and for the projections
that take the decoder layer's input norm (NORMED) the one-token row tiles with the norm
fused too (`norm_*` columns, `+norm` keys). The NVFP4 LM head at one or two tokens runs
`nvfp4_linear` (`quant_gemm.MMA_MIN_ROWS`, `MMA_MAX_TOKENS`), whatever its `tiles` column
says.
`--check`: TP 1/2/4/8, 1, 5, 16 and 64 tokens, errors and graph equality only, and at one
token the row kernel (two tilings, plain and with the decode step's norm, residual and, for
the shared expert's gate_up, SiLU-and-mul: `rows_rel_l2`, `rows_graph_eq`), and at 2-16
tokens the NVFP4 LM head with the tokens as the mma's columns (`columns_rel_l2`,
`columns_graph_eq`); exit 1 when any relative L2 error passes 1e-2 or a replay differs."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import capture_graph, copy_bandwidth, graph_us, int_list, rel_l2
from _quant_layers import FORMATS, SHAPES, make_layer, weight_bytes
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.kernels import gemv, next_pow2, nvfp4_linear, quant_gemm  # noqa: E402

SWEEP = dict(block_n=(16, 32, 64), num_warps=(4, 8), split=(1, 2, 4, 8, 16))
SWEEP_K = {"fp8": (128, 256, 512), "nvfp4": (64, 128, 256)}
# the kernels without tensor cores (`quant_gemm_rows_jit`), swept at one token
ROW_SWEEP = dict(block_n=(1, 2, 4, 8, 16, 32), num_warps=(4, 8), split=(1, 2))
ROW_SWEEP_K = {"fp8": (512, 1024, 2048), "nvfp4": (256, 512, 1024, 2048)}
ROW_SWEEP_TOKENS = 1
# the projections that take the decoder layer's input norm in the engine: their one-token
# row tiles are also swept with the norm fused (`+norm` table keys)
NORMED = ("attn.qkv", "gdn.in_proj_qkvz")
TOLERANCE = 1e-2



def reference(layer, x: torch.Tensor) -> torch.Tensor:
    """float32 x times the torch path's weight, dequantized in float32, without TF32."""
    w = layer.quant.dequantize(layer, torch.float32)
    return x.float() @ w.T


def graph_equals_eager(fn) -> bool:
    eager = fn()
    graph = capture_graph([fn])
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(fn(), eager) and torch.equal(_replayed(fn), eager)


def _replayed(fn) -> torch.Tensor:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def copies_of(layer, l2: int) -> list:
    """`layer` and enough copies (own storage, same values) that a cycle through them
    reads more than twice the L2."""
    count = min(512, max(2, -(-2 * l2 // weight_bytes(layer))))
    return [layer] + [copy.deepcopy(layer) for _ in range(count - 1)]


def kernel_call(layer, x, tiles, **fused):
    """The layer's kernel call on x with `tiles` (None: the ones the engine takes) and
    `fused`, the row kernel's norm, normed, gate and residual."""
    return functools.partial(layer.quant.kernel, layer, x, None, tiles=tiles, **fused)


def row_kernel_check(layer, x, gen, gated: bool) -> tuple[float, bool]:
    """One token on the row kernel, two tilings (one split over the inputs) and the tile
    table's own for this call where they name the row kernel (the plain call's, and with the
    fusions the `+norm` entry where the table has one), plain and with the decode fusions
    (Qwen3.5's 1 + w RMSNorm, stored, SiLU-and-mul where the layer is `gated` [gate | up],
    and the residual), against float32 of the separate steps: (the worst relative L2,
    whether every graph replay equals its eager call)."""
    k = x.shape[1]
    step = min(1024, next_pow2(k))
    rows, fmt = layer.weight.shape[0], layer.quant.tile_format
    norm = gemv.Norm(torch.randn(k, device="cuda", generator=gen).to(x.dtype) * 0.3, 1e-6,
                     True)
    plain, fused_want = reference(layer, x), reference(layer, gemv.reference_norm(x, norm))
    if gated:
        half = fused_want.shape[1] // 2
        fused_want = F.silu(fused_want[:, :half]) * fused_want[:, half:]
    residual = torch.randn(fused_want.shape, device="cuda", generator=gen).to(x.dtype)
    normed = torch.empty_like(x)
    worst, equal = 0.0, True
    fixed = (quant_gemm.QuantTiles(1, 2, step, num_stages=2, rows=True),
             quant_gemm.QuantTiles(1, 4, max(64, step // 2), num_stages=2, split=2, rows=True))
    own = (quant_gemm.fusing_tiles(1, rows, k, fmt),
           quant_gemm.fusing_tiles(1, rows, k, fmt, norm=True))
    for tiles, fused_tiles in [(t, t) for t in fixed] + ([own] if all(own) else []):
        call = kernel_call(layer, x, tiles)
        worst = max(worst, rel_l2(call(), plain))
        fused = kernel_call(layer, x, fused_tiles, norm=norm, residual=residual,
                            normed=normed, gated=gated)
        worst = max(worst, rel_l2(fused(), fused_want + residual.float()),
                    rel_l2(normed, gemv.reference_norm(x, norm)))
        equal = equal and graph_equals_eager(call) and graph_equals_eager(fused)
    return worst, equal


def local_in(layer) -> int:
    """The layer's TP-local input width: NVFP4 packs two values a byte."""
    nvfp4 = quant_gemm.format_kind(layer.quant.tile_format) == "nvfp4"
    return layer.weight.shape[1] * (2 if nvfp4 else 1)


def sweep_tiles(layer, tokens, which="all"):
    """Every decode tile choice of SWEEP and SWEEP_K that fits the layer's inputs (`which`:
    "all" or "dot"), and the row kernel's tiles of ROW_SWEEP and ROW_SWEEP_K at one token
    ("all" or "rows")."""
    kind, k = quant_gemm.format_kind(layer.quant.tile_format), local_in(layer)
    if which in ("all", "dot"):
        for block_k, (block_n, warps, split) in itertools.product(
                SWEEP_K[kind], itertools.product(*SWEEP.values())):
            if (block_k > max(16, next_pow2(k)) or
                    (split > 1 and block_k * split > k)):
                continue
            yield quant_gemm.QuantTiles(16, block_n, block_k, num_warps=warps, split=split)
    if which in ("all", "rows") and tokens <= ROW_SWEEP_TOKENS:
        for block_k, (block_n, warps, split) in itertools.product(
                ROW_SWEEP_K[kind], itertools.product(*ROW_SWEEP.values())):
            if block_k * split <= max(k, ROW_SWEEP_K[kind][0]):
                yield quant_gemm.QuantTiles(1, block_n, block_k, num_warps=warps,
                                            num_stages=2, split=split, rows=True)


def bench_row(name, fmt, tp, tokens, copy_gbs, gen, sweep, l2, timing=True,
              deadline=float('inf')):
    shape = SHAPES[name]
    layer = make_layer(shape, fmt, tp - 1, tp, gen)
    width = local_in(layer)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = reference(layer, x)
    got = layer.quant.kernel(layer, x, None)
    row = dict(format=fmt, shape=name, tp=tp, tokens=tokens,
               rows_x_in=f"{layer.weight.shape[0]}x{width}",
               MB=weight_bytes(layer) / 1e6, rel_l2=rel_l2(got, want),
               graph_eq=graph_equals_eager(lambda: layer.quant.kernel(layer, x, None)))
    columns = (fmt == "nvfp4" and layer.weight_scale_2.numel() == 1
               and 1 < tokens <= quant_gemm.DECODE_MAX_TOKENS)
    if columns:
        with token_columns():
            row["columns_rel_l2"] = rel_l2(dense_call(layer, x)(), want)
            row["columns_graph_eq"] = graph_equals_eager(dense_call(layer, x))
    if not timing:
        if tokens == 1:
            row["rows_rel_l2"], row["rows_graph_eq"] = row_kernel_check(
                layer, x, gen, gated=name.endswith("gate_up"))
        return row
    copies = copies_of(layer, l2)
    tile_format = layer.quant.tile_format
    tiles = quant_gemm.tiles_for(tokens, layer.weight.shape[0], width, tile_format)
    best, best_us = tiles, graph_us([kernel_call(c, x, None) for c in copies])
    row["default_us"] = best_us
    if sweep and tokens <= quant_gemm.DECODE_MAX_TOKENS and time.time() < deadline:
        best, best_us = fastest(sweep_tiles(layer, tokens, sweep), best, best_us,
                                lambda t: [kernel_call(c, x, t) for c in copies],
                                f"{name} {fmt} T={tokens}", deadline)
        row["sweep_rel_l2"] = rel_l2(kernel_call(layer, x, best)(), want)
    if sweep and tokens <= quant_gemm.DECODE_MAX_TOKENS:
        row["key"] = quant_gemm.table_key(tile_format, layer.weight.shape[0], width, tokens)
    if sweep in ("all", "rows") and tokens <= ROW_SWEEP_TOKENS and name in NORMED:
        row.update(sweep_normed(layer, fmt, x, copies, gen, deadline))
    row.update(us=best_us, tiles=best.key(),
               pct_copy=100 * weight_bytes(layer) / (best_us * 1e-6) / (copy_gbs * 1e9))
    dense = [c.quant.dequantize(c, torch.bfloat16) for c in copies[:max(2, len(copies) // 2)]]
    row["bf16_us"] = graph_us([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    if fmt == "nvfp4" and layer.weight_scale_2.numel() == 1:
        row["mma_us"] = graph_us([dense_call(c, x) for c in copies])
        if columns:
            with token_columns():
                row["columns_us"] = graph_us([dense_call(c, x) for c in copies])
    return row


def dense_call(layer, x):
    """The NVFP4 layer's call on `nvfp4_linear` (its one global: an LM head's path)."""
    return functools.partial(nvfp4_linear.nvfp4_linear, x, layer.weight, layer.weight_scale,
                             layer.weight_scale_2[0])


@contextlib.contextmanager
def token_columns():
    """`nvfp4_linear.COLUMNS` on inside the block: several tokens as the mma's columns."""
    shipped, nvfp4_linear.COLUMNS = nvfp4_linear.COLUMNS, True
    try:
        yield
    finally:
        nvfp4_linear.COLUMNS = shipped


def fastest(candidates, best, best_us, calls_for, what, deadline):
    """(tiles, us): the fastest of `best` (timed at `best_us`) and `candidates`, each timed
    as a graph of `calls_for(tiles)`, until `deadline`; a choice the compiler or the GPU
    refuses is reported and skipped."""
    for t in candidates:
        if time.time() >= deadline:
            break
        try:
            us = graph_us(calls_for(t), replays=3)
        except Exception as err:  # a tile choice the compiler or the GPU refuses
            print(f"{what} {t.key()}: {type(err).__name__}", file=sys.stderr)
            continue
        if us < best_us:
            best, best_us = t, us
    return best, best_us


def sweep_normed(layer, fmt, x, copies, gen, deadline) -> dict:
    """The row tiles of a one-token call with the input norm fused (Qwen3.5's 1 + w),
    starting from the tiles the engine takes for it now: `norm_default_us`, the fastest
    `norm_tiles` / `norm_us` and their `norm_key` (a `+norm` table key)."""
    tile_format = layer.quant.tile_format
    rows, k = layer.weight.shape[0], x.shape[1]
    norm = gemv.Norm(torch.randn(k, device="cuda", generator=gen).to(x.dtype) * 0.3, 1e-6,
                     True)
    best = quant_gemm.fusing_tiles(1, rows, k, tile_format, norm=True) or \
        quant_gemm.QuantTiles(1, 4, min(1024, next_pow2(k)), num_stages=2, rows=True)
    best_us = default_us = graph_us([kernel_call(c, x, best, norm=norm) for c in copies])
    best, best_us = fastest(sweep_tiles(layer, 1, "rows"), best, best_us,
                            lambda t: [kernel_call(c, x, t, norm=norm) for c in copies],
                            f"{fmt} {rows}x{k}+norm", deadline)
    return dict(norm_key=quant_gemm.table_key(tile_format, rows, k, 1, norm=True),
                norm_default_us=default_us, norm_tiles=best.key(), norm_us=best_us)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int_list, default=None)
    p.add_argument("--tokens", type=int_list, default=None)
    p.add_argument("--formats", type=lambda t: t.split(","), default=list(FORMATS))
    p.add_argument("--only", type=lambda t: t.split(","), default=None)
    p.add_argument("--sweep", nargs="?", const="all", default=None,
                   choices=("all", "dot", "rows"),
                   help="time other tiles: the dot tiles, the row kernel (at one token), "
                        "or both (the default)")
    p.add_argument("--sweep-seconds", type=float, default=float("inf"),
                   help="stop sweeping (default tiles only) after this many seconds")
    p.add_argument("--write", type=Path, default=None,
                   help="with --sweep: write the fastest tiles per decode row as a JSON "
                        "tile table (`quant_gemm.table_key` keys; the engine's table with "
                        "the swept entries replaced)")
    p.add_argument("--check", action="store_true", help="errors and graph equality only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    tps = args.tp or ([1, 2, 4, 8] if args.check else [1, 8])
    token_counts = args.tokens or ([1, 5, 16, 64] if args.check else [1, 16])
    copy_gbs = 0.0 if args.check else copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, deadline = [], time.time() + args.sweep_seconds
    for name in args.only or SHAPES:
        for fmt in [f for f in args.formats if f in SHAPES[name].formats]:
            for tp in tps:
                for tokens in token_counts:
                    rows.append(bench_row(name, fmt, tp, tokens, copy_gbs, gen, args.sweep,
                                          l2, timing=not args.check, deadline=deadline))
                    print(json.dumps(rows[-1]), flush=True)
                    torch.cuda.empty_cache()
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
            f"{__import__('triton').__version__}")
    if not args.check:
        head += (f", copy bandwidth {copy_gbs:.0f} GB/s; times per call in CUDA graphs, "
                 "weights not in L2")
    print("\n" + head)
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    bad = [f"{r['format']} {r['shape']} tp={r['tp']} T={r['tokens']}" for r in rows
           if not r["rel_l2"] <= TOLERANCE or not r["graph_eq"]
           or not r.get("sweep_rel_l2", 0) <= TOLERANCE
           or not r.get("rows_rel_l2", 0) <= TOLERANCE or not r.get("rows_graph_eq", True)
           or not r.get("columns_rel_l2", 0) <= TOLERANCE
           or not r.get("columns_graph_eq", True)]
    if args.json:
        args.json.write_text(json.dumps({"device": head, "copy_GBps": copy_gbs, "rows": rows,
                                         "failures": bad}, indent=1))
    if args.write:
        table = dict(quant_gemm._table())
        table.update({r["key"]: r["tiles"] for r in rows if "key" in r})
        table.update({r["norm_key"]: r["norm_tiles"] for r in rows if "norm_key" in r})
        args.write.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"tile table ({len(table)} entries) written to {args.write}")
    if bad:
        print(f"FAILED (rel L2 > {TOLERANCE} or graph != eager): {'; '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
