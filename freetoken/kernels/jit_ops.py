"""Reductions, scans and the sigmoid for the engine's Triton kernels, built from Triton
builtins only. triton.language's own `sum`, `max`, `cumsum`, `sigmoid` and `zeros` are @jit
functions, and whether a @jit function is interpreted is fixed when its module is imported:
triton may have been imported (by transformers, say) before TRITON_INTERPRET=1 was set. These
are re-imported with the kernel modules (`freetoken.kernels.use_interpreter`), and
`tl.reduce` / `tl.associative_scan` with triton's own combiners run in numpy there."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def max_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def min_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
