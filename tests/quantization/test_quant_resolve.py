"""Resolving a quantization config against a model's module table
(freetoken.formats.quant.resolve): fused destinations whose parts differ in format become
one GEMM per format where the model allows it and are refused otherwise; stacked experts
share one format; a part no quantized format fits, a config entry naming a module the model
does not have, and a format the engine does not run are refused naming the module."""

from __future__ import annotations

import pytest

from freetoken.formats.quant import (
    BF16,
    FP8_TENSOR,
    NVFP4,
    Destination,
    ModuleTable,
    QuantConfigError,
    parse_quant_config,
    resolve,
)

GDN = "model.layers.0.linear_attn"
PARTS = tuple(f"{GDN}.in_proj_{x}" for x in ("qkv", "z", "b", "a"))


def _make_table(**in_proj) -> ModuleTable:
    options = dict(accepts=frozenset({FP8_TENSOR}), splittable=True, bf16_only=PARTS[2:],
                   note="one row per value head")
    options.update(in_proj)
    experts = tuple(f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(4)
                    for p in ("gate", "up", "down"))
    return ModuleTable((Destination(f"{GDN}.in_proj", PARTS, **options),
                        Destination("model.layers.0.mlp.experts", experts,
                                    frozenset({NVFP4}), stacked=True)),
                       (f"{GDN}.norm", f"{GDN}.conv1d"))


def _make_mixed(layers: dict, **extra):
    return parse_quant_config({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                               "quantized_layers": layers, **extra}, "hf_quant_config.json")


FP8 = {"quant_algo": "FP8"}
EXPERTS = {"model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16}}


def test_fused_destination_splits_into_one_gemm_per_format():
    """GDN in_proj with qkv|z FP8 and b|a bf16 (NVIDIA's mixed layout) resolves to two
    GEMMs, [qkv, z] FP8 per tensor and [b, a] bf16; the experts resolve to one NVFP4 set."""
    scheme = _make_mixed({PARTS[0]: FP8, PARTS[1]: FP8, **EXPERTS})
    gemms = resolve(scheme, _make_table())
    got = [(g.parts, g.format.kind) for g in gemms[f"{GDN}.in_proj"]]
    assert got == [(PARTS[:2], FP8_TENSOR), (PARTS[2:], BF16)], got
    experts = gemms["model.layers.0.mlp.experts"]
    assert len(experts) == 1 and experts[0].format.kind == NVFP4, experts


def test_unsplittable_and_stacked_destinations_refuse_mixed_formats():
    """The same mixed in_proj is refused naming both parts where the destination cannot be
    split; experts quantized in part are refused naming an expert of each format."""
    scheme = _make_mixed({PARTS[0]: FP8, PARTS[1]: FP8, **EXPERTS})
    with pytest.raises(QuantConfigError, match=rf"fused parts of {GDN}.in_proj differ in "
                                               rf"format: {PARTS[1]} is FP8 per-tensor"):
        resolve(scheme, _make_table(splittable=False))
    partial = _make_mixed({"model.layers.0.mlp.experts.0": {"quant_algo": "NVFP4"}})
    with pytest.raises(QuantConfigError, match=r"stacked modules of model.layers.0.mlp.experts"
                                               r" differ in format: .*experts.0.down_proj is "
                                               r"NVFP4 .*experts.1.gate_proj is bf16"):
        resolve(partial, _make_table())


def test_refused_formats_name_the_module_and_why():
    """in_proj_b quantized (FP8 here, as a careless ModelOpt run or a block-FP8 export would)
    is refused naming it and why; a format the destination does not take (NVFP4 in_proj_qkv)
    is refused naming the module and the formats it runs."""
    with pytest.raises(QuantConfigError, match=rf"{PARTS[2]} is FP8 per-tensor \(modelopt\), "
                                               r"which FreeToken does not support .*one row "
                                               r"per value head.*runs it as: bf16"):
        resolve(_make_mixed({PARTS[2]: FP8}), _make_table())
    with pytest.raises(QuantConfigError, match=rf"{PARTS[0]} is NVFP4 .* runs it as: bf16, "
                                               "fp8-tensor"):
        resolve(_make_mixed({PARTS[0]: {"quant_algo": "NVFP4"}}), _make_table())


def test_entries_naming_no_module_are_refused_and_foreign_ones_allowed():
    """A config entry naming a module the model does not have (a layer past the last, a
    fused name over modules the model lacks) is refused naming the key and the entry;
    non-Linear modules (`linear_attn`, `linear_attn.norm`), containers, vLLM's fused name
    of modules the model has (`in_proj_ba`) and the vision tower / MTP head (not run by the
    engine) are accepted."""
    ok = {"quant_method": "compressed-tensors", "ignore": [
        GDN, f"{GDN}.norm", f"{GDN}.in_proj_b", f"{GDN}.in_proj_ba",
        "model.visual.blocks.0.attn.qkv",
        "mtp.layers.0.mlp.gate", *PARTS],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}
    resolve(parse_quant_config(ok, "config.json"), _make_table())
    for entry in ("model.layers.7.linear_attn.in_proj_ba",
                  "model.layers.7.linear_attn.in_proj_qkv"):
        bad = dict(ok, ignore=[*ok["ignore"], entry])
        with pytest.raises(QuantConfigError, match=rf"config.json: ignore names '{entry}', "
                                                   "which is none of the model's"):
            resolve(parse_quant_config(bad, "config.json"), _make_table())
    with pytest.raises(QuantConfigError, match="quantized_layers names 'model.layers.0.mlp"
                                               ".experts.9'"):
        resolve(_make_mixed({"model.layers.0.mlp.experts.9": {"quant_algo": "NVFP4"}}),
                _make_table())
