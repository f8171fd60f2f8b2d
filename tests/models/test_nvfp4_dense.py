"""NVFP4 dense linears (attention, dense MLP), weight-only, in both producers' conventions,
end to end on CPU in fp32: a ModelOpt NVFP4 Llama (`weight_scale_2` multiplies) and
RedHatAI's compressed-tensors Qwen3.5-MoE layout (`weight_global_scale` divides; attention
q|gate, k, v, o and the routed experts NVFP4; an expanded split-name ignore list over
linear_attn, routers, shared-expert gates and lm_head; the shared expert left bf16 here,
its 48 intermediate rows not splitting on 16-element groups past TP 1), and a Qwen3-MoE with
NVFP4 attention, dense MLP and routed experts. The reference is the
dequantized twin at TP 1 (observed max abs 1e-6 to 4e-6: float32 rounding of the
dequantized weights and reduction order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN
from safetensors.torch import load_file
from twin_outputs import assert_same_outputs, generate

from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.models.registry import check_tp, load_config, shard_plan

P = "model.language_model.layers"
NVFP4_CASE = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def _redhat_config(shared_expert: bool) -> dict:
    text = json.loads((NVFP4_CASE / "config.json").read_text())["text_config"]
    ignore = ["lm_head"]
    for i, kind in enumerate(text["layer_types"]):
        ignore += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        if not shared_expert:
            ignore += [f"{P}.{i}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ignore, "config_groups": {"group_0": {"targets": ["Linear"],
                                                            "weights": WEIGHTS}}}


def _make_pair(tmp_path: Path, case: str, shared_expert: bool = False) -> tuple[Path, Path]:
    if case == "redhat":
        # The bundled NVFP4 case's weights, unquantized, then quantized RedHatAI's way.
        base = write_dequantized_twin(NVFP4_CASE, tmp_path / "base",
                                      read_quant_config(NVFP4_CASE))
        config = _redhat_config(shared_expert)
    else:
        base = GOLDEN / case
        config = {"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    quantized = write_nvfp4(base, tmp_path / "nvfp4", config)
    return quantized, write_dequantized_twin(quantized, tmp_path / "twin",
                                             read_quant_config(quantized))


@pytest.mark.parametrize("case", ["tiny-llama", "redhat"])
def test_engine_matches_the_dequantized_twin_at_every_tp(tmp_path, case):
    """At TP 1, 2, 4 and 8 the NVFP4 checkpoint gives the twin's prompt and decode logits
    to float32 tolerance and the same greedy tokens; q, k and v carry different global
    scales, so one global read for every segment would fail here."""
    quantized, twin = _make_pair(tmp_path, case)
    tensors = load_file(quantized / "model.safetensors")
    prefix, suffix = (("model.layers.0", "weight_scale_2") if case == "tiny-llama"
                      else (f"{P}.1", "weight_global_scale"))
    globals_ = {x: float(tensors[f"{prefix}.self_attn.{x}_proj.{suffix}"].reshape(()))
                for x in "qkv"}
    assert len(set(globals_.values())) == 3, f"segment globals not distinct: {globals_}"
    want = generate(twin, 1)
    for tp in (1, 2, 4, 8):
        assert_same_outputs(generate(quantized, tp), want, f"{case} tp={tp}")


def test_shards_round_trip_bitwise(tmp_path):
    """Every tensor of the compressed-tensors checkpoint (packed weights, e4m3 block
    scales, [1]-shaped reciprocal globals) shards and unshards bitwise at TP 1/2/4/8."""
    quantized, _ = _make_pair(tmp_path, "redhat")
    cfg, tensors = load_config(quantized), load_file(quantized / "model.safetensors")
    for tp in (1, 2, 4, 8):
        plan = shard_plan(cfg, tp)
        for name, full in tensors.items():
            spec = plan.resolve(name).rule.spec
            back = spec.unshard([spec.shard(full, r, tp, name) for r in range(tp)], name)
            same = back.reshape(-1).view(torch.uint8).equal(full.reshape(-1).view(torch.uint8))
            assert same and back.shape == full.shape, f"{name} tp={tp}"


def test_an_nvfp4_split_off_its_groups_is_refused_before_any_rank(tmp_path):
    """An NVFP4 shared expert of 48 intermediate rows splits at TP 1 (and its logits match
    the twin) but not at TP 2 (24 inputs per rank for down_proj): check_tp names the module,
    the dimension and the group before any rank starts."""
    quantized, twin = _make_pair(tmp_path, "redhat", shared_expert=True)
    cfg = load_config(quantized)
    check_tp(cfg, 1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.shared_expert\.down_proj "
                                         r"\(shared_expert_intermediate_size\): 48 NVFP4 "
                                         r"inputs cannot be split across tp_size=2"):
        check_tp(cfg, 2)
    assert_same_outputs(generate(quantized, 1), generate(twin, 1), "shared expert tp=1")


def test_qwen3_moe_nvfp4_experts_match_the_twin_and_refuse_off_group_splits(tmp_path):
    """A Qwen3-MoE with every projection NVFP4 (ModelOpt; routers and lm_head excluded)
    matches its twin at TP 1 and 2; at TP 4 its experts' 32 intermediate inputs give 8 per
    rank, not a 16-element group, and check_tp refuses naming moe_intermediate_size."""
    config = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*mlp.gate"]}}
    quantized = write_nvfp4(GOLDEN / "tiny-qwen3-moe", tmp_path / "nvfp4", config)
    twin = write_dequantized_twin(quantized, tmp_path / "twin", read_quant_config(quantized))
    want = generate(twin, 1)
    for tp in (1, 2):
        assert_same_outputs(generate(quantized, tp), want, f"qwen3-moe tp={tp}")
    with pytest.raises(ValueError, match=r"moe_intermediate_size: 32 NVFP4 inputs cannot be "
                                         r"split across tp_size=4"):
        check_tp(load_config(quantized), 4)
