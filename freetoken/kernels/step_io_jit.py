"""Triton kernels at the two ends of a decode graph (`freetoken.kernels.step_io`), each one
launch where torch spends several:

- `unpack_kernel`: program b copies staging row b (int64: token id, position, cache slot,
  context length, state slot, then the block table) into the layers' six static inputs,
  casting the context length and the block table to int32. A negative id -1 - j stands for
  a token the host has not seen yet: row j of `feedback`, the previous step's greedy tokens
  (an overlapped step's input, fed back on the device).
- `float_argmax_kernel` + `argmax_finish_kernel`: the logits [batch, vocab] in float32 (a
  copy in the activations' dtype cast up, as `.float()`) and their greedy token, as
  `torch.argmax` picks it: the first index of the largest value, a NaN counting as larger
  than anything (the first NaN wins). Program (row, block) writes its block's float32
  values and its candidate (any NaN, largest value, first index of it); the finishing
  program of each row picks among its blocks' candidates.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import jit_ops as ops


@triton.jit
def unpack_kernel(
    # pointers
    staging_ptr,        # [rows, 5 + width] int64
    feedback_ptr,       # [>= rows of the previous step] int64
    ids_ptr,            # [rows] int64
    positions_ptr,      # [rows] int64
    slots_ptr,          # [rows] int64
    context_lens_ptr,   # [rows] int32
    seq_slots_ptr,      # [rows] int64
    tables_ptr,         # [rows, width] int32
    # sizes
    width,
    # strides
    stride_staging,
    stride_tables,
    # meta
    BLOCK_W: tl.constexpr,
):
    """Staging row program_id(0) into the static inputs."""
    row = tl.program_id(0).to(tl.int64)
    src = staging_ptr + row * stride_staging
    token = tl.load(src)
    fed = tl.load(feedback_ptr + tl.maximum(-1 - token, 0))
    tl.store(ids_ptr + row, tl.where(token < 0, fed, token))
    tl.store(positions_ptr + row, tl.load(src + 1))
    tl.store(slots_ptr + row, tl.load(src + 2))
    tl.store(context_lens_ptr + row, tl.load(src + 3).to(tl.int32))
    tl.store(seq_slots_ptr + row, tl.load(src + 4))
    for w0 in range(0, width, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        ok = cols < width
        table = tl.load(src + 5 + cols, mask=ok, other=0)
        tl.store(tables_ptr + row * stride_tables + cols, table.to(tl.int32), mask=ok)


@triton.jit
def float_argmax_kernel(
    # pointers
    logits_ptr,         # [rows, vocab] activations' dtype
    out_ptr,            # [rows, vocab] float32
    part_nan_ptr,       # [rows, blocks] int32
    part_max_ptr,       # [rows, blocks] float32
    part_index_ptr,     # [rows, blocks] int64
    # sizes
    vocab,
    blocks,
    # strides
    stride_logits,
    stride_out,
    # meta
    BLOCK: tl.constexpr,
):
    """Block program_id(1) of row program_id(0): its float32 values and its candidate."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    v = tl.load(logits_ptr + row * stride_logits + cols, mask=ok,
                other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, v, mask=ok)
    nan = (v != v) & ok
    any_nan = ops.max_(nan.to(tl.int32), axis=0)
    key = tl.where(nan, float("-inf"), v)
    largest = ops.max_(key, axis=0)
    pick = tl.where(any_nan > 0, nan, (key == largest) & ok)
    index = ops.min_(tl.where(pick, cols, vocab), axis=0)
    at = row * blocks + block
    tl.store(part_nan_ptr + at, any_nan)
    tl.store(part_max_ptr + at, largest)
    tl.store(part_index_ptr + at, index.to(tl.int64))


@triton.jit
def argmax_finish_kernel(
    # pointers
    part_nan_ptr,
    part_max_ptr,
    part_index_ptr,
    greedy_ptr,         # [rows] int64
    # sizes
    vocab,
    blocks,
    # meta
    BLOCKS: tl.constexpr,
):
    """Row program_id(0)'s token from its blocks' candidates: the first block holding a NaN,
    else the first block holding the largest value (each block's index is its first)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    ok = b < blocks
    nan = tl.load(part_nan_ptr + row * blocks + b, mask=ok, other=0)
    largest = tl.load(part_max_ptr + row * blocks + b, mask=ok, other=float("-inf"))
    index = tl.load(part_index_ptr + row * blocks + b, mask=ok, other=vocab)
    top = ops.max_(largest, axis=0)
    pick = tl.where(ops.max_(nan, axis=0) > 0, nan > 0, (largest == top) & ok)
    tl.store(greedy_ptr + row, ops.min_(tl.where(pick, index, vocab), axis=0))
