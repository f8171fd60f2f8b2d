"""The formats a linear module of a checkpoint can be stored in, and the tensors each one
writes per module (`M.<suffix>`), by producer:

- bf16 (unquantized), any producer: `weight` in the model dtype;
- NVFP4, ModelOpt: `weight` uint8 [out, in/2], `weight_scale` e4m3 [out, in/16],
  `weight_scale_2` (a multiplier), `input_scale`;
- NVFP4, compressed-tensors: `weight_packed`, `weight_scale`, `weight_global_scale` (a
  divisor), `input_global_scale`;
- FP8 per tensor, ModelOpt or compressed-tensors: `weight` e4m3 [out, in], 0-d
  `weight_scale` (a multiplier), `input_scale`;
- FP8 block, HF `fp8`: `weight` e4m3 [out, in], `weight_scale_inv` [ceil(out/B),
  ceil(in/B)] (a multiplier despite its name), and with `activation_scheme: static` a
  scalar `activation_scale`;
- FP8 block, compressed-tensors: `weight` e4m3, `weight_scale` (the same grid, a
  multiplier), and with static input activations a scalar `input_scale`.

Which FP8 modules store an input scale comes from the config (`static_inputs`; ModelOpt's
FP8 always does), never from the tensors present: the engine keeps them as float32
parameters, checked finite and above 0, unused by its weight-only GEMM. Input scales it does
not keep (NVFP4's, a dynamic-input FP8 module's) are checked the same way and dropped.

Every suffix maps onto a normalised field (`weight`, `weight_scale`, `weight_scale_2`,
`input_scale`), so the layers never see a producer's naming."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16, NVFP4, FP8_TENSOR, FP8_BLOCK = "bf16", "nvfp4", "fp8-tensor", "fp8-block"
KINDS = (BF16, NVFP4, FP8_TENSOR, FP8_BLOCK)
MODELOPT, COMPRESSED_TENSORS, HF_FP8 = "modelopt", "compressed-tensors", "fp8"

_SUFFIXES = {
    (NVFP4, MODELOPT): {"weight": "weight", "weight_scale": "weight_scale",
                        "weight_scale_2": "weight_scale_2", "input_scale": "input_scale"},
    (NVFP4, COMPRESSED_TENSORS): {"weight_packed": "weight", "weight_scale": "weight_scale",
                                  "weight_global_scale": "weight_scale_2",
                                  "input_global_scale": "input_scale"},
    (FP8_TENSOR, MODELOPT): {"weight": "weight", "weight_scale": "weight_scale",
                             "input_scale": "input_scale"},
    (FP8_TENSOR, COMPRESSED_TENSORS): {"weight": "weight", "weight_scale": "weight_scale",
                                       "input_scale": "input_scale"},
    (FP8_BLOCK, HF_FP8): {"weight": "weight", "weight_scale_inv": "weight_scale",
                          "activation_scale": "input_scale"},
    (FP8_BLOCK, COMPRESSED_TENSORS): {"weight": "weight", "weight_scale": "weight_scale",
                                      "input_scale": "input_scale"},
}
_NAMES = {BF16: "bf16 (unquantized)", NVFP4: "NVFP4", FP8_TENSOR: "FP8 per-tensor",
          FP8_BLOCK: "FP8 block"}
_WEIGHT_DTYPES = {NVFP4: (torch.uint8,), FP8_TENSOR: (torch.float8_e4m3fn,),
                  FP8_BLOCK: (torch.float8_e4m3fn,)}
QUANTIZED_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
"""Dtypes no unquantized weight has: a tensor in one of them is quantized data."""


class QuantConfigError(ValueError):
    """A quantization config FreeToken cannot read, or that does not fit the model; the
    message names the file, key or module."""


@dataclass(frozen=True)
class ModuleFormat:
    """One module's storage format: `kind` (bf16, nvfp4, fp8-tensor, fp8-block), the
    `producer` whose tensor naming it uses, for FP8 block the block shape (rows, inputs), and
    for FP8 whether the config declares static input activations (`static_inputs`: one
    stored input scale per module)."""

    kind: str = BF16
    producer: str = ""
    block: tuple[int, int] | None = None
    static_inputs: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise QuantConfigError(f"unknown module format {self.kind!r}; expected one of "
                                   f"{', '.join(KINDS)}")
        if self.kind != BF16 and (self.kind, self.producer) not in _SUFFIXES:
            raise QuantConfigError(f"{_NAMES[self.kind]} is not read from producer "
                                   f"{self.producer!r}")
        if (self.kind == FP8_BLOCK) != (self.block is not None):
            raise QuantConfigError(f"{_NAMES[self.kind]}: block shape {self.block!r} given "
                                   "wrongly (FP8 block needs one, other formats none)")
        if self.static_inputs and self.kind not in (FP8_TENSOR, FP8_BLOCK):
            raise QuantConfigError(f"{_NAMES[self.kind]}: static input scales are read for "
                                   "FP8 formats only")

    @property
    def quantized(self) -> bool:
        return self.kind != BF16

    @property
    def input_scales(self) -> bool:
        """True when each module stores a static input scale the engine loads (kept,
        checked, unused): FP8 with static input activations, ModelOpt's FP8 always."""
        return self.static_inputs or (self.kind == FP8_TENSOR and self.producer == MODELOPT)

    @property
    def global_scale_is_reciprocal(self) -> bool:
        """True when the stored global scale divides (compressed-tensors NVFP4)."""
        return self.kind == NVFP4 and self.producer == COMPRESSED_TENSORS

    def suffixes(self) -> dict[str, str]:
        """Checkpoint tensor suffix -> normalised field (`weight`, `weight_scale`, ...)."""
        if self.kind == BF16:
            return {"weight": "weight"}
        return dict(_SUFFIXES[(self.kind, self.producer)])

    def weight_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes this format stores its `weight` in (any float for bf16)."""
        return _WEIGHT_DTYPES.get(self.kind, ())

    def describe(self) -> str:
        """E.g. `FP8 block 128x128 (fp8)`, `NVFP4 (compressed-tensors)`."""
        if self.kind == BF16:
            return _NAMES[BF16]
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        inputs = ", static input scales" if self.static_inputs else ""
        return f"{_NAMES[self.kind]}{block} ({self.producer}{inputs})"


UNQUANTIZED = ModuleFormat()
