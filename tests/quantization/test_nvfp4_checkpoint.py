"""NVFP4 checkpoints (freetoken.formats.nvfp4.checkpoint): ModelOpt and
compressed-tensors forms of the same weights normalise to the same tensors and dequantize
identically up to the one rounding of CT's reciprocal global scale; a broken tensor is refused
naming it. (Which modules are NVFP4 is `tests/quantization/test_quant_config.py`'s.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.formats.nvfp4.checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4ConfigError,
    canonical_field,
    read_nvfp4_weight,
    to_checkpoint,
)
from freetoken.formats.nvfp4.format import dequantize
from freetoken.formats.nvfp4.quantizer import quantize

MODULE = "model.layers.3.mlp.experts.5.gate_proj"
ULP = 2.0 ** -23


def _make_weight(seed: int, rows: int = 8, cols: int = 64):
    gen = torch.Generator().manual_seed(seed)
    scale = float(torch.empty(()).log_normal_(0.0, 3.0, generator=gen))
    return quantize(torch.randn(rows, cols, generator=gen) * scale)


def _read(tensors: dict, producer: str):
    return read_nvfp4_weight(tensors.__getitem__, set(tensors), MODULE, producer)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_modelopt_and_compressed_tensors_forms_dequantize_identically(seed):
    """Both forms of one weight: packed bytes and block scales normalise bit-identically; the
    global scale after inverting CT's reciprocal is within one float32 ulp; dequantized values
    (and CT's own code * scale / global) agree to 2 ulps relative."""
    q = _make_weight(seed)
    modelopt, _ = _read(to_checkpoint(q, MODULE, MODELOPT), MODELOPT)
    ct_tensors = to_checkpoint(q, MODULE, COMPRESSED_TENSORS)
    assert set(ct_tensors) == {f"{MODULE}.{s}" for s in
                               ("weight_packed", "weight_scale", "weight_global_scale")}
    ct, _ = _read(ct_tensors, COMPRESSED_TENSORS)
    assert torch.equal(modelopt.packed, ct.packed)
    assert torch.equal(modelopt.block_scale.view(torch.uint8), ct.block_scale.view(torch.uint8))
    g_mo, g_ct = float(modelopt.global_scale), float(ct.global_scale)
    assert abs(g_mo - g_ct) <= ULP * abs(g_mo), f"global scales {g_mo!r} vs {g_ct!r}"
    a, b = modelopt.dequantize(), ct.dequantize()
    torch.testing.assert_close(b, a, rtol=2 * ULP, atol=0)
    raw = ct_tensors[f"{MODULE}.weight_global_scale"]
    native = dequantize(ct.packed, ct.block_scale, torch.ones(())) / raw.reshape(())
    torch.testing.assert_close(native, a, rtol=2 * ULP, atol=0)


def test_missing_and_malformed_tensors_are_named():
    """A missing tensor, a mis-shaped block scale and a non-scalar global name the tensors."""
    tensors = to_checkpoint(_make_weight(1), MODULE, MODELOPT)
    del tensors[f"{MODULE}.weight_scale_2"]
    with pytest.raises(NVFP4ConfigError, match=rf"{MODULE}\.weight_scale_2"):
        _read(tensors, MODELOPT)
    tensors = to_checkpoint(_make_weight(1), MODULE, MODELOPT)
    tensors[f"{MODULE}.weight_scale"] = tensors[f"{MODULE}.weight_scale"][:, :2]
    with pytest.raises(ValueError, match=rf"{MODULE}\.weight_scale.*\(8, 2\).*\(8, 4\)"):
        _read(tensors, MODELOPT)
    tensors = to_checkpoint(_make_weight(1), MODULE, COMPRESSED_TENSORS)
    tensors[f"{MODULE}.weight_global_scale"] = torch.ones(2)
    with pytest.raises(NVFP4ConfigError, match="weight_global_scale.*1 element"):
        _read(tensors, COMPRESSED_TENSORS)


def test_input_scale_is_normalised():
    """CT's input_global_scale is a reciprocal too; ModelOpt's input_scale is kept."""
    tensors = to_checkpoint(_make_weight(2), MODULE, COMPRESSED_TENSORS)
    tensors[f"{MODULE}.input_global_scale"] = torch.tensor([4.0])
    _, input_scale = _read(tensors, COMPRESSED_TENSORS)
    assert input_scale.shape == () and float(input_scale) == 0.25
    assert canonical_field(f"{MODULE}.weight_packed", COMPRESSED_TENSORS) == (MODULE, "weight")
    assert canonical_field(f"{MODULE}.bias", MODELOPT) is None


@pytest.mark.parametrize("producer", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_global_and_input_scales_read_in_both_scalar_shapes(producer, shape):
    """Real checkpoints store per-tensor scales as () or (1,) in either format (CT's own
    ModelOpt converter writes ()): both read to the same 0-d float32 scale, through
    read_nvfp4_weight and through the shard spec; a 2-element scale is refused."""
    from freetoken.formats.nvfp4.specs import GlobalScale
    from freetoken.formats.shard import ShardError

    q = _make_weight(7)
    tensors = to_checkpoint(q, MODULE, producer)
    global_name = next(n for n in tensors if n.endswith(("weight_scale_2",
                                                          "weight_global_scale")))
    input_name = MODULE + (".input_scale" if producer == MODELOPT else ".input_global_scale")
    tensors[global_name] = tensors[global_name].reshape(shape)
    tensors[input_name] = torch.full(shape, 0.5)
    weight, input_scale = _read(tensors, producer)
    assert weight.global_scale.shape == () and input_scale.shape == (), \
        (weight.global_scale.shape, input_scale.shape)
    for spec_shape in ((), (1,)):
        shard = GlobalScale(spec_shape).shard(tensors[global_name], 1, 2, global_name)
        assert shard.shape == () and shard.dtype == torch.float32, shard
    with pytest.raises(ShardError, match="expected a scalar"):
        GlobalScale(shape).shard(torch.ones(2), 0, 2, global_name)
