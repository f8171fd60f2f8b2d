"""Quantized checkpoint folders in each shipping layout, written from the bundled cases for
the shards tests: block FP8 (Qwen's releases: `weight_scale_inv` per block) of Qwen3.5-MoE
and of the dense and MoE decoders, with 24 x 40 blocks so that at TP 8 ranks share blocks and
last blocks are partial; NVIDIA's ModelOpt mixed layout (NVFP4 routed experts, shared expert
and lm_head; FP8 per tensor attention and GatedDeltaNet qkv / z / out; b / a bf16);
RedHatAI's compressed-tensors NVFP4 (attention, shared expert, routed experts; an expanded
split-name ignore list over linear_attn, routers, shared-expert gates and lm_head); a
ModelOpt FP8 per-tensor Llama and a ModelOpt NVFP4 Llama.

The NVFP4 layouts start from the bundled NVFP4 case's weights with the shared expert widened
from 48 to 128 intermediate rows (new rows random, seeded), so that its down_proj splits on
16-input groups at every TP size up to 8."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import GOLDEN
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin

P = "model.language_model.layers"
BLOCK = (24, 40)
QWEN35_NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate",
                      "in_proj_b", "in_proj_a")
NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
FP8 = {"quant_algo": "FP8"}
CT_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
SHARED_WIDTH = 128


def _layer_types() -> list[str]:
    config = json.loads((GOLDEN / "tiny-qwen3.5-moe-nvfp4" / "config.json").read_text())
    return config["text_config"]["layer_types"]


def widened_nvfp4_base(dst: Path) -> Path:
    """The bundled NVFP4 case dequantized, its shared expert widened to SHARED_WIDTH rows."""
    case = GOLDEN / "tiny-qwen3.5-moe-nvfp4"
    base = write_dequantized_twin(case, dst, read_quant_config(case))
    tensors = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(26)
    for name in [n for n in tensors if ".shared_expert." in n]:
        t = tensors[name]
        dim = 1 if ".down_proj." in name else 0
        shape = list(t.shape)
        shape[dim] = SHARED_WIDTH - shape[dim]
        extra = torch.randn(shape, generator=gen, dtype=torch.float32) * t.float().std()
        tensors[name] = torch.cat([t, extra.to(t.dtype)], dim=dim).contiguous()
    save_file(tensors, base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["text_config"]["shared_expert_intermediate_size"] = SHARED_WIDTH
    (base / "config.json").write_text(json.dumps(config, indent=2))
    return base


def block_fp8_qwen35(dst: Path) -> Path:
    return write_block_fp8(GOLDEN / "tiny-qwen3.5-moe", dst, BLOCK, QWEN35_NOT_CONVERT)


def block_fp8_decoder(case: str, dst: Path) -> Path:
    keep = ("lm_head", "model.embed_tokens") + (("mlp.gate",) if "moe" in case else ())
    return write_block_fp8(GOLDEN / case, dst, BLOCK, keep)


def modelopt_fp8_llama(dst: Path) -> Path:
    return write_modelopt_fp8(GOLDEN / "tiny-llama", dst)


def modelopt_nvfp4_llama(dst: Path) -> Path:
    """ModelOpt NVFP4 on every Llama projection but lm_head (`weight_scale_2` multiplies)."""
    config = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    return write_nvfp4(GOLDEN / "tiny-llama", dst, config)


def modelopt_mixed_config() -> dict:
    """NVIDIA's Qwen3.6 layout (`hf_quant_config.json`): NVFP4 experts, shared expert and
    lm_head; FP8 per tensor attention and GDN in_proj_qkv / in_proj_z / out_proj."""
    layers = {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    for i, kind in enumerate(_layer_types()):
        layers[f"{P}.{i}.mlp.experts"] = NVFP4
        layers[f"{P}.{i}.mlp.shared_expert"] = NVFP4
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{P}.{i}.{n}": FP8 for n in names})
    return {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}


def modelopt_mixed(base: Path, dst: Path) -> Path:
    doc = modelopt_mixed_config()
    layers = doc["quantization"]["quantized_layers"]
    fp8 = write_modelopt_fp8(base, dst.with_name(dst.name + "-fp8-part"), layers)
    return write_nvfp4(fp8, dst, doc, modules=r"lm_head|.*_proj")


def redhat_config() -> dict:
    """RedHatAI's layout (config.json `quantization_config`): every Linear NVFP4 but the
    expanded ignore list, which names HF's split modules."""
    ignore = ["lm_head"]
    for i, kind in enumerate(_layer_types()):
        ignore += [f"{P}.{i}.mlp.gate", f"{P}.{i}.mlp.shared_expert_gate"]
        if kind == "linear_attention":
            a = f"{P}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS}}}


def compressed_tensors_nvfp4(base: Path, dst: Path) -> Path:
    return write_nvfp4(base, dst, redhat_config())


def block_fp8_config(block: tuple[int, int] = BLOCK,
                     keep: tuple[str, ...] = QWEN35_NOT_CONVERT) -> dict:
    """Qwen's block-FP8 `quantization_config`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(keep)}


def make_all(root: Path) -> dict[str, Path]:
    """Every layout above under `root`, by name."""
    base = widened_nvfp4_base(root / "nvfp4-base")
    return {"block-fp8-qwen3.5": block_fp8_qwen35(root / "block-fp8-qwen3.5"),
            "block-fp8-qwen3": block_fp8_decoder("tiny-qwen3", root / "block-fp8-qwen3"),
            "block-fp8-qwen3-moe": block_fp8_decoder("tiny-qwen3-moe",
                                                     root / "block-fp8-qwen3-moe"),
            "block-fp8-llama": block_fp8_decoder("tiny-llama", root / "block-fp8-llama"),
            "modelopt-fp8-llama": modelopt_fp8_llama(root / "modelopt-fp8-llama"),
            "modelopt-nvfp4-llama": modelopt_nvfp4_llama(root / "modelopt-nvfp4-llama"),
            "modelopt-mixed": modelopt_mixed(base, root / "modelopt-mixed"),
            "ct-nvfp4": compressed_tensors_nvfp4(base, root / "ct-nvfp4")}
