"""Quantization configs of the three producers (freetoken.formats.quant): each is read into
one answer to "which format is module X in", by that producer's matching rules, and what
cannot be read is refused naming the file, key or module."""

from __future__ import annotations

import json

import pytest

from freetoken.formats.quant import (
    BF16,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    QuantConfigError,
    parse_quant_config,
    read_quant_config,
)

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def _assert_kinds(scheme, expected: dict[str, str]) -> None:
    got = {m: scheme.format_of(m).kind for m in expected}
    wrong = {m: (got[m], k) for m, k in expected.items() if got[m] != k}
    assert not wrong, f"module: (read, expected) {wrong}"


def _make_ct(ignore, targets=("Linear",), weights=NVFP4_WEIGHTS) -> dict:
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": list(targets), "weights": weights}}}


def test_hf_quant_config_wins_and_modelopt_patterns_cover_children(tmp_path):
    """hf_quant_config.json wins over config.json; ModelOpt exclude patterns (exact and
    fnmatch) cover the module's children."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors"}}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head", "*mlp.gate", "model.layers.0.self_attn"]}}))
    scheme = read_quant_config(tmp_path)
    assert scheme.producer == "modelopt" and not scheme.global_scale_is_reciprocal
    _assert_kinds(scheme, {"model.layers.2.mlp.experts.0.up_proj": NVFP4,
                           "model.layers.2.mlp.gate_proj": NVFP4, "lm_head": BF16,
                           "model.layers.2.mlp.gate": BF16,
                           "model.layers.0.self_attn.q_proj": BF16})
    (tmp_path / "hf_quant_config.json").unlink()
    with pytest.raises(QuantConfigError, match="compressed-tensors config without "
                                               "config_groups"):
        read_quant_config(tmp_path)


def test_mixed_precision_keys_by_module_or_container_with_either_prefix():
    """ModelOpt MIXED_PRECISION: `quantized_layers` keyed by a container (`...mlp.experts`)
    covers every expert; W4A16_NVFP4 reads as NVFP4 and FP8 as FP8 per tensor; keys written
    `model.layers.*` also match the multimodal `model.language_model.layers.*` names; a
    module not listed is unquantized; an unknown algorithm is refused naming the module."""
    scheme = parse_quant_config({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                 "quantized_layers": {
                                     "model.layers.0.mlp.experts": {
                                         "quant_algo": "W4A16_NVFP4", "group_size": 16},
                                     "model.language_model.layers.0.linear_attn.in_proj_qkv": {
                                         "quant_algo": "FP8"}}})
    _assert_kinds(scheme, {
        "model.language_model.layers.0.mlp.experts.7.down_proj": NVFP4,
        "model.layers.0.mlp.experts.0.gate_proj": NVFP4,
        "model.language_model.layers.0.linear_attn.in_proj_qkv": FP8_TENSOR,
        "model.language_model.layers.0.linear_attn.in_proj_b": BF16,
        "model.language_model.layers.0.mlp.shared_expert.gate_proj": BF16})
    with pytest.raises(QuantConfigError, match=r"module 'model.layers.0.self_attn' uses "
                                               r"quant_algo 'INT8_SQ'"):
        parse_quant_config({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                            "quantized_layers": {"model.layers.0.self_attn": {
                                "quant_algo": "INT8_SQ"}}})
    with pytest.raises(QuantConfigError, match="group_size 32; NVFP4 uses 16"):
        parse_quant_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})


def test_compressed_tensors_matches_exact_names_and_re_from_the_start():
    """compressed-tensors ignore entries are exact module names (children not covered: its
    lists are saved expanded) or `re:` regexes matched from the start (hence `$` in
    `re:.*mlp.gate$`, which must not catch `mlp.gate_proj`); an exact target beats a regex
    target beats `Linear`; CT NVFP4 global scales divide."""
    scheme = parse_quant_config(_make_ct(
        ["re:.*mlp.gate$", "model.layers.0.linear_attn", "model.layers.0.linear_attn.in_proj_b"],
        targets=["re:.*experts.*"]))
    assert scheme.producer == "compressed-tensors" and scheme.global_scale_is_reciprocal
    _assert_kinds(scheme, {"model.layers.1.mlp.experts.7.down_proj": NVFP4,
                           "model.layers.1.mlp.gate": BF16,
                           "model.layers.1.self_attn.o_proj": BF16,
                           "model.layers.0.linear_attn.in_proj_b": BF16})
    everything = parse_quant_config(_make_ct(["model.layers.0.linear_attn"]))
    _assert_kinds(everything, {"model.layers.0.linear_attn.in_proj_qkv": NVFP4,
                               "model.layers.1.mlp.gate_proj": NVFP4})
    fp8 = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 32]}
    block = parse_quant_config(_make_ct([], weights=fp8))
    assert block.format_of("x.q_proj").block == (64, 32), block.format_of("x.q_proj")
    with pytest.raises(QuantConfigError, match="group 'group_0'.*neither NVFP4"):
        parse_quant_config(_make_ct([], weights={"num_bits": 8, "type": "int",
                                                 "strategy": "channel"}))


def test_hf_fp8_reads_block_size_and_modules_to_not_convert():
    """HF fp8 (`quant_method: fp8`): every linear is block FP8 with `weight_block_size`,
    except `modules_to_not_convert`, matched as transformers does: from the start up to a
    module boundary (`model.layers.1` is not `model.layers.11`, `mlp.gate` not
    `mlp.gate_proj`) or as a suffix (`in_proj_b` anywhere)."""
    scheme = parse_quant_config({"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 64],
                                 "modules_to_not_convert": ["lm_head", "model.layers.1",
                                                            "mlp.gate", "in_proj_b"]})
    _assert_kinds(scheme, {"lm_head": BF16, "model.layers.1.self_attn.q_proj": BF16,
                           "model.layers.11.self_attn.q_proj": FP8_BLOCK,
                           "model.layers.2.mlp.gate": BF16,
                           "model.layers.2.mlp.gate_proj": FP8_BLOCK,
                           "model.layers.2.linear_attn.in_proj_b": BF16})
    assert scheme.format_of("model.layers.2.mlp.gate_proj").block == (128, 64)
    for bad, message in (({"fmt": "e5m2"}, "fmt 'e5m2'"),
                         ({"weight_block_size": None}, "without weight_block_size"),
                         ({"weight_block_size": [128]}, r"weight_block_size must be \[rows"),
                         ({"activation_scheme": "int"}, "activation_scheme 'int'"),
                         ({"modules_to_not_convert": "lm_head"}, "must be a list")):
        raw = {"quant_method": "fp8", "weight_block_size": [128, 128], **bad}
        with pytest.raises(QuantConfigError, match=message):
            parse_quant_config(raw, "cfg.json")


def test_unknown_methods_and_malformed_documents_are_refused():
    """An unknown quant_method, a non-object document and a missing quant_algo are refused
    naming the source; no config is no scheme."""
    with pytest.raises(QuantConfigError, match="src: quant_method 'gptq' is not supported"):
        parse_quant_config({"quant_method": "gptq"}, "src")
    with pytest.raises(QuantConfigError, match="src: not a JSON object"):
        parse_quant_config([1], "src")
    with pytest.raises(QuantConfigError, match="without quant_algo"):
        parse_quant_config({"quant_method": "modelopt"}, "src")
    assert parse_quant_config(None) is None
