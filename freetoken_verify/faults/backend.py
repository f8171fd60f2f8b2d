"""Bugs in the engine's torch NVFP4 backend (the CPU path and the kernels' former reference),
for `--fault` (registered in `freetoken_verify.faults.FAULTS`): the `kernels` check must blame the
backend for them, not the Triton kernels."""

from __future__ import annotations

import torch

from freetoken.formats.nvfp4 import format as nvfp4_format
from freetoken.layers.quantization.nvfp4 import reference
from freetoken_verify.faults.registry import Entry, fault


@fault("torch-nvfp4-nibble-swap",
       Entry("torch NVFP4 backend reads nibbles swapped", "tiny-llama", (1,), ("kernels",),
             r"torch NVFP4 backend disagrees", tp1_green=False))
def torch_nvfp4_nibble_swap() -> None:
    """The torch backend's dequantizer reads element 2j from the high nibble and 2j + 1 from
    the low one (ModelOpt stores the even element in the low nibble)."""

    original = nvfp4_format.unpack_nibbles
    nvfp4_format.unpack_nibbles = lambda packed: original((packed << 4) | (packed >> 4))


@fault("torch-nvfp4-drop-w13-global",
       Entry("torch NVFP4 backend drops the w13 global scale", "tiny-llama", (1,), ("kernels",),
             r"torch NVFP4 backend disagrees", tp1_green=False))
def torch_nvfp4_drop_w13_global() -> None:
    """The torch backend dequantizes each expert's gate|up without their global scales
    (`weight_scale_2`)."""

    original = reference.dequantize_w13
    reference.dequantize_w13 = lambda packed, block, glob: original(packed, block,
                                                                    torch.ones_like(glob))
