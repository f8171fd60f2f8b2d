"""The numeric environment the bundled cases are written in (`make golden`, `python -m
freetoken_verify.cases`), the same on every x86-64 CPU with AVX2.

Left to itself torch picks its kernels by the processor: its vectorised kernels by
instruction set (AVX-512 here, AVX2 there), MKL its GEMM code path, and oneDNN (bf16 / fp16
matmuls) AMX or AVX512-FP16 where present, which round differently. The weights and the
float32 reference logits moved by float32 rounding only, but the bf16 / fp16 baselines of
meta.json (how far HF at that dtype lands from float32) moved by up to 50x (fp16 max_abs
0.0153 on one CPU, 0.72 on one with AVX512-FP16), so `make golden` rewrote every meta.json on
another machine and the regeneration tests failed there. The writer therefore runs with
torch's AVX2 kernels, MKL's AVX2 code path (conditional numerical reproducibility) and oneDNN
switched off (`torch.backends.mkldnn`), so bf16 and fp16 go through torch's own kernels.
These variables must be set before torch is imported: `python -m freetoken_verify.cases`
sets them itself, and `pinned_env` gives them to a subprocess."""

from __future__ import annotations

import os

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pinned_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the writer's numeric settings."""
    return {**(os.environ if base is None else base), **PINNED}


def check_pinned(torch) -> str | None:
    """Switch oneDNN off in this process and say what, if anything, keeps it from the pinned
    numerics (torch imported before the variables were set, a CPU without AVX2); None when
    pinned."""
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        return (f"torch runs its {capability} kernels, not AVX2: cases written here may differ "
                "from the committed ones in float rounding")
    return None
