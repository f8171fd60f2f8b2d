"""The `kernels` check's GPU matrix on one GPU, in bf16, as a table: one command to run on a GPU
machine, no rank group needed.

    python bench/gpu_kernels_check.py [--dtype bfloat16|float16|float32] [--quick] [--faults]
        [--fault NAME] [--kind moe|moe+shared|linear] [--json FILE]

Runs `freetoken_verify.checks.kernels.check.gpu_matrix()` (tokens {1, 7, 64, 300} x experts {8, 64}
x top-k {1, 2, 8} x H {2048, 1040} x TP-local I = 512 / tp for tp {1, 2, 4, 8}, plus dense linears
and the MoE block with its shared expert as one more slot and the residual at 1, 7 and 16 tokens)
through the same `run_matrix` the check uses, and prints every case with its path, error metrics and
status; first it compares the decode kernels' PTX word decode with the portable one bit for bit.
`--quick` takes every 8th case. `--faults` then re-runs the quick matrix once per NVFP4 kernel
fault, each in a fresh process (faults monkeypatch for good), and reports whether the check caught
it. Exit status 1 when a case fails or a fault goes undetected, 2 without CUDA. `--json FILE` writes
the metrics, the rows, the failures and the number of PTX decode mismatches.

The pass/fail gate is `tests/gpu/test_kernels_gpu.py` (pytest, marker `gpu`), which runs this
script in fresh processes and asserts on its JSON; this script stays the human-readable table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from freetoken.kernels import nvfp4_decode_jit  # noqa: E402
from freetoken_verify.checks.kernels.check import gpu_matrix, run_matrix, summarize  # noqa: E402
from freetoken_verify.checks.kernels.nvfp4_cases import KINDS  # noqa: E402
from freetoken_verify.faults import FAULTS, NVFP4_MOE_KERNEL_FAULTS  # noqa: E402

NVFP4_FAULTS = list(NVFP4_MOE_KERNEL_FAULTS)
DEVICE = "cuda:0"


def _path(label: str) -> str:
    from freetoken.kernels.nvfp4_launch import DECODE_MAX_TOKENS

    tokens = int(label.split("tokens=")[1].split()[0])
    return "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"


def _print_rows(rows: list[dict]) -> None:
    from tabulate import tabulate

    body = [[r["case"], _path(r["case"]), f"{r['max_abs']:.2e}", f"{r['rel_l2']:.2e}",
             f"{100.0 * r['within'] / max(r['numel'], 1):.2f}", f"{r['seconds']:.2f}",
             "FAIL" if r["failure"] else "ok"] for r in rows]
    print(tabulate(body, headers=["case", "path", "max_abs", "rel_l2", "% within", "s",
                                  "status"], tablefmt="simple", disable_numparse=True))


@triton.jit
def _word_tile_values(w_ptr, out_ptr, ROWS: tl.constexpr, KW: tl.constexpr, ASM: tl.constexpr):
    row = tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, KW)[None, :]
    b = tl.load(w_ptr + row * KW + col)
    t = nvfp4_decode_jit.word_tables(0, ROWS, KW)
    f = nvfp4_decode_jit.word_values(b, t, ASM)
    scale = 1.0 if ASM else nvfp4_decode_jit.FP4_UNBIAS   # the portable values are e2m1 * 2^-14
    base = out_ptr + row * (8 * KW) + 8 * col
    tl.store(base, f[0] * scale)
    tl.store(base + 1, f[1] * scale)
    tl.store(base + 2, f[2] * scale)
    tl.store(base + 3, f[3] * scale)
    tl.store(base + 4, f[4] * scale)
    tl.store(base + 5, f[5] * scale)
    tl.store(base + 6, f[6] * scale)
    tl.store(base + 7, f[7] * scale)


def ptx_dequant_mismatches() -> int:
    """How many values the PTX word decode gets different from the portable one bit for bit
    (signed zeros included), on words holding every nibble value at every position plus
    random words; 0 when they agree."""
    rows, kw = 32, 64
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31, (rows * kw,), generator=g, dtype=torch.int64)
    every = torch.tensor([sum(((v + 3 * j) % 16) << 4 * j for j in range(8)) for v in range(16)])
    words[:16] = every - (every >= 2**31).long() * 2**32
    w = words.to(torch.int32).view(rows, kw).to(DEVICE)
    want = torch.empty(rows, 8 * kw, dtype=torch.float32, device=DEVICE)
    got = torch.empty_like(want)
    _word_tile_values[(1,)](w, want, ROWS=rows, KW=kw, ASM=0)
    _word_tile_values[(1,)](w, got, ROWS=rows, KW=kw, ASM=1)
    bad = int((want.view(torch.int32) != got.view(torch.int32)).sum())
    print(f"PTX word decode: {bad} of {want.numel()} values differ from the portable path")
    return bad


def _run_faults(dtype: str) -> bool:
    """Each NVFP4 fault in its own process on the quick matrix; True when all were caught."""
    caught_all = True
    for name in NVFP4_FAULTS:
        proc = subprocess.run([sys.executable, __file__, "--quick", "--dtype", dtype,
                               "--fault", name], capture_output=True, text=True)
        failing = [line for line in proc.stdout.splitlines() if line.startswith("first failure")]
        caught = proc.returncode == 1 and bool(failing)
        caught_all &= caught
        detail = failing[0] if failing else (proc.stdout + proc.stderr).strip()[-300:]
        print(f"{name}: {'caught' if caught else 'NOT CAUGHT'} (exit {proc.returncode}); "
              f"{detail}")
    return caught_all


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="every 8th case only")
    p.add_argument("--kind", choices=KINDS, default=None,
                   help="only the cases of this kind")
    p.add_argument("--faults", action="store_true", help="also prove each NVFP4 fault fails")
    p.add_argument("--fault", "--inject", dest="inject", choices=NVFP4_FAULTS, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_kernels_check.py needs a CUDA GPU; on CPU run "
              "`freetoken-verify --checks kernels --model tiny-llama --tp 1`.", file=sys.stderr)
        return 2
    if args.inject:
        FAULTS[args.inject]()
    cases = [c for c in gpu_matrix() if args.kind in (None, c.kind)][:: 8 if args.quick else 1]
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; {len(cases)} cases in {args.dtype}"
          + (f"; injected {args.inject}" if args.inject else ""), flush=True)
    ptx_bad = None if args.inject else ptx_dequant_mismatches()
    rows = run_matrix(cases, torch.device(DEVICE), getattr(torch, args.dtype))
    _print_rows(rows)
    metrics, failures = summarize(rows)
    print(f"\n{metrics}")
    if failures:
        print(f"first failure: {failures[0]}")
    if args.json:
        args.json.write_text(json.dumps({"metrics": metrics, "rows": rows, "failures": failures,
                                         "ptx_mismatches": ptx_bad, "dtype": args.dtype},
                                        indent=2, default=str))
    ok = not failures and not ptx_bad
    if args.faults and not args.inject:
        ok &= _run_faults(args.dtype)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
