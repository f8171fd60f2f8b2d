"""Tiny quantized checkpoint folders in the layouts that ship, written from the bundled cases
for the twin-reference tests: Qwen's block FP8, NVIDIA's ModelOpt mixed NVFP4 + FP8 and
RedHatAI's compressed-tensors NVFP4; and a folder split into several weight files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin

P = "model.language_model.layers"
NVFP4_CASE = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
FP8 = {"quant_algo": "FP8"}
NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
FP8_BLOCK = (24, 40)
"""Blocks that cut q_proj's 32-row heads, start in_proj_qkv's k segment mid-block and make
ranks share blocks (`tests/models/test_qwen3_5_moe_fp8.py`)."""
NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_b",
               "in_proj_a")


def _layer_types() -> list[str]:
    return json.loads((NVFP4_CASE / "config.json").read_text())["text_config"]["layer_types"]


def make_block_fp8(dst: Path) -> Path:
    """Qwen's block-FP8 layout over the bundled Qwen3.5-MoE (attention, GDN qkv / z / out,
    shared and routed experts; routers, b / a, embeddings and lm_head kept)."""
    return write_block_fp8(GOLDEN / "tiny-qwen3.5-moe", dst, FP8_BLOCK, NOT_CONVERT)


def make_modelopt_mixed(dst: Path) -> Path:
    """NVIDIA's MIXED_PRECISION layout on the bundled NVFP4 case: its NVFP4 experts and an
    NVFP4 lm_head, per-tensor FP8 attention, GDN in_proj_qkv / in_proj_z / out_proj and
    shared expert (every module its own scale)."""
    layers = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i, kind in enumerate(_layer_types()):
        layers[f"{P}.{i}.mlp.experts"] = NVFP4
        layers[f"{P}.{i}.mlp.shared_expert"] = FP8
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{P}.{i}.{n}": FP8 for n in names})
    doc = {"producer": {"name": "modelopt"},
           "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    fp8 = write_modelopt_fp8(NVFP4_CASE, dst.with_name(dst.name + "-fp8-only"), layers)
    out = write_nvfp4(fp8, dst, doc, modules="lm_head")
    shutil.rmtree(fp8)
    return out


def make_compressed_tensors_nvfp4(dst: Path) -> Path:
    """RedHatAI's compressed-tensors NVFP4 layout (divisor globals): attention and routed
    experts NVFP4, an expanded split-name ignore list over linear_attn, routers,
    shared-expert gates, the shared expert and lm_head."""
    base = write_dequantized_twin(NVFP4_CASE, dst.with_name(dst.name + "-base"),
                                  read_quant_config(NVFP4_CASE))
    ignore = ["lm_head"]
    for i, kind in enumerate(_layer_types()):
        ignore += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        ignore += [f"{P}.{i}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "ignore": ignore, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "float", "strategy": "tensor_group",
                  "group_size": 16}}}}
    out = write_nvfp4(base, dst, config)
    shutil.rmtree(base)
    return out


def split_in_two(src: Path, dst: Path) -> Path:
    """A copy of checkpoint folder `src` with its `model.safetensors` split into two files
    and a `model.safetensors.index.json`, the cut inside a quantized module (its scale in the
    second file, its weight in the first)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)  # a module's weight sorts just before its weight_scale
    cut = next(i for i in range(len(names) // 2, len(names))
               if names[i].endswith((".weight_scale", ".weight_scale_inv")))
    assert names[cut - 1].rpartition(".")[0] == names[cut].rpartition(".")[0], names[cut]
    files = {"model-00001-of-00002.safetensors": names[:cut],
             "model-00002-of-00002.safetensors": names[cut:]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, dst / file)
    weight_map = {n: f for f, part in files.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst
