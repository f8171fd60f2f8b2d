"""Launchers of `step_io_jit`: a decode graph's input unpacking (one launch where torch
spent six copies) and its outputs, float32 logits and greedy tokens (two launches as
before, the argmax spread over the vocab: torch's is a one-block reduction, 10 us for 32000
logits on an H200). Checked against the torch steps they replace (`reference_unpack`,
`reference_float_argmax`)."""

from __future__ import annotations

import torch

from freetoken.kernels import jit_module, next_pow2

ARGMAX_BLOCK = 2048
"""Logits per program of the float-and-argmax kernel."""


def _jit():
    return jit_module("step_io_jit")


def unpack(staging: torch.Tensor, feedback: torch.Tensor, ids: torch.Tensor,
           positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
           seq_slots: torch.Tensor, tables: torch.Tensor) -> None:
    """Staging rows int64 [rows, 5 + width] (id, position, slot, context length, state slot,
    block table) into the static inputs: int64 [rows] ids, positions, slots and state slots,
    int32 [rows] context lengths, int32 [rows, width] block tables. An id -1 - j is token
    `feedback[j]` (int64, on the device: the previous step's greedy tokens)."""
    rows, width = staging.shape[0], staging.shape[1] - 5
    if tables.shape != (rows, width) or staging.dtype != torch.int64:
        raise ValueError(f"unpack: staging {staging.dtype} {tuple(staging.shape)} does not fit "
                         f"block tables {tuple(tables.shape)}")
    if feedback.dtype != torch.int64 or feedback.dim() != 1 or not feedback.numel():
        raise ValueError(f"unpack: feedback must be a non-empty int64 vector, got "
                         f"{feedback.dtype} {tuple(feedback.shape)}")
    if rows:
        _jit().unpack_kernel[(rows,)](
            staging_ptr=staging, feedback_ptr=feedback, ids_ptr=ids, positions_ptr=positions,
            slots_ptr=slots,
            context_lens_ptr=context_lens, seq_slots_ptr=seq_slots, tables_ptr=tables,
            width=width, stride_staging=staging.stride(0), stride_tables=tables.stride(0),
            BLOCK_W=min(1024, max(16, next_pow2(width))), num_warps=1)


def float_argmax(logits: torch.Tensor, greedy: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits.float(), logits.float().argmax(-1))` for logits [rows, vocab] (any float
    dtype, unit stride along the vocab): a new float32 tensor and int64 [rows] tokens, the
    first index of each row's largest value, a NaN counting as the largest. The tokens are
    written into `greedy` when given (int64 [rows], unit stride)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if greedy is None:
        greedy = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif greedy.shape != (rows,) or greedy.dtype != torch.int64 or greedy.stride(0) != 1:
        raise ValueError(f"float_argmax: greedy must be int64 [{rows}] with unit stride, got "
                         f"{greedy.dtype} {tuple(greedy.shape)}")
    if rows == 0 or vocab == 0:
        return out, greedy.zero_()
    block = min(ARGMAX_BLOCK, max(16, next_pow2(vocab)))
    blocks = -(-vocab // block)
    parts = dict(device=logits.device)
    part_nan = torch.empty(rows, blocks, dtype=torch.int32, **parts)
    part_max = torch.empty(rows, blocks, dtype=torch.float32, **parts)
    part_index = torch.empty(rows, blocks, dtype=torch.int64, **parts)
    _jit().float_argmax_kernel[(rows, blocks)](
        logits_ptr=logits, out_ptr=out, part_nan_ptr=part_nan, part_max_ptr=part_max,
        part_index_ptr=part_index, vocab=vocab, blocks=blocks,
        stride_logits=logits.stride(0), stride_out=out.stride(0), BLOCK=block, num_warps=4)
    _jit().argmax_finish_kernel[(rows,)](
        part_nan_ptr=part_nan, part_max_ptr=part_max, part_index_ptr=part_index,
        greedy_ptr=greedy, vocab=vocab, blocks=blocks, BLOCKS=max(16, next_pow2(blocks)),
        num_warps=1)
    return out, greedy


def reference_unpack(staging: torch.Tensor, feedback: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
    """The torch steps `unpack` replaces: ids, positions, slots, context lengths (int32),
    state slots, block tables (int32)."""
    ids = staging[:, 0]
    ids = torch.where(ids < 0, feedback[(-1 - ids).clamp(min=0)], ids)
    return (ids, staging[:, 1], staging[:, 2], staging[:, 3].to(torch.int32),
            staging[:, 4], staging[:, 5:].to(torch.int32))


def reference_float_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch steps `float_argmax` replaces."""
    out = logits.float()
    return out, out.argmax(dim=-1)
