"""Triton kernel of the `tp_invariant` mode's GEMMs on the engine's CUDA path
(`freetoken.kernels.canonical_gemm`): out[c, m, n] = sum over k of chunk c of x[m, k] w[n, k],
accumulated in float32 over fixed K steps and stored once in out's dtype.

An output element's arithmetic depends only on its row of x, its row of w and the chunk's
length: the tile sizes, warps and stages are constants of the launcher, never chosen by
shape, so the element comes out the same bits however many rows, columns or chunks are in
the launch, which is what makes a rank's columns or chunks equal TP=1's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunked_gemm_kernel(
    # pointers
    x_ptr,                  # [rows, chunks * k_chunk]
    w_ptr,                  # [cols, chunks * k_chunk]
    out_ptr,                # [chunks, rows, cols]
    # sizes
    rows,
    cols,
    k_chunk,
    # strides
    stride_x_row,
    stride_w_row,
    stride_out_chunk,
    stride_out_row,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[c, m, n] for the BLOCK_M rows m of program_id(0), the BLOCK_N columns n of
    program_id(1) and chunk c = program_id(2)."""
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunk = tl.program_id(2).to(tl.int64)
    m_ok = ms < rows
    n_ok = ns < cols
    x = x_ptr + ms.to(tl.int64)[:, None] * stride_x_row + chunk * k_chunk
    w = w_ptr + ns.to(tl.int64)[None, :] * stride_w_row + chunk * k_chunk
    acc = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.float32)
    for k0 in range(0, k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_chunk
        a = tl.load(x + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = out_ptr + chunk * stride_out_chunk + ms.to(tl.int64)[:, None] * stride_out_row
    tl.store(out + ns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
