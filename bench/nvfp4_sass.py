"""Instruction mix of the NVFP4 decode kernels' inner loop, compiled for a GPU architecture
without a GPU: registers, spills and SASS instructions per weight, as a table (the CUDA-core
kernels of float32 activations and the tensor-core kernels of 16-bit ones).

    python bench/nvfp4_sass.py [--arch 90] [--tp 1,8] [--tokens 1,16]

Method. For each (TP, tokens) the launcher's own tile choice (`decode_shape` with the GPU
tiles) at Qwen3.6-35B-A3B's expert dimensions (H=2048, I=512/tp, top-8) is compiled by
Triton for `--arch` (ptxas and cuobjdump come with the triton wheel), with the integer
arguments the launcher passes marked divisible by 16 as Triton's own specialisation would.
The loop is the longest backward branch of the SASS that multiplies (FFMA or HMMA);
`instr/weight` is its instruction count over the weights a thread handles per trip (three
K-steps per trip; a tensor-core lane holds 8 weights of each of two rows per word);
`smem` counts the loop's shared-memory loads and stores and `bar` its barriers (a layout
conversion Triton inserts: every warp of the program then waits for the others each trip,
which cost the tensor-core decode up to a third of its speed when it crept in). Counts, not
times: what a change to the decode arithmetic moves (docs/performance.md says where else the
time goes). `--maxnreg` caps gate_up_mma's registers (`Tiles.mma_maxnreg`).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import int_list  # noqa: E402

# Arguments the launcher passes as multiples of 16 at these dimensions (pointers from torch
# allocations, strides and word counts); Triton specialises them the same way at run time.
DIVISIBLE = {"x_ptr", "w_ptr", "w_scale_ptr", "h_ptr", "out_ptr", "intermediate", "k_words",
             "stride_x_token", "stride_x_nibble", "stride_h_nibble", "stride_w_expert",
             "stride_scale_expert", "stride_scale_row", "stride_h_pair", "stride_out_token",
             "n_rows", "x16_ptr", "h16_ptr", "stride_x16_token", "stride_h16_pair",
             "stride_w_row", "shared_w_ptr", "shared_w_scale_ptr", "residual_ptr",
             "stride_residual_token"}
POINTERS = {"x_ptr": "*fp32", "h_ptr": "*fp32", "topk_ids_ptr": "*i32",
            "topk_weights_ptr": "*bf16", "w_ptr": "*u8", "w_scale_ptr": "*u8",
            "gate_up_global_ptr": "*fp32", "down_global_ptr": "*fp32", "out_ptr": "*bf16",
            "x16_ptr": "*bf16", "h16_ptr": "*bf16", "out_scale_ptr": "*fp32",
            "shared_w_ptr": "*u8", "shared_w_scale_ptr": "*u8", "shared_global_ptr": "*fp32",
            "shared_down_global_ptr": "*fp32", "shared_gate_ptr": "*bf16",
            "residual_ptr": "*bf16"}


def compile_kernel(fn, constexprs: dict, num_warps: int, arch: int,
                   options: dict | None = None, pointers: dict | None = None,
                   divisible: set | None = None):
    """`fn` compiled by Triton for sm_`arch` (its `asm` holds the PTX and the cubin); every
    parameter not in `constexprs` is a runtime argument, except constexpr parameters with a
    default, which take it; `options`: launch options beside num_warps (the launcher's, e.g.
    `maxnreg`); `pointers` (name -> Triton type) and `divisible` (arguments a multiple of
    16) for another kernel than the NVFP4 ones (`POINTERS`, `DIVISIBLE`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    parameters = inspect.signature(fn.fn).parameters
    constexprs = {**{p: v.default for p, v in parameters.items()
                     if v.default is not inspect.Parameter.empty
                     and "constexpr" in str(v.annotation)}, **constexprs}
    pointers = POINTERS if pointers is None else pointers
    divisible = DIVISIBLE if divisible is None else divisible
    params = list(parameters)
    signature = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible if p in params}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, **(options or {})})


_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "int8": "i8",
                 "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1"}
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"})
"""Keyword arguments of a launch that are Triton's options, not kernel parameters."""


def compile_launch(fn, kwargs: dict, arch: int = 90):
    """@triton.jit `fn` compiled for sm_`arch` as a launch with keyword arguments `kwargs`
    (torch tensors on any device, Python numbers, constexprs, launch options) would compile
    it, specialised as Triton specialises at run time: tensors by their dtype and a pointer
    aligned to 16 bytes as divisible, an integer equal to 1 as a constant, other integers
    divisible by 16 as such; `launch_pdl` dropped (a launch option, not code)."""
    import torch

    parameters = inspect.signature(fn.fn).parameters
    unknown = set(kwargs) - set(parameters) - LAUNCH_OPTIONS
    if unknown:
        raise TypeError(f"{fn.fn.__name__} takes no argument {sorted(unknown)}")
    constexprs, pointers, divisible = {}, {}, set()
    for name, value in kwargs.items():
        if name in LAUNCH_OPTIONS:
            continue
        if "constexpr" in str(parameters[name].annotation):
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            pointers[name] = "*" + _TRITON_TYPES[str(value.dtype).removeprefix("torch.")]
            if value.data_ptr() % 16 == 0:
                divisible.add(name)
        elif value is None:
            constexprs[name] = None
        elif isinstance(value, bool):
            pointers[name] = "u1"
        elif isinstance(value, int):
            if value == 1:
                constexprs[name] = 1
            else:
                pointers[name] = "i64" if not -2**31 <= value < 2**31 else "i32"
                if value % 16 == 0:
                    divisible.add(name)
        elif isinstance(value, float):
            pointers[name] = "fp32"
        else:
            raise TypeError(f"{fn.fn.__name__}: argument {name} is a {type(value).__name__}")
    options = {k: kwargs[k] for k in ("num_stages", "num_ctas", "maxnreg") if k in kwargs}
    return compile_kernel(fn, constexprs, kwargs.get("num_warps", 4), arch, options,
                          pointers=pointers, divisible=divisible)


def compile_outcome(build) -> tuple[str, str]:
    """("ok", PTX) of `build()` (a `compile_kernel` or `compile_launch` call), or (the
    compiler's error, which names the kernel's line, "") where it refuses the kernel."""
    try:
        ptx = build().asm["ptx"]
    except Exception as err:   # the compiler's own exception types vary by Triton version
        return f"{type(err).__name__}: {err}"[:2000], ""
    return ("ok" if ".entry" in ptx else "no PTX entry"), ptx


def compile_sass(fn, constexprs: dict, num_warps: int, arch: int,
                 options: dict | None = None, **types) -> tuple[str, int, int]:
    """(SASS text, registers, spill bytes) of `fn` compiled for sm_`arch` (`types`: the
    `pointers` and `divisible` of `compile_kernel`)."""
    import triton

    kernel = compile_kernel(fn, constexprs, num_warps, arch, options, **types)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        info = subprocess.run([str(tools / "ptxas"), "-v", f"--gpu-name=sm_{arch}a", str(ptx),
                               "-o", os.devnull], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return sass, int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode counts of the dot-product loop: the longest backward-branch
    loop that multiplies (FFMA or HMMA)."""
    pattern = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
    ops = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
           if (m := pattern.match(line))]
    best, body = (0, -1), collections.Counter()
    for addr, op, line in ops:
        target = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", line)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            mix = collections.Counter(o for a, o, _ in ops if start <= a <= addr)
            if (mix["FFMA"] or mix["HMMA"]) and addr - start > best[1] - best[0]:
                best, body = (start, addr), mix
    return sum(body.values()), body


def _word_kernels(tiles, count: int, top_k: int, hidden: int, inter: int):
    """(name, kernel, constexprs, warps, rows, weights per thread per loop trip, launch
    options) of the CUDA-core decode kernels (float32 activations) as the launcher shapes
    them."""
    import torch

    from freetoken.kernels import nvfp4_decode_jit, nvfp4_launch

    x = torch.empty(0)   # only picks the decode mode, which is set to the GPU's below
    out = []
    for name, fn, units, n_rows, k_words, weights_per_row in (
            ("gate_up", nvfp4_decode_jit.gate_up_decode, count * top_k, inter, hidden // 8, 2),
            ("down", nvfp4_decode_jit.down_decode, count, hidden, inter // 8, 1)):
        block_n, meta = nvfp4_launch.decode_shape(units, n_rows, k_words, x, tiles)
        meta = {**meta, "ASM": 1, "VEC": 4}
        warps = meta.pop("num_warps")
        # three K-steps per trip; gate_up handles a gate and an up row per row
        weights = 3 * weights_per_row * block_n * meta["KW"] * 8 / (32 * warps)
        out.append((name, fn, meta, warps, block_n, weights, {}))
    return out


def _mma_kernels(tiles, count: int, top_k: int, hidden: int, inter: int, arch: int = 90,
                 shared: bool = False):
    """The same for the tensor-core decode kernels (16-bit activations): a lane handles rows g
    and g + 8 of its tile, 8 inputs per word, V words per step, three steps per trip. With
    programmatic dependent launch (PDL) where the launcher uses it (sm_90+); `shared`: with
    the shared expert as one more slot of every token, the residual in down, and globals
    that divide (compressed-tensors)."""
    from freetoken.kernels import nvfp4_mma_jit, nvfp4_mma_launch

    pdl = int(tiles.pdl and arch >= 90)
    walk = top_k + shared
    v, split, _, row_tiles = nvfp4_mma_launch.mma_shape(count * walk, inter, hidden, 1, tiles)
    vh, split_h, chunks_h, tiles_h = nvfp4_mma_launch.mma_shape(count, hidden, inter, walk,
                                                                tiles, tiles.mma_down_min_split)
    extra = {"SHARED": int(shared)}
    return [("gate_up_mma", nvfp4_mma_jit.gate_up_mma,
             dict(V=v, TILES=row_tiles, S=split, ASM=1,
                  FULL=nvfp4_mma_launch.mma_full(inter, hidden, 1, v, split, row_tiles),
                  BF16=1, PDL=pdl, RECIPROCAL=int(shared), SHARED_RECIPROCAL=int(shared),
                  **extra),
             split * row_tiles, 16 * row_tiles, 3 * 2 * 2 * v * 8,
             nvfp4_mma_launch.register_cap(tiles)),
            ("down_mma", nvfp4_mma_jit.down_mma,
             dict(V=vh, TILES=tiles_h, S=split_h, CHUNKS=chunks_h, ASM=1,
                  FULL=nvfp4_mma_launch.mma_full(hidden, inter, walk, vh, split_h, tiles_h),
                  BF16=1, PDL=pdl, RESIDUAL=int(shared), ALIGNED=int(shared), **extra),
             split_h * tiles_h, 16 * tiles_h, 3 * 2 * vh * 8, {})]


def rows(tps: list[int], tokens: list[int], arch: int, shared: bool = False,
         tiles=None) -> list[dict]:
    from freetoken.kernels import nvfp4_launch

    tiles = tiles or nvfp4_launch.GPU_TILES
    top_k, hidden, inter_full = 8, 2048, 512
    out = []
    for tp in tps:
        inter = inter_full // tp
        for count in tokens:
            for name, fn, meta, warps, n_rows, weights, options in (
                    _word_kernels(tiles, count, top_k, hidden, inter)
                    + _mma_kernels(tiles, count, top_k, hidden, inter, arch, shared)):
                sass, regs, spill = compile_sass(fn, meta, warps, arch, options)
                total, mix = loop_mix(sass)
                out.append({"tp": tp, "tokens": count, "kernel": name, "rows": n_rows,
                            "warps": warps, "regs": regs, "spill": spill, "loop instr": total,
                            "instr/weight": total / weights,
                            "smem": mix["LDS"] + mix["STS"], "bar": mix["BAR"],
                            "top ops": ", ".join(f"{op} {n}" for op, n in mix.most_common(6))})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--tp", type=int_list, default=[1, 8])
    p.add_argument("--tokens", type=int_list, default=[1, 16])
    p.add_argument("--shared", action="store_true",
                   help="the mma kernels with the shared expert as one more slot of every "
                        "token and the residual in down")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="register cap of gate_up_mma (`Tiles.mma_maxnreg`)")
    args = p.parse_args()
    # the decode PTX path is what a GPU runs: make sure the kernels are not interpreted
    os.environ.pop("TRITON_INTERPRET", None)
    import dataclasses

    from tabulate import tabulate

    from freetoken.kernels import nvfp4_launch

    try:
        tiles = dataclasses.replace(nvfp4_launch.GPU_TILES, mma_maxnreg=args.maxnreg)
    except ValueError as e:
        p.error(f"--maxnreg: {e}")
    table = rows(args.tp, args.tokens, args.arch, args.shared, tiles)
    print(f"sm_{args.arch}, triton {__import__('triton').__version__}, GPU tiles "
          f"(`nvfp4_launch.GPU_TILES`), E=256 top-8 H=2048 I=512/tp; gate_up / down: CUDA-core "
          f"kernels (float32 activations), *_mma: tensor-core kernels (16-bit activations)")
    print(tabulate([[r[k] if not isinstance(r[k], float) else f"{r[k]:.2f}" for k in r]
                    for r in table], headers=list(table[0]), tablefmt="simple",
                   disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
