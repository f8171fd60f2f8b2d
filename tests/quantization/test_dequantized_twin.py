"""dequantize_module (freetoken.formats.quant.twin), the float64 dequantization a harness
builds a dequantized twin from: each format by its definition, both NVFP4 conventions (the
ModelOpt multiplier and compressed-tensors' divisor) giving the same weights, scalar scales
checked finite and positive, missing tensors named."""

from __future__ import annotations

import pytest
import torch

from freetoken.formats.fp8.block import quantize as fp8_quantize
from freetoken.formats.nvfp4.checkpoint import COMPRESSED_TENSORS, MODELOPT, to_checkpoint
from freetoken.formats.nvfp4.format import dequantize as nvfp4_dequantize
from freetoken.formats.nvfp4.quantizer import quantize as nvfp4_quantize
from freetoken.formats.quant import FP8_BLOCK, FP8_TENSOR, NVFP4, ModuleFormat, QuantConfigError
from freetoken.formats.quant.twin import dequantize_module

M = "model.layers.0.self_attn.o_proj"


def _suffixes(tensors: dict) -> dict:
    return {name.rpartition(".")[2]: t for name, t in tensors.items()}


def test_nvfp4_both_conventions_match_the_float32_reference():
    """ModelOpt (multiplier) and compressed-tensors (reciprocal, divides) forms of one NVFP4
    weight dequantize to the format's float32 reference within float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    weight = nvfp4_quantize(torch.randn(8, 64, generator=gen) * 3)
    want = nvfp4_dequantize(weight.packed, weight.block_scale, weight.global_scale).double()
    for producer in (MODELOPT, COMPRESSED_TENSORS):
        got = dequantize_module(ModuleFormat(NVFP4, producer),
                                _suffixes(to_checkpoint(weight, M, producer)), M)
        torch.testing.assert_close(got, want, rtol=2 ** -22, atol=0,
                                   msg=lambda m, p=producer: f"{p}: {m}")


def test_fp8_formats_follow_their_definition():
    """FP8 per tensor: code x the 0-d scale; FP8 block (HF naming, bf16 scale, partial
    blocks): code x its block's scale, exactly in float64."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(20, 12, generator=gen)
    codes = (w * 8).to(torch.float8_e4m3fn)
    got = dequantize_module(ModuleFormat(FP8_TENSOR, MODELOPT),
                            {"weight": codes, "weight_scale": torch.tensor(0.125),
                             "input_scale": torch.tensor(0.5)}, M)
    assert torch.equal(got, codes.double() * 0.125)
    block = (16, 8)
    codes, scale = fp8_quantize(w, block, torch.bfloat16)
    got = dequantize_module(ModuleFormat(FP8_BLOCK, "fp8", block),
                            {"weight": codes, "weight_scale_inv": scale}, M)
    rows, cols = torch.arange(20) // 16, torch.arange(12) // 8
    assert torch.equal(got, codes.double() * scale.double()[rows][:, cols])


def test_bad_scales_and_missing_tensors_are_named():
    """A NaN or negative scalar scale, an input scale of zero, and a missing scale tensor
    are refused naming the tensor."""
    fmt, codes = ModuleFormat(FP8_TENSOR, MODELOPT), torch.ones(2, 2).to(torch.float8_e4m3fn)
    for bad, label in ((float("nan"), "weight_scale"), (-1.0, "weight_scale")):
        with pytest.raises(QuantConfigError, match=rf"{M}.{label}: per-tensor scale"):
            dequantize_module(fmt, {"weight": codes, "weight_scale": torch.tensor(bad)}, M)
    with pytest.raises(QuantConfigError, match=rf"{M} input scale: per-tensor scale 0.0"):
        dequantize_module(fmt, {"weight": codes, "weight_scale": torch.tensor(1.0),
                                "input_scale": torch.tensor(0.0)}, M)
    with pytest.raises(QuantConfigError, match=rf"missing: {M}.weight_scale_inv"):
        dequantize_module(ModuleFormat(FP8_BLOCK, "fp8", (16, 16)), {"weight": codes}, M)


def test_e2m1_decoded_from_its_bits_is_the_format_table():
    """The twin's e2m1 decoding (sign, exponent, mantissa bits) gives the 16 values of the
    format's table, independently written."""
    from freetoken.formats.nvfp4.format import E2M1_VALUES
    from freetoken.formats.quant.dequantize import e2m1_values

    got = e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == list(E2M1_VALUES), got.tolist()
    assert torch.signbit(got[8]), "code 8 is -0"


def test_large_modules_dequantize_in_bands_to_the_same_weight(monkeypatch):
    """A module larger than CHUNK_BYTES is dequantized a band of rows at a time (block-FP8
    bands on block boundaries, partial last blocks included): the same float32 weight as in
    one piece, for each format; a scale with a row to spare is still refused, naming the
    module, though no band would read that row."""
    import freetoken.formats.quant.dequantize as dequantize

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(45, 64, generator=gen)
    codes, scale = fp8_quantize(w, (8, 24), torch.bfloat16)
    nvfp4 = _suffixes(to_checkpoint(nvfp4_quantize(w), M, COMPRESSED_TENSORS))
    cases = [(ModuleFormat(FP8_BLOCK, "fp8", (8, 24)),
              {"weight": codes, "weight_scale_inv": scale}),
             (ModuleFormat(FP8_BLOCK, COMPRESSED_TENSORS, (8, 24)),
              {"weight": codes, "weight_scale": scale.float()}),
             (ModuleFormat(FP8_TENSOR, MODELOPT),
              {"weight": codes, "weight_scale": torch.tensor(0.25)}),
             (ModuleFormat(NVFP4, COMPRESSED_TENSORS), nvfp4)]
    whole = [dequantize_module(fmt, parts, M).float() for fmt, parts in cases]
    monkeypatch.setattr(dequantize, "CHUNK_BYTES", 8 * 64 * 10)
    assert len(dequantize._bands(cases[0][0], 45, 64)) == 6
    for (fmt, parts), want in zip(cases, whole):
        got = dequantize.dequantized_weight(fmt, parts, M, torch.float32)
        assert torch.equal(got, want), fmt.describe()
    spare = torch.cat([scale, scale[-1:]])
    with pytest.raises(QuantConfigError, match=rf"{M}: block scale must be a float \[6, 3\]"):
        dequantize.dequantized_weight(cases[0][0], {"weight": codes, "weight_scale_inv": spare},
                                      M, torch.float32)
