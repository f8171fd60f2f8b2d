"""The decode-step linear kernels (`freetoken.kernels.gemv`) on a GPU at the projections of
the medium Llama and of qwen3.5-moe-realdims: each fused launch against the launches it
replaces (the GEMM and the engine's separate RMSNorm, SiLU-and-mul, add and MoE-combine
steps), checked in bf16 against the torch composition, graph replay against eager.

    python3 bench/decode_kernels.py [--tokens 1,16] [--sweep [--write FILE]] [--only NAME,...]

`--only` takes the shape names below, `combine` (the MoE combine), `route` (the routing
launch at 1-8 warps) and `attention` (the medium Llama's decode attention with its rotary
and cache write, at 96, 1024 and 4096 positions, each arm of `ATTENTION_ARMS`; `MB` is
the context's keys and values).

Times are per call from CUDA graphs of many calls, each call on its own copy of the
weight (copies filling more than twice the L2), so no call finds its weight cached: what
a decode step sees. `% copy` is the weight's bytes per call against the device-to-device
copy bandwidth (read + write) measured in the same run. `--sweep` also times every tile
choice of `SWEEP` (the input split included) and takes the fastest of those and the
unfused launches; `--write` saves these choices as a tile table (JSON, `gemv.table_key`
keys; `FREETOKEN_GEMV_TABLE` makes the engine take it, `freetoken/kernels/gemv_tiles.py`
holds the one measured on an H200)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import copy_bandwidth, graph_us, int_list, rel_l2
from tabulate import tabulate
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.kernels import gemv, norm_rope  # noqa: E402

# name: (weight rows, in_features, what the engine fuses: norm 0/1/2, gated, residual)
SHAPES = {
    "llama.qkv+norm": (1536, 1024, 1, False, False),
    "llama.o+residual": (1024, 1024, 0, False, True),
    "llama.gate_up+norm+silu": (5632, 1024, 1, True, False),
    "llama.down+residual": (1024, 2816, 0, False, True),
    "qwen35.gdn_in_proj+norm": (12352, 2048, 2, False, False),
    "qwen35.out_proj+residual": (2048, 4096, 0, False, True),
    "qwen35.attn_qkv+norm": (9216, 2048, 2, False, False),
    "qwen35.router": (256, 2048, 0, False, False),
    "qwen35.router+norm": (256, 2048, 2, False, False),
    "qwen35.shared_gate_up+silu": (1024, 2048, 0, True, False),
    "qwen35.shared_down": (2048, 512, 0, False, False),
    # GatedDeltaNet's 16-bit b|a beside a quantized qkv|z (FP8 and NVFP4 checkpoints).
    "qwen35.gdn_ba": (64, 2048, 0, False, False),
}
STORES_NORMED = {"qwen35.router+norm"}
"""Shapes whose fused launch also stores the normalised input (`gemv.linear(normed=)`: the
MoE block's router, whose experts take the same input); unfused, the RMSNorm's output is
that input."""
L2_BYTES = 60 * 2**20
SWEEP = dict(block_n=(16, 32), block_k=(128, 256), num_warps=(4,), num_stages=(4,),
             split=(1, 2, 4, 8))
# the row kernel (`gemv_rows_jit`), swept at one token: its programs take one token each
ROW_SWEEP = dict(block_n=(1, 2, 4), block_k=(512, 1024, 2048, 4096), num_warps=(4, 8),
                 num_stages=(1, 2), split=(1, 2))
ROW_SWEEP_TOKENS = 1



def make_case(name: str, tokens: int, gen: torch.Generator):
    """Inputs of one shape: x, weight copies, norm, residual (bf16 on the GPU)."""
    rows, k, norm, gated, residual = SHAPES[name]
    n = rows // 2 if gated else rows
    copies = max(2, -(-2 * L2_BYTES // (rows * k * 2)))
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    weights = [torch.randn(rows, k, **kw) * k**-0.5 for _ in range(min(copies, 160))]
    x = torch.randn(tokens, k, **kw)
    fused_norm = gemv.Norm(torch.randn(k, **kw) * 0.3, 1e-6, norm == 2) if norm else None
    res = torch.randn(tokens, n, **kw) if residual else None
    fused = dict(norm=fused_norm, gated=gated, residual=res)
    if name in STORES_NORMED:
        fused["normed"] = torch.empty_like(x)
    return x, weights, fused


def unfused(x, w, norm=None, gated=False, residual=None, normed=None):
    """What the engine's CUDA path launched before: RMSNorm kernel, GEMM, SiLU-and-mul
    kernel, add (the RMSNorm's output is what `normed` would hold)."""
    if norm is not None:
        x = norm_rope.rms_norm(x, norm.weight, norm.eps, norm.offset)
    y = F.linear(x, w)
    if gated:
        y = norm_rope.silu_and_mul(y)
    return y if residual is None else residual + y


def graph_equals_eager(fn) -> bool:
    eager = fn()
    graph, out = torch.cuda.CUDAGraph(), None
    fn()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, eager)


def _candidates(sweep: str, tokens: int):
    """The tiles a sweep times: the 16-token dot tiles (`dot`), the row kernel's at one
    token (`rows`), or both (`all`)."""
    if sweep in ("all", "dot"):
        yield from (gemv.GemvTiles(*v) for v in itertools.product(*SWEEP.values()))
    if sweep in ("all", "rows") and tokens <= ROW_SWEEP_TOKENS:
        yield from (gemv.GemvTiles(*v, rows=True) for v in itertools.product(*ROW_SWEEP.values()))


def bench_shape(name, tokens, copy_gbs, sweep, gen):
    """One shape's row: error, graph equality and time of the shipped table's tiles (with
    `sweep`: of the fastest choice), against the unfused launches."""
    x, weights, fused = make_case(name, tokens, gen)
    w = weights[0]
    rows, in_features, norm, gated, residual = SHAPES[name]
    looked_up = {k: v for k, v in fused.items() if k != "normed"}  # what tiles_for takes
    tiles = (gemv.tiles_for(x, w, **looked_up)
             or gemv.choose_tiles(rows // 2 if gated else rows, in_features, x.dtype))
    t_old = graph_us([lambda w=w: unfused(x, w, **fused) for w in weights])
    t_fused = graph_us([lambda w=w: gemv.linear(x, w, **fused, tiles=tiles) for w in weights])
    choice, best_us = tiles, t_fused
    if sweep:
        for t in _candidates(sweep, tokens):
            if t.block_k * t.split > in_features:
                continue
            try:
                us = graph_us([lambda w=w, t=t: gemv.linear(x, w, **fused, tiles=t)
                               for w in weights], replays=3)
            except OutOfResources as err:
                print(f"{name} T={tokens} tiles {t.key()}: skipped ({err})", file=sys.stderr)
                continue
            if us < best_us:
                choice, best_us = t, us
    got = gemv.linear(x, w, **fused, tiles=choice)
    want = gemv.reference_linear(x, w, **looked_up)
    err = rel_l2(got, want)
    if "normed" in fused:   # the stored input, too
        err = max(err, rel_l2(fused["normed"], gemv.reference_norm(x, fused["norm"])))
    key = gemv.table_key(rows, in_features, tokens, norm > 0, gated, residual)
    return dict(name=name, tokens=tokens, MB=w.numel() * 2 / 1e6, rel_l2=err,
                graph_eq=graph_equals_eager(lambda: gemv.linear(x, w, **fused, tiles=choice)),
                old_us=t_old, default_us=t_fused, best_us=best_us,
                pct_copy=100 * w.numel() * 2 / (min(best_us, t_old) * 1e-6) / (copy_gbs * 1e9),
                tiles=choice.key(), key=key,
                choice="gemm" if sweep and t_old < best_us else choice.key())


def bench_combine(tokens, copy_gbs, gen):
    hidden, top_k = 2048, 8
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randn(tokens, top_k, hidden, device="cuda", generator=gen)
    x = torch.randn(tokens, hidden, **kw)
    gate_w = torch.randn(1, hidden, **kw) * hidden**-0.5
    shared = torch.randn(tokens, hidden, **kw)
    got = gemv.moe_combine(slots, x, gate_w, shared)
    want = gemv.reference_moe_combine(slots, x, gate_w, shared)
    calls = 32
    fused_us = graph_us([lambda: gemv.moe_combine(slots, x, gate_w, shared)] * calls)
    return dict(name="qwen35.moe_combine", tokens=tokens, MB=slots.numel() * 4 / 1e6,
                rel_l2=rel_l2(got, want),
                graph_eq=graph_equals_eager(lambda: gemv.moe_combine(slots, x, gate_w, shared)),
                old_us=graph_us([lambda: gemv.reference_moe_combine(slots, x, gate_w, shared)]
                                * calls),
                default_us=fused_us, best_us=fused_us, pct_copy=float("nan"), tiles="-",
                key="-", choice="-")


def bench_route(tokens, gen):
    """The routing launch (softmax, top-8 of 256, renormalised) at each warp count of one
    program per token, against the torch steps it replaces; ids must equal torch's."""
    from freetoken.kernels import fused_moe
    from freetoken.layers.moe import route as torch_route

    experts, top_k = 256, 8
    # float32 logits: bf16 ones tie often enough that torch's order among equals could differ
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    want_w, want_ids = torch_route(logits, top_k, True, torch.bfloat16)
    calls, shipped, times, err, same = 32, fused_moe.ROUTE_WARPS, {}, 0.0, True
    try:
        for warps in (1, 2, 4, 8):
            fused_moe.ROUTE_WARPS = warps
            w, ids = fused_moe.route(logits, top_k, True, torch.bfloat16)
            err, same = max(err, rel_l2(w, want_w)), same and torch.equal(ids, want_ids)
            times[warps] = graph_us([lambda: fused_moe.route(logits, top_k, True,
                                                             torch.bfloat16)] * calls)
        fused_moe.ROUTE_WARPS = shipped
        graph_eq = graph_equals_eager(lambda: fused_moe.route(logits, top_k, True,
                                                              torch.bfloat16)[0])
    finally:
        fused_moe.ROUTE_WARPS = shipped
    best = min(times, key=times.get)
    return dict(name="qwen35.route", tokens=tokens, MB=logits.numel() * 4 / 1e6,
                rel_l2=err if same else float("inf"), graph_eq=graph_eq,
                old_us=graph_us([lambda: torch_route(logits, top_k, True, torch.bfloat16)]
                                * calls),
                default_us=times[shipped], best_us=times[best], pct_copy=float("nan"),
                tiles=" ".join(f"{w}w:{t:.2f}" for w, t in times.items()), key="-",
                choice=f"{best} warps")


ATTENTION = dict(heads=16, kv_heads=4, head_dim=64, block=16, theta=10000.0)
"""The medium Llama's attention (`engine_decode.py --size medium`)."""
ATTENTION_CONTEXTS = (96, 1024, 4096)


def _attention_arms():
    """(label, `paged_attention.DecodeLaunch`) of each timed arm; the first is the shipped
    one, the second the launch before its options (`paged_attention.BEFORE`)."""
    from freetoken.kernels.paged_attention import BEFORE, DECODE

    return (("shipped", DECODE), ("before", BEFORE),
            ("4 warps", replace(DECODE, num_warps=4)),
            ("no splits", replace(DECODE, splits=1)),
            ("splits 16/128", replace(DECODE, splits=16, split_min=128)),
            ("4 warps splits 16/128", replace(DECODE, num_warps=4, splits=16, split_min=128)),
            ("stages 3", replace(DECODE, stages=3)))


ATTENTION_POINTERS = {
    **{p: "*bf16" for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_new_ptr",
                            "v_new_ptr")},
    **{p: "*i32" for p in ("block_tables_ptr", "query_starts_ptr", "context_lens_ptr",
                           "work_ptr", "counter_ptr")},
    "positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "inv_freq_ptr": "*fp32",
    "partial_ptr": "*fp32", "scale": "fp32"}
"""The attention kernel's argument types at `ATTENTION` in bf16 (the integers are i32)."""


def attention_asm(launch, decode: bool, arch: int = 90):
    """The attention kernel as `paged_attention` launches it at `ATTENTION` (decode with the
    folded rotary, or prefill) under `launch` (a `paged_attention.DecodeLaunch`), compiled
    by Triton for sm_`arch` without a GPU (`nvfp4_sass.compile_kernel`; pointers, head and
    slot strides divisible by 16, as Triton specialises them at these dimensions)."""
    import nvfp4_sass

    from freetoken.kernels import attention_jit, next_pow2
    from freetoken.kernels import paged_attention as pa

    heads, kv, dim = (ATTENTION[k] for k in ("heads", "kv_heads", "head_dim"))
    meta = pa._decode_args(decode, launch)
    meta.update(GROUP=heads // kv, HEAD_DIM=dim, BLOCK_D=max(16, next_pow2(dim)),
                BLOCK_M=pa.rows_per_program(heads, kv, dim, decode),
                BLOCK_N=pa.block_n(dim, decode, launch), DECODE=decode, PRECISION="tf32")
    if decode:
        meta.update(ROPE=True, HALF=dim // 2)
    warps = meta.pop("num_warps")
    divisible = {*ATTENTION_POINTERS, "stride_q_token", "stride_q_head", "stride_cache_slot",
                 "stride_cache_head", "stride_out_token", "stride_out_head",
                 "stride_k_new_token", "stride_k_new_head", "stride_v_new_token",
                 "stride_v_new_head"} - {"scale"}
    return nvfp4_sass.compile_kernel(attention_jit.paged_attention_kernel, meta, warps, arch,
                                     pointers=ATTENTION_POINTERS, divisible=divisible)


def attention_case(tokens, context, gen, device="cuda", dtype=torch.bfloat16):
    """One decode step of `ATTENTION` at `context` positions (this step's included) for
    `tokens` sequences, their cache blocks shuffled: (copies of the (k, v) caches, the
    launch with the folded rotary `folded(k_cache, v_cache)`, the rotary launch followed by
    attention `unfolded(k_cache, v_cache)`, and the torch reference's output on the CPU in
    float32 for the first copy). Copies enough to fill twice the L2, at most 64."""
    from freetoken.kernels import paged_attention as pa
    from freetoken.kernels.norm_rope import rotary_
    from freetoken.layers.rotary import RotaryEmbedding

    heads, kv, dim, block = (ATTENTION[k] for k in ("heads", "kv_heads", "head_dim", "block"))
    per_seq = -(-context // block)
    kw = dict(device=device, dtype=dtype, generator=gen)
    cache_bytes = 2 * tokens * per_seq * block * kv * dim * dtype.itemsize
    copies = max(2, min(64, -(-2 * L2_BYTES // cache_bytes)))
    caches = [(torch.randn(tokens * per_seq, block, kv, dim, **kw),
               torch.randn(tokens * per_seq, block, kv, dim, **kw)) for _ in range(copies)]
    tables = torch.randperm(tokens * per_seq, device=device, generator=gen)
    tables = tables.view(tokens, per_seq).to(torch.int32)
    q, k, v = (torch.randn(tokens, n, dim, **kw) for n in (heads, kv, kv))
    positions = torch.full((tokens,), context - 1, dtype=torch.int64, device=device)
    slots = tables[:, (context - 1) // block].to(torch.int64) * block + (context - 1) % block
    starts = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    lens = torch.full((tokens,), context, dtype=torch.int32, device=device)
    rope = RotaryEmbedding(dim, dim, ATTENTION["theta"]).to(device)
    fold = pa.DecodeRope(positions, rope.inv_freq, k, v, slots)

    def folded(kc, vc):
        return pa.paged_attention(q, kc, vc, tables, starts, lens, dim**-0.5, None, fold)

    def unfolded(kc, vc):
        q2, _ = rotary_(q.clone(), k.clone(), positions, rope.inv_freq, dim, (v, kc, vc, slots))
        return pa.paged_attention(q2, kc, vc, tables, starts, lens, dim**-0.5)

    want, _, _ = pa.reference_decode_rope(rope, fold, q, *caches[0], tables.cpu().tolist(),
                                          [context] * tokens, dim**-0.5)
    return caches, folded, unfolded, want


def bench_attention(tokens, context, copy_gbs, gen):
    """The decode attention launch with its rotary and cache write (`DecodeRope`,
    `attention_case`) at each arm of `ATTENTION_ARMS`, against the rotary launch followed
    by attention (the engine's path before the fold); checked against the torch reference.
    Calls cycle through copies of the caches, as the linear rows do through copies of the
    weights."""
    from freetoken.kernels import paged_attention as pa

    caches, folded, unfolded, want = attention_case(tokens, context, gen)
    read_bytes = 2 * tokens * context * ATTENTION["kv_heads"] * ATTENTION["head_dim"] * 2
    shipped = pa.DECODE
    times, err, graph_eq = {}, 0.0, True
    try:
        for label, arm in _attention_arms():
            pa.DECODE = arm
            err = max(err, rel_l2(folded(*caches[0]).cpu(), want))
            graph_eq = graph_eq and graph_equals_eager(lambda: folded(*caches[0]))
            times[label] = graph_us([lambda c=c: folded(*c) for c in caches])
        pa.DECODE = shipped
        old_us = graph_us([lambda c=c: unfolded(*c) for c in caches])
    finally:
        pa.DECODE = shipped
    best = min(times, key=times.get)
    return dict(name=f"llama.attention ctx {context}", tokens=tokens, MB=read_bytes / 1e6,
                rel_l2=err, graph_eq=graph_eq, old_us=old_us, default_us=times["shipped"],
                best_us=times[best],
                pct_copy=100 * read_bytes / (times["shipped"] * 1e-6) / (copy_gbs * 1e9),
                tiles=" ".join(f"{a}:{t:.2f}" for a, t in times.items()), key="-",
                choice=best)


ROWS = (*SHAPES, "combine", "route", "attention")
"""The rows `--only` can name (all of them by default)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int_list, default=[1, 16])
    p.add_argument("--sweep", nargs="?", const="all", default=None,
                   choices=("all", "dot", "rows"),
                   help="time every tile choice: the dot tiles, the row kernel's (at one "
                        "token), or both (the default)")
    p.add_argument("--only", type=lambda t: t.split(","), default=None)
    p.add_argument("--write", type=Path, default=None,
                   help="with --sweep: write the chosen tiles as a JSON tile table (the "
                        "engine's table with the swept entries replaced)")
    args = p.parse_args()
    if args.write and not args.sweep:
        p.error("--write needs --sweep")
    only = args.only or ROWS
    unknown = set(only) - set(ROWS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))} (the shapes, combine, route, "
                f"attention)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    copy_gbs = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tokens in args.tokens:
        for name in only:
            if name in SHAPES:
                rows.append(bench_shape(name, tokens, copy_gbs, args.sweep, gen))
            elif name == "combine":
                rows.append(bench_combine(tokens, copy_gbs, gen))
            elif name == "route":
                rows.append(bench_route(tokens, gen))
            else:
                rows.extend(bench_attention(tokens, c, copy_gbs, gen)
                            for c in ATTENTION_CONTEXTS)
            print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth "
          f"{copy_gbs:.0f} GB/s; times per call in CUDA graphs, weights not in L2")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.write:
        table = dict(gemv._table())
        table.update({r["key"]: r["choice"] for r in rows if r["key"] != "-"})
        args.write.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"tile table ({len(table)} entries) written to {args.write}")
    bad = [r["name"] for r in rows if r["rel_l2"] > 1e-2 or not r["graph_eq"]]
    if bad:
        print(f"FAILED (rel L2 > 1e-2 or graph != eager): {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
