"""Read bandwidth of the shapes a decode kernel's weight loads can take, without any decode: how
many rows one warp load touches and how many bytes of each, as a table against the GPU's
copy bandwidth.

    python bench/load_pattern.py [--mib 512] [--row-bytes 1024] [--reps 20]

Method. A weight matrix of `--mib` MiB (rows of `--row-bytes` bytes, so it outgrows L2) is read
once per run by single-warp programs of R consecutive rows each; a step loads an [R, B]
tile (B bytes of each row, the warp's threads along the row first: 16 bytes each, so one warp
load touches 512 / B rows), XORs it into a register tile, and the program walks its rows from
start to end. The NVFP4 tensor-core decode reads 16 rows x 64 bytes per warp load (two
loads per step for gate and up); the other shapes say whether a different lane-to-row mapping
would read faster. Times are CUDA-event medians; `% copy` is against a 1 GiB device-to-device
copy (read + write bytes per second) measured in the same run. A pattern only, not a kernel:
the decode kernels also keep loads in flight across steps and spend issue slots on decode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench._common import copy_bandwidth, time_ms  # noqa: E402

# (rows per program, bytes of each row per step): the mma decode's shape first
SHAPES = [(16, 64), (16, 128), (8, 128), (32, 64), (16, 32), (4, 256), (2, 512), (1, 1024)]


@triton.jit
def _stream(w_ptr, out_ptr, row_words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    base = w_ptr + rows[:, None] * row_words + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    for k in range(0, row_words, WORDS):
        acc ^= tl.load(base + k)
    # one word per program, so that nothing is optimised away
    tl.store(out_ptr + pid, tl.reduce(tl.reshape(acc, (ROWS * WORDS,)), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def _launcher(w: torch.Tensor, row_words: int, programs: int, per_program: int, words: int):
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    return lambda: _stream[(programs,)](w, out, row_words, ROWS=per_program, WORDS=words,
                                        num_warps=1, num_stages=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="matrix size (MiB), above L2")
    p.add_argument("--row-bytes", type=int, default=1024, help="bytes per row (gate_up: 1024)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/load_pattern.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    if args.row_bytes % 1024 and 1024 % args.row_bytes:
        print(f"--row-bytes {args.row_bytes}: use a power of two", file=sys.stderr)
        return 2
    from tabulate import tabulate

    nbytes = args.mib << 20
    copy_gbs = copy_bandwidth(nbytes, args.reps)
    w = torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    row_words = args.row_bytes // 4
    rows = w.numel() // row_words
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB;"
          f" triton {triton.__version__}; {args.mib} MiB in rows of {args.row_bytes} bytes; "
          f"copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    body = []
    for per_program, step_bytes in SHAPES:
        words = step_bytes // 4
        if words > row_words or rows % per_program:
            continue
        ms = time_ms(_launcher(w, row_words, rows // per_program, per_program, words),
                        args.reps)
        gbs = nbytes / ms / 1e6
        body.append([per_program, step_bytes, max(1, 512 // step_bytes),
                     per_program * step_bytes, f"{ms * 1e3:.1f}", f"{gbs:.0f}",
                     f"{100 * gbs / copy_gbs:.1f}"])
    print(tabulate(body, headers=["rows/program", "bytes/row/step", "rows/warp load",
                                  "bytes/step", "us", "GB/s", "% copy"],
                   tablefmt="simple", disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
