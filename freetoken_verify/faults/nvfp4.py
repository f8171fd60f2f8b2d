"""NVFP4 MoE bugs for `--fault`: the experts' global scales swapped at load, and the Triton
kernels' decode and scaling (`NVFP4_MOE_KERNEL_FAULTS`), each made by handing the kernels what
a kernel with the bug would compute from."""

from __future__ import annotations

import torch

from freetoken.kernels import nvfp4_linear, nvfp4_moe
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken_verify.faults._patch import after_load, wrap_arguments
from freetoken_verify.faults.registry import Entry, fault


@fault("nvfp4-load-globals-swapped",
       Entry("NVFP4 gate/up global scales swapped at load", "tiny-qwen3.5-moe-nvfp4", (1, 2),
             ("golden", "shards"), r"weight_scale_2", tp1_green=False))
def nvfp4_load_globals_swapped() -> None:
    """Loading NVFP4 experts puts each expert's up global scale (`weight_scale_2`) on its gate
    rows and the gate's on its up rows."""

    def patch(model, reader, plan):
        for module in model.modules():
            if isinstance(module, NVFP4FusedExperts):
                module.w13_weight_scale_2.data = module.w13_weight_scale_2.data.flip(1)

    after_load(patch)


def _swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return (packed << 4) | (packed >> 4)


@fault("nvfp4-nibble-swap",
       Entry("NVFP4 nibbles swapped", "tiny-llama", (1,), ("kernels",), r"kernel|nvfp4",
             tp1_green=False))
def nvfp4_nibble_swap() -> None:
    """The NVFP4 kernels unpack element 2j from the high nibble and 2j + 1 from the low one
    (ModelOpt stores the even element in the low nibble)."""

    wrap_arguments(nvfp4_moe, "fused_moe", lambda a: {"w13": _swap_nibbles(a["w13"]),
                                                      "w2": _swap_nibbles(a["w2"])})
    wrap_arguments(nvfp4_linear, "nvfp4_linear",
                   lambda a: {"packed": _swap_nibbles(a["packed"])})


@fault("nvfp4-drop-global-scale",
       Entry("NVFP4 down global scale dropped", "tiny-llama", (1,), ("kernels",), r"kernel|nvfp4",
             tp1_green=False))
def nvfp4_drop_global_scale() -> None:
    """The NVFP4 down projection forgets its per-expert global scale (`weight_scale_2`)."""
    wrap_arguments(nvfp4_moe, "fused_moe",
                   lambda a: {"w2_global": torch.ones_like(a["w2_global"])})


@fault("nvfp4-gate-up-globals-swapped",
       Entry("NVFP4 gate/up global scales swapped", "tiny-llama", (1,), ("kernels",),
             r"kernel|nvfp4", tp1_green=False))
def nvfp4_gate_up_globals_swapped() -> None:
    """The NVFP4 gate rows get the up projection's global scale and vice versa."""
    wrap_arguments(nvfp4_moe, "fused_moe", lambda a: {"w13_global": a["w13_global"].flip(-1)})


@fault("nvfp4-intermediate-off-by-group",
       Entry("NVFP4 intermediate size off by a group", "tiny-llama", (1,), ("kernels",),
             r"kernel|nvfp4", tp1_green=False))
def nvfp4_intermediate_off_by_group() -> None:
    """The NVFP4 kernels are told a TP-local intermediate size one 16-element group short:
    the up rows start 16 rows early and the last group of down's inputs is dropped."""

    nvfp4_moe._local_intermediate = lambda w13, w2: w13.shape[1] // 2 - 16


NVFP4_MOE_KERNEL_FAULTS = ("nvfp4-nibble-swap", "nvfp4-drop-global-scale",
                           "nvfp4-gate-up-globals-swapped", "nvfp4-intermediate-off-by-group")
"""The faults in the NVFP4 MoE Triton kernels' decode and scaling, which the kernels check's
NVFP4 matrix must catch on the GPU (`bench/gpu_kernels_check.py`); other `nvfp4-` faults are in
loading or in the torch quantized GEMMs."""
