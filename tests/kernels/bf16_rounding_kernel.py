"""A one-line kernel around `nvfp4_mma_ops_jit.bf16_bits` for its test; imported only after the
test switched the process to Triton's interpreter (the decorator picks the mode at import)."""

import triton
import triton.language as tl

from freetoken.kernels.nvfp4_mma_ops_jit import bf16_bits


@triton.jit
def bf16_bits_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, bf16_bits(tl.load(x_ptr + i)))
