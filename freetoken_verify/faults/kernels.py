"""Bugs in the engine's CUDA fast paths, for `--fault` (registered in
`freetoken_verify.faults.FAULTS`):
each wraps a launcher of `freetoken.kernels` and hands its kernel what a launcher with the bug
would (a block table read with the wrong row stride, expert ids one off, the wrong state slot),
so the Triton kernels compute exactly what the buggy path computes. Arguments are found by
their position in the launcher's signature, not by name."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

from freetoken.kernels import delta_rule, fused_moe, paged_attention


def _wrap_argument(module, name: str, position: int,
                   transform: Callable[[torch.Tensor, list], torch.Tensor]) -> None:
    """Replace `module.name` by a launcher that passes its `position`-th argument through
    `transform(value, all arguments in order)`."""
    original = getattr(module, name)
    signature = inspect.signature(original)
    names = list(signature.parameters)

    def launcher(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [bound.arguments[n] for n in names]
        bound.arguments[names[position]] = transform(values[position], values)
        return original(*bound.args, **bound.kwargs)

    launcher.__wrapped__ = original
    setattr(module, name, launcher)


def _row_stride_off_by_one(table: torch.Tensor, args: list) -> torch.Tensor:
    """The same table storage with its row stride one element short: sequence i reads its
    blocks i entries early, from the end of the previous row."""
    rows, width = table.shape
    return table.contiguous().view(-1).as_strided((rows, width), (width - 1, 1))


def paged_attention_table_stride() -> None:
    """Paged attention reads the block table with a row stride one element short (as a
    launcher passing `stride(0) - 1`, or a table padded to one width and read at another):
    every sequence after the first reads some of its neighbour's cache blocks."""

    _wrap_argument(paged_attention, "paged_attention", 3, _row_stride_off_by_one)


def fused_moe_expert_offset() -> None:
    """The bf16 fused MoE adds one to every expert id before the grouped GEMMs (an expert
    offset off by one, as when a rank's first expert index is added twice): each (token,
    slot) pair multiplies the next expert's weights."""

    def shifted(ids, args):
        return (ids + 1) % args[3].shape[0]

    _wrap_argument(fused_moe, "fused_moe", 2, shifted)


def gdn_decode_state_slot() -> None:
    """GatedDeltaNet's fused decode step reads and writes the linear state of the slot after
    each sequence's own: every sequence continues another one's recurrence and overwrites
    it. Also where the GatedDeltaNet layer bound the launcher at import."""

    def next_slot(slots, args):
        return (slots + 1) % args[7].shape[0]

    _wrap_argument(delta_rule, "gated_delta_decode", 8, next_slot)
    gdn = sys.modules.get("freetoken.models.qwen3_5_moe.gdn")
    if gdn is not None:
        gdn.gated_delta_decode = delta_rule.gated_delta_decode


KERNEL_FAULTS: dict[str, Callable[[], None]] = {
    "paged-attention-table-stride": paged_attention_table_stride,
    "fused-moe-expert-offset": fused_moe_expert_offset,
    "gdn-decode-state-slot": gdn_decode_state_slot,
}
