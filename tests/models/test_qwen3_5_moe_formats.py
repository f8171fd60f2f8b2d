"""Qwen3.5-MoE against the quantization configs of the checkpoints that ship (config only,
on the bundled case's dimensions, multimodal `model.language_model.` names): every module
resolves to the format its producer wrote, and what the engine does not run yet is refused
naming the module and the format, never loaded wrongly."""

from __future__ import annotations

import json

import pytest
from conftest import GOLDEN

from freetoken.config import ConfigError
from freetoken.formats.quant import BF16, NVFP4, parse_quant_config
from freetoken.models.registry import config_from_hf

FOLDER = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
P = "model.language_model.layers"
NVFP4_GROUP = {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                           "group_size": 16}}


def _make_hf() -> dict:
    return json.loads((FOLDER / "config.json").read_text())


def _parse(raw: dict):
    return config_from_hf(_make_hf(), parse_quant_config(raw, "quantization_config"))


def _redhat_ignore(hf: dict) -> list[str]:
    """RedHatAI's expanded ignore list: every linear_attn module by its split HF name, the
    non-Linear `linear_attn` and `linear_attn.norm`, routers, shared-expert gates, lm_head."""
    text, names = hf["text_config"], ["lm_head"]
    for i, kind in enumerate(text["layer_types"]):
        names += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            names += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            names += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return names


def test_experts_only_layouts_resolve_every_module():
    """NVIDIA's experts-only ModelOpt layout (the bundled case) and the same experts in
    compressed-tensors with an expanded split-name ignore list over the rest resolve every
    routed-expert set to NVFP4 and every other destination to bf16, GDN in_proj included."""
    hf = _make_hf()
    ignore = _redhat_ignore(hf)
    for i, kind in enumerate(hf["text_config"]["layer_types"]):
        if kind == "full_attention":
            ignore += [f"{P}.{i}.self_attn.{x}_proj" for x in "qkvo"]
        ignore += [f"{P}.{i}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
    raw = {"quant_method": "compressed-tensors", "ignore": ignore,
           "config_groups": {"group_0": {"targets": ["Linear"], **NVFP4_GROUP}}}
    modelopt = config_from_hf(hf, parse_quant_config(
        json.loads((FOLDER / "hf_quant_config.json").read_text())))
    for cfg, label in ((modelopt, "modelopt"), (_parse(raw), "compressed-tensors")):
        assert cfg.nvfp4_experts, label
        kinds = {name: {g.format.kind for g in gemms}
                 for name, gemms in cfg.module_formats.items()}
        wrong = {n: k for n, k in kinds.items()
                 if k != ({NVFP4} if n.endswith("mlp.experts") else {BF16})}
        assert not wrong, f"{label}: unexpected formats {wrong}"


def test_shipping_layouts_resolve_or_are_refused_naming_module_and_format():
    """RedHatAI's layout resolves (NVFP4 attention, its split-name ignore list keeping GDN
    bf16); an FP8 lm_head (only NVFP4 ones run) is refused naming it and its format; a GDN
    with in_proj_qkv in block FP8 but in_proj_z not is refused naming the split."""
    hf = _make_hf()
    redhat = {"quant_method": "compressed-tensors", "ignore": _redhat_ignore(hf),
              "config_groups": {"group_0": {"targets": ["Linear"], **NVFP4_GROUP}}}
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
        **{f"{P}.{i}.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16}
           for i in range(4)}}}
    block = {"quant_method": "compressed-tensors", "ignore": ["re:.*in_proj_[ab]$"],
             "config_groups": {"group_0": {"targets": ["re:.*in_proj_qkv$"], "weights": {
                 "num_bits": 8, "type": "float", "strategy": "block",
                 "block_structure": [16, 16]}}}}
    formats = _parse(redhat).module_formats
    assert formats["model.layers.1.self_attn.qkv_proj"][0].format.kind == NVFP4
    assert formats["model.layers.0.linear_attn.in_proj"][0].format.kind == BF16
    mixed["quantized_layers"]["lm_head"] = {"quant_algo": "FP8"}
    with pytest.raises(ConfigError, match=r"lm_head is FP8 per-tensor \(modelopt\), which "
                                          "FreeToken does not support"):
        _parse(mixed)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.linear_attn\.in_proj: the "
                                          r"quantization config splits it as \[in_proj_qkv\] "
                                          r"FP8 block 16x16 \(compressed-tensors\) \| "
                                          r"\[in_proj_z, in_proj_b, in_proj_a\] bf16"):
        _parse(block)


def test_gdn_ba_quantized_is_refused_and_fused_names_exclude_their_parts():
    """in_proj_b left out of modules_to_not_convert (block FP8 would quantize its per-head
    rows) is refused naming it and why. An exclusion naming vLLM's fused `in_proj_ba` /
    `in_proj_qkvz` (Qwen3-Next's own names) excludes the split modules it packs (HF's and
    compressed-tensors' matching rules); a fused-looking name the model has no parts for is still
    refused naming the entry."""
    block = {"quant_method": "fp8", "weight_block_size": [16, 16],
             "modules_to_not_convert": ["lm_head", "mlp", "self_attn", "in_proj_qkv",
                                        "in_proj_z", "out_proj", "in_proj_a"]}
    with pytest.raises(ConfigError, match=rf"{P}\.0\.linear_attn\.in_proj_b is FP8 block .*"
                                          r"one row per value head"):
        _parse(block)
    block["modules_to_not_convert"][-1:] = ["linear_attn.in_proj_ba", "mlp.gate",
                                            "mlp.shared_expert_gate"]
    in_proj = _parse(block).module_formats["model.layers.0.linear_attn.in_proj"]
    assert [(len(g.parts), g.format.kind) for g in in_proj] == [(4, BF16)], in_proj
    fused = {"quant_method": "compressed-tensors",
             "ignore": [f"{P}.{i}.linear_attn.in_proj_{x}"
                        for i, kind in enumerate(_make_hf()["text_config"]["layer_types"])
                        if kind == "linear_attention" for x in ("qkvz", "ba")],
             "config_groups": {"group_0": {"targets": ["re:.*(linear_attn|experts).*"],
                                           "weights": {"num_bits": 8, "type": "float",
                                                       "strategy": "block",
                                                       "block_structure": [16, 16]}}}}
    formats = _parse(fused).module_formats
    assert formats["model.layers.0.linear_attn.in_proj"][0].format.kind == BF16
    assert formats["model.layers.0.linear_attn.out_proj"][0].format.kind == "fp8-block"
    fused["ignore"].append(f"{P}.0.mlp.in_proj_ba")
    with pytest.raises(ConfigError, match=rf"ignore names '{P}\.0\.mlp\.in_proj_ba'"):
        _parse(fused)


def test_qwens_fp8_not_convert_list_resolves():
    """Qwen's block-FP8 releases list non-Linear names in modules_to_not_convert (the norms,
    q_norm / k_norm, and GatedDeltaNet's A_log, conv1d, dt_bias, in_proj_a, in_proj_b, norm):
    accepted, with in_proj split as [qkv | z] FP8 and [b | a] bf16."""
    block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [16, 16],
             "modules_to_not_convert": [
                 "lm_head", "model.language_model.embed_tokens", "input_layernorm",
                 "post_attention_layernorm", "q_norm", "k_norm", "model.language_model.norm",
                 "linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias",
                 "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.norm",
                 "mlp.gate", "mlp.shared_expert_gate"]}
    formats = _parse(block).module_formats
    in_proj = [(len(g.parts), g.format.kind) for g in formats["model.layers.0.linear_attn.in_proj"]]
    assert in_proj == [(2, "fp8-block"), (2, "bf16")], in_proj
    assert formats["model.layers.0.mlp.gate"][0].format.kind == BF16
