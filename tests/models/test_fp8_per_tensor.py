"""FP8 per tensor (ModelOpt `FP8`: `weight` e4m3, 0-d `weight_scale` multiplier, 0-d
`input_scale` read, checked and unused by the weight-only path), end to end on CPU in fp32:
a Llama with every projection FP8, and NVIDIA's mixed Qwen3.5-MoE layout (NVFP4 routed
experts from the bundled case and an NVFP4 lm_head with padded vocab rows at TP 2/4/8; FP8
attention, GDN in_proj_qkv / in_proj_z / out_proj and shared expert, which NVIDIA makes
NVFP4 but whose 48 rows do not split on 16-element groups past TP 1; in_proj_b / in_proj_a
and routers bf16). Every module has its own
scale, q / k / v and qkv / z included, and the fused destinations keep one per tensor. The
reference is the dequantized twin at TP 1 (observed max abs 0.0 at TP 1, 4e-6 at TP 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN
from safetensors.torch import load_file, save_file
from twin_outputs import assert_same_outputs, generate

from freetoken.formats.fp8.convert import write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.formats.shard import ShardError
from freetoken.models.registry import load_config, shard_plan

P = "model.language_model.layers"
FP8 = {"quant_algo": "FP8"}


def _mixed_layers() -> dict:
    """NVIDIA's Qwen3.6 recipe on the bundled NVFP4 case: its NVFP4 experts, the rest FP8."""
    text = json.loads((GOLDEN / "tiny-qwen3.5-moe-nvfp4" / "config.json").read_text())
    layers = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i, kind in enumerate(text["text_config"]["layer_types"]):
        layers[f"{P}.{i}.mlp.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
        layers[f"{P}.{i}.mlp.shared_expert"] = FP8
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{P}.{i}.{n}": FP8 for n in names})
    return layers


def _make_pair(tmp_path: Path, case: str) -> tuple[Path, Path]:
    if case == "tiny-qwen3.5-moe-nvfp4":
        layers = _mixed_layers()
        doc = {"producer": {"name": "modelopt"},
               "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
        fp8 = write_nvfp4(write_modelopt_fp8(GOLDEN / case, tmp_path / "fp8-only", layers),
                          tmp_path / "fp8", doc, modules="lm_head")
    else:
        fp8 = write_modelopt_fp8(GOLDEN / case, tmp_path / "fp8")
    return fp8, write_dequantized_twin(fp8, tmp_path / "twin", read_quant_config(fp8))


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3.5-moe-nvfp4"])
def test_engine_matches_the_dequantized_twin_at_every_tp(tmp_path, case):
    """At TP 1, 2, 4 and 8 the FP8 checkpoint gives the twin's prompt and decode logits to
    float32 tolerance and the same greedy tokens; its fused modules' scales differ per
    tensor, so a destination reading one scale for all its segments would fail here."""
    fp8, twin = _make_pair(tmp_path, case)
    tensors = load_file(fp8 / "model.safetensors")
    prefix = "model.layers.0" if case == "tiny-llama" else f"{P}.1"
    scales = {x: float(tensors[f"{prefix}.self_attn.{x}_proj.weight_scale"]) for x in "qkv"}
    assert len(set(scales.values())) == 3, f"segment scales not distinct: {scales}"
    want = generate(twin, 1)
    for tp in (1, 2, 4, 8):
        assert_same_outputs(generate(fp8, tp), want, f"{case} tp={tp}")


def test_shards_round_trip_and_scales_land_in_their_segment(tmp_path):
    """Every tensor of the mixed checkpoint shards and unshards bitwise at TP 1/2/4/8, and
    each per-tensor scale goes to its own entry of its destination (q, k, v: 0, 1, 2;
    in_proj_qkv, in_proj_z: 0, 1)."""
    fp8, _ = _make_pair(tmp_path, "tiny-qwen3.5-moe-nvfp4")
    cfg, tensors = load_config(fp8), load_file(fp8 / "model.safetensors")
    for tp in (1, 2, 4, 8):
        plan = shard_plan(cfg, tp)
        for name, full in tensors.items():
            spec = plan.resolve(name).rule.spec
            back = spec.unshard([spec.shard(full, r, tp, name) for r in range(tp)], name)
            assert back.reshape(-1).view(torch.uint8).equal(full.reshape(-1).view(torch.uint8)), \
                f"{name} tp={tp}"
    plan = shard_plan(cfg, 2)
    for name, want in ((f"{P}.1.self_attn.k_proj.weight_scale",
                        ("model.layers.1.self_attn.qkv_proj.weight_scale", (1,))),
                       (f"{P}.0.linear_attn.in_proj_z.input_scale",
                        ("model.layers.0.linear_attn.in_proj.input_scale", (1,)))):
        target = plan.resolve(name)
        assert (target.param, target.slot) == want, (name, target.param, target.slot)


def test_a_zero_input_scale_is_refused_naming_the_tensor(tmp_path):
    """A stored input scale of 0 (unused by the weight-only path, yet a broken export) is
    refused at load naming the tensor."""
    fp8, _ = _make_pair(tmp_path, "tiny-llama")
    name = "model.layers.1.mlp.up_proj.input_scale"
    tensors = load_file(fp8 / "model.safetensors")
    tensors[name] = torch.tensor(0.0)
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(ShardError, match=rf"{name}: FP8 per-tensor input scale 0.0 is not "
                                         "finite and above 0"):
        generate(fp8, 1)
