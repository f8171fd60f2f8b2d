"""Bugs in the engine's CUDA fast paths, for `--fault` (registered in
`freetoken_verify.faults.FAULTS`):
each wraps a launcher of `freetoken.kernels` and hands its kernel what a launcher with the bug
would (a block table read with the wrong row stride, expert ids one off, the wrong state slot),
so the Triton kernels compute exactly what the buggy path computes. Arguments are found by
their position in the launcher's signature, not by name."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from freetoken.kernels import delta_rule, fused_moe, moe_rows, paged_attention
from freetoken_verify.faults._patch import wrap_arguments
from freetoken_verify.faults.registry import Entry, fault


def _wrap_argument(module, name: str, position: int,
                   transform: Callable[[torch.Tensor, list], torch.Tensor]) -> None:
    """Replace `module.name` by a launcher that passes its `position`-th argument through
    `transform(value, all arguments in order)`."""

    def change(arguments: dict) -> dict:
        names, values = list(arguments), list(arguments.values())
        return {names[position]: transform(values[position], values)}

    wrap_arguments(module, name, change)


def _row_stride_off_by_one(table: torch.Tensor, args: list) -> torch.Tensor:
    """The same table storage with its row stride one element short: sequence i reads its
    blocks i entries early, from the end of the previous row."""
    rows, width = table.shape
    return table.contiguous().view(-1).as_strided((rows, width), (width - 1, 1))


@fault("paged-attention-table-stride",
       Entry("paged attention reads the block table with a wrong row stride", "tiny-llama", (1,),
             ("kernels",),
             r"engine kernels .*paged_attention tp=\d \((decode|prefill), heads \d+, kv heads",
             tp1_green=False))
def paged_attention_table_stride() -> None:
    """Paged attention reads the block table with a row stride one element short (as a
    launcher passing `stride(0) - 1`, or a table padded to one width and read at another):
    every sequence after the first reads some of its neighbour's cache blocks."""

    _wrap_argument(paged_attention, "paged_attention", 3, _row_stride_off_by_one)


@fault("decode-rope-next-position",
       Entry("decode attention rotates q and the new key by the next position", "tiny-llama",
             (1,), ("kernels",), r"engine kernels .*decode_rope tp=\d \(heads \d+, kv heads",
             tp1_green=False))
def decode_rope_next_position() -> None:
    """The decode attention launch that folds in the rotary rotates q and this step's key by
    the position after the token's own (as a launcher passing the context length where the
    last position belongs): every cached key is then rotated one step off from its query."""

    def next_position(rope, args):
        if rope is None:
            return rope
        return dataclasses.replace(rope, positions=rope.positions + 1)

    _wrap_argument(paged_attention, "paged_attention", 8, next_position)


@fault("decode-qk-norm-swapped",
       Entry("decode attention normalises q with k_norm's weight and k with q_norm's",
             "tiny-qwen3", (1,), ("kernels",),
             r"engine kernels .*decode_rope tp=\d \(heads \d+, kv heads .*qk_norm (w|1 \+ w)",
             tp1_green=False))
def decode_qk_norm_swapped() -> None:
    """The decode attention launch that folds in the per-head q/k RMSNorm is handed the two
    weights the wrong way round (as a launcher building its `QKNorm` from k_norm, then
    q_norm): q and this step's key are each scaled by the other's weight."""

    def swapped(rope, args):
        if rope is None or rope.norm is None:
            return rope
        norm = dataclasses.replace(rope.norm, q_weight=rope.norm.k_weight,
                                   k_weight=rope.norm.q_weight)
        return dataclasses.replace(rope, norm=norm)

    _wrap_argument(paged_attention, "paged_attention", 8, swapped)


@fault("decode-attention-gate-dropped",
       Entry("gated decode attention stored without its sigmoid output gate",
             "tiny-qwen3.5-moe", (1,), ("kernels",),
             r"engine kernels .*decode_rope tp=\d \(heads \d+, kv heads .*, gate\)",
             tp1_green=False))
def decode_attention_gate_dropped() -> None:
    """Qwen3.5's decode attention launch that folds in the output gate is not handed the
    gate (as a launcher that folds it and forgets to pass it on): its rows come out without
    `sigmoid(gate)`, and no later step multiplies them by it."""

    _wrap_argument(paged_attention, "paged_attention", 9, lambda gate, args: None)


@fault("fused-moe-expert-offset",
       Entry("bf16 fused MoE multiplies the next expert's weights", "tiny-llama", (1,),
             ("kernels",), r"engine kernels .*fused_moe tp=\d \(experts \d+, top_k",
             tp1_green=False))
def fused_moe_expert_offset() -> None:
    """The bf16 fused MoE adds one to every expert id before the grouped GEMMs (an expert
    offset off by one, as when a rank's first expert index is added twice): each (token,
    slot) pair multiplies the next expert's weights."""

    def shifted(ids, args):
        return (ids + 1) % args[3].shape[0]

    _wrap_argument(fused_moe, "fused_moe", 2, shifted)


@fault("moe-shared-gate-dropped",
       Entry("one token's shared expert added without its sigmoid gate", "tiny-llama", (1,),
             ("kernels",), r"engine kernels .*fused_moe_shared tp=\d \(experts \d+, top_k",
             tp1_green=False))
def moe_shared_gate_dropped() -> None:
    """The row kernels' down launch adds the shared expert with a gate of one instead of
    sigmoid(x . w_gate) (the gate computed but its buffer not passed on, as in ports that
    forget `shared_expert_gate`): every output gains the ungated half of the shared
    expert."""

    def ungated(hidden_rows, args):
        if hidden_rows.gate is None:
            return hidden_rows
        return dataclasses.replace(hidden_rows, gate=torch.ones_like(hidden_rows.gate))

    _wrap_argument(moe_rows, "down", 0, ungated)


@fault("moe-residual-dropped",
       Entry("one token's MoE block output stored without the decoder layer's residual",
             "tiny-llama", (1,), ("kernels",),
             r"engine kernels .*fused_moe_shared tp=\d .*output \+ residual", tp1_green=False))
def moe_residual_dropped() -> None:
    """The row kernels' down launch is given the residual but stores the block's output
    alone (the add skipped, as when a fused epilogue's flag is not passed on): the decoder
    layer's residual stream is replaced by the MoE output at every batch-1 decode step."""

    def dropped(residual, args):
        return None

    _wrap_argument(moe_rows, "down", 10, dropped)


@fault("moe-shared-fp8-unscaled",
       Entry("one token's block-FP8 shared expert reads its gate/up codes without their scales",
             "tiny-llama", (1,), ("kernels",),
             r"engine kernels .*fused_moe_shared tp=\d .*block FP8 output \+ residual",
             tp1_green=False))
def moe_shared_fp8_unscaled() -> None:
    """The row kernels' gate/up launch is given a block-FP8 shared expert whose block scales
    are all one (the codes taken for the values, as when the shared slot keeps the routed
    experts' 16-bit path): every batch-1 MoE output of a block-FP8 checkpoint gains a wrong
    shared expert."""

    def unscaled(shared, args):
        if shared is None or not shared.fp8:
            return shared
        return dataclasses.replace(shared, w13_scale=torch.ones_like(shared.w13_scale))

    _wrap_argument(moe_rows, "gate_up", 6, unscaled)


@fault("gdn-decode-state-slot",
       Entry("GatedDeltaNet decode kernel on the wrong state slot", "tiny-llama", (1,),
             ("kernels",),
             r"engine kernels .*gated_delta_decode tp=\d \(key heads \d+, value heads",
             tp1_green=False))
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
