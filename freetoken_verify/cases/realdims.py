"""`qwen3.5-moe-realdims` in the quantized layouts that ship (`../shared/quant_formats.md`),
converted from the bf16 checkpoint by the engine's own writers (`freetoken.formats.*.convert`):

- `fp8-block`: Qwen's FP8 releases: block FP8 (128 x 128 at real dimensions, bf16
  `weight_scale_inv`) on attention, GatedDeltaNet in_proj_qkv / in_proj_z / out_proj, the
  shared expert and every routed expert; lm_head, embeddings, routers, shared-expert gates and
  in_proj_a / in_proj_b left bf16 (`modules_to_not_convert`);
- `nvfp4-ct`: RedHatAI's compressed-tensors NVFP4: attention, shared expert and routed
  experts NVFP4 (divisor globals), an expanded ignore list in HF's split names over the whole
  linear_attn, the routers, the shared-expert gates and lm_head;
- `modelopt-mixed`: NVIDIA's ModelOpt MIXED_PRECISION: W4A16 NVFP4 routed experts, shared
  expert and lm_head; FP8 per tensor on attention and GatedDeltaNet in_proj_qkv / in_proj_z /
  out_proj; in_proj_a / in_proj_b bf16.

Random weights quantized by the formats' own rules; no reference outputs (the reference for a
quantized checkpoint is its dequantized twin, `freetoken.formats.quant.twin`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4

FORMATS = ("bf16", "fp8-block", "nvfp4-ct", "modelopt-mixed")
PREFIX = "model.language_model.layers"
BLOCK_NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_b",
                     "in_proj_a")
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
W4A16 = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
FP8 = {"quant_algo": "FP8"}


def redhat_config(layer_types: list[str]) -> dict:
    """compressed-tensors NVFP4 over every Linear but an expanded ignore list in HF's split
    names (linear_attn and its norm included, as llm-compressor saves it)."""
    ignore = ["lm_head"]
    for i, kind in enumerate(layer_types):
        ignore += [f"{PREFIX}.{i}.mlp.gate", f"{PREFIX}.{i}.mlp.shared_expert_gate"]
        if kind == "linear_attention":
            a = f"{PREFIX}.{i}.linear_attn"
            ignore += [a, f"{a}.norm", f"{a}.conv1d", f"{a}.out_proj"]
            ignore += [f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a")]
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_WEIGHTS}}}


def modelopt_mixed_layers(layer_types: list[str]) -> dict:
    """ModelOpt's `quantized_layers`: W4A16 NVFP4 experts (keyed by their container), shared
    expert and lm_head, FP8 attention and GatedDeltaNet qkv / z / out."""
    layers = {"lm_head": W4A16}
    for i, kind in enumerate(layer_types):
        p = f"{PREFIX}.{i}"
        layers[f"{p}.mlp.experts"] = W4A16
        layers.update({f"{p}.mlp.shared_expert.{x}_proj": W4A16 for x in ("gate", "up", "down")})
        names = ([f"self_attn.{x}_proj" for x in "qkvo"] if kind == "full_attention" else
                 [f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "out_proj")])
        layers.update({f"{p}.{n}": FP8 for n in names})
    return layers


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str,
                        block: tuple[int, int] = (128, 128), device: str = "cpu") -> Path:
    """Write the bf16 Qwen3.5-MoE checkpoint `src` (one model.safetensors) to `dst` in `fmt`
    (one of FORMATS; `block`: the FP8 block), quantizing on `device`. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise ValueError(f"unknown realdims format {fmt!r}; expected one of "
                         f"{', '.join(FORMATS)}")
    if fmt == "bf16":
        shutil.copytree(src, dst)
        return dst
    layer_types = json.loads((src / "config.json").read_text())["text_config"]["layer_types"]
    if fmt == "fp8-block":
        return write_block_fp8(src, dst, block, BLOCK_NOT_CONVERT, device=device)
    if fmt == "nvfp4-ct":
        return write_nvfp4(src, dst, redhat_config(layer_types), device=device)
    layers = modelopt_mixed_layers(layer_types)
    doc = {"producer": {"name": "modelopt"},
           "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    fp8_only = dst.with_name(dst.name + ".fp8-only")
    try:
        write_modelopt_fp8(src, fp8_only, layers, device=device)
        return write_nvfp4(fp8_only, dst, doc, modules=r"lm_head|.*_proj", device=device)
    finally:
        shutil.rmtree(fp8_only, ignore_errors=True)
