"""Quantized bundled cases in the on-disk layouts of the releases they copy, written from a
checkpoint folder HF saved, by the engine's format writers (`freetoken.formats.nvfp4.convert`,
`freetoken.formats.fp8.convert`). The catalogue then runs HF on the folder's dequantized twin
(`freetoken.formats.quant.twin`): HF's own loaders cannot read these layouts reliably.

- `REDHAT_NVFP4`: RedHatAI's compressed-tensors `nvfp4-pack-quantized` Qwen3.5-MoE (attention
  q/k/v/o, shared expert and routed experts NVFP4, W4A4 input global scales stored; an
  expanded ignore list of split names over linear_attn, the routers, shared_expert_gate and
  lm_head).
- `NVIDIA_MIXED`: NVIDIA's ModelOpt `MIXED_PRECISION` Qwen3.6-MoE (W4A16 NVFP4 routed experts
  keyed by their `mlp.experts` container, shared expert and lm_head; FP8 per tensor on
  attention and GDN in_proj_qkv / in_proj_z / out_proj, each module its own scales;
  in_proj_b / in_proj_a bf16).
- `QWEN_FP8`, `QWEN3_FP8`: Qwen's block-FP8 releases (`quant_method: fp8`, bf16 `weight_scale_inv`,
  an expanded `modules_to_not_convert`), for Qwen3.5-MoE and dense Qwen3.

The producers make the global scales of gate / up (and llm-compressor those of q / k / v)
equal before export; here every module keeps its own amax, so an engine that reads one
segment's scale for a whole fused destination fails on these cases."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8.block import FP8
from freetoken.formats.fp8.convert import write_block_fp8, write_modelopt_fp8
from freetoken.formats.nvfp4.convert import write_nvfp4
from freetoken.formats.nvfp4.format import E2M1_MAX, E4M3_MAX
from freetoken_verify.cases.nvfp4 import ct_nvfp4_config

P = "model.language_model"
FP8_BLOCK = (24, 40)
"""Qwen's 128 x 128 blocks scaled to the tiny dimensions: every size ends in a partial block
(hidden 64 = 40 + 24 inputs, 128 rows = 5 x 24 + 8) and at TP 8 ranks of 4 to 16 rows or
inputs share a block with a neighbour."""
NVFP4_W4A16 = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
FP8_TENSOR = {"quant_algo": "FP8"}
MODELOPT_VERSION = "0.44.0"
GDN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d",
               "norm")


@dataclass(frozen=True)
class Recipe:
    """How one quantized case is written: `write(src, dst)` turns the folder HF saved into the
    quantized checkpoint `dst`; `producer` and `layout` go into meta.json."""

    producer: str
    layout: str
    write: Callable[[Path, Path], Path]
    label: str
    """A few words for `freetoken-verify --list`."""


def _text_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return config.get("text_config", config)


def _vision_linears(folder: Path) -> list[str]:
    """The vision tower's linear modules (2-D weights under `model.visual.`, its position
    embedding table aside): producers list them among the modules they leave unquantized."""
    tensors = load_file(folder / "model.safetensors")
    modules = [n.removesuffix(".weight") for n, t in tensors.items()
               if n.startswith("model.visual.") and n.endswith(".weight") and t.dim() == 2]
    return sorted(m for m in modules if not m.endswith("embed"))


def _layers(text: dict) -> list[tuple[str, str]]:
    """(checkpoint prefix, layer type) of every decoder layer of a Qwen3.5 text config."""
    return [(f"{P}.layers.{i}", kind) for i, kind in enumerate(text["layer_types"])]


def redhat_ignore(folder: Path) -> list[str]:
    """RedHatAI's ignore list, saved expanded as llm-compressor writes it: every module its
    recipe's patterns (`lm_head`, `mlp.gate$`, `shared_expert_gate$`, `linear_attn.*`,
    `visual.*`) matched, by its split HF name, non-Linear modules of linear_attn (the module
    itself, conv1d, norm) included."""
    ignore = ["lm_head"]
    for layer, kind in _layers(_text_config(folder)):
        ignore += [f"{layer}.mlp.gate", f"{layer}.mlp.shared_expert_gate"]
        if kind == "linear_attention":
            ignore += [f"{layer}.linear_attn"]
            ignore += [f"{layer}.linear_attn.{m}" for m in GDN_MODULES]
    return ignore + _vision_linears(folder)


def _input_scales(folder: Path, weight: str, dtype: torch.dtype,
                  scale: Callable[[str, float], dict[str, torch.Tensor]]) -> None:
    """Give every module of `folder` whose `weight`-suffixed tensor is in `dtype` its static
    input scale tensors, `scale(module, amax)`, from stand-in activation amaxes that differ
    per module (no calibration): the weight-only engine reads and checks them, nothing
    more."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    modules = sorted(n.removesuffix(f".{weight}") for n, t in tensors.items()
                     if n.endswith(f".{weight}") and t.dtype == dtype)
    for i, module in enumerate(modules):
        tensors.update(scale(module, 4.0 + i / 4))
    save_file(tensors, path, metadata={"format": "pt"})


def _ct_input_global(module: str, amax: float) -> dict[str, torch.Tensor]:
    """compressed-tensors' W4A4 `input_global_scale`: [1] float32, 6 * 448 / amax."""
    return {f"{module}.input_global_scale": torch.tensor([E2M1_MAX * E4M3_MAX / amax])}


def _modelopt_input(module: str, amax: float) -> dict[str, torch.Tensor]:
    """ModelOpt's FP8 `input_scale`: 0-d float32, amax / 448."""
    return {f"{module}.input_scale": torch.tensor(amax / E4M3_MAX)}


def write_redhat_nvfp4(src: Path, dst: Path) -> Path:
    """`src` in RedHatAI's compressed-tensors NVFP4 layout (see the module docstring)."""
    write_nvfp4(src, dst, ct_nvfp4_config(redhat_ignore(src)))
    _input_scales(dst, "weight_packed", torch.uint8, _ct_input_global)
    return dst


def nvidia_quantized_layers(folder: Path) -> dict:
    """NVIDIA's Qwen3.6 `quantized_layers`: W4A16 NVFP4 for lm_head, each layer's routed
    experts (keyed by the `mlp.experts` container) and shared expert projections; FP8 per
    tensor for attention q/k/v/o and GDN in_proj_qkv, in_proj_z and out_proj. Modules it does
    not name (in_proj_b / in_proj_a, routers, vision) stay bf16."""
    layers = {"lm_head": NVFP4_W4A16}
    for layer, kind in _layers(_text_config(folder)):
        if kind == "full_attention":
            layers.update({f"{layer}.self_attn.{x}_proj": FP8_TENSOR for x in "qkvo"})
        else:
            layers.update({f"{layer}.linear_attn.{x}": FP8_TENSOR
                           for x in ("in_proj_qkv", "in_proj_z", "out_proj")})
        layers[f"{layer}.mlp.experts"] = NVFP4_W4A16
        layers.update({f"{layer}.mlp.shared_expert.{x}_proj": NVFP4_W4A16
                       for x in ("gate", "up", "down")})
    return dict(sorted(layers.items()))


def write_nvidia_mixed(src: Path, dst: Path) -> Path:
    """`src` in NVIDIA's ModelOpt MIXED_PRECISION layout (see the module docstring): the FP8
    modules first (into a folder beside `dst`), then the NVFP4 ones, one
    `hf_quant_config.json` for both."""
    layers = nvidia_quantized_layers(src)
    doc = {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
           "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                            "quantized_layers": layers}}
    fp8 = write_modelopt_fp8(src, dst.with_name(dst.name + "-fp8"), layers)
    write_nvfp4(fp8, dst, doc, modules=r"lm_head|.*_proj")
    # The writer's stand-in input scales repeat every 7 modules (q and k of a layer can
    # coincide); these differ for every FP8 module. W4A16 NVFP4 modules have none.
    _input_scales(dst, "weight", FP8, _modelopt_input)
    return dst


def qwen_not_convert(folder: Path) -> list[str]:
    """Qwen's `modules_to_not_convert`, expanded per module as its FP8 releases list them:
    lm_head, the embedding, every norm, the routers and shared-expert gates, GDN conv1d,
    in_proj_a / in_proj_b and norm, and the vision tower's linears (Qwen3.5-MoE); lm_head,
    the embedding and the norms (dense Qwen3)."""
    text = _text_config(folder)
    multimodal = "layer_types" in text and "linear_num_value_heads" in text
    prefix = P if multimodal else "model"
    keep = ["lm_head", f"{prefix}.embed_tokens", f"{prefix}.norm"]
    kinds = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    for i, kind in enumerate(kinds):
        layer = f"{prefix}.layers.{i}"
        keep += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        if kind == "full_attention":
            keep += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        else:
            keep += [f"{layer}.linear_attn.{m}" for m in ("conv1d", "in_proj_a", "in_proj_b",
                                                           "norm")]
        if multimodal:
            keep += [f"{layer}.mlp.gate", f"{layer}.mlp.shared_expert_gate"]
    return keep + (_vision_linears(folder) if multimodal else [])


def write_qwen_block_fp8(src: Path, dst: Path) -> Path:
    """`src` in Qwen's block-FP8 layout with `FP8_BLOCK` blocks and bf16 scales."""
    return write_block_fp8(src, dst, FP8_BLOCK, tuple(qwen_not_convert(src)),
                           scale_dtype=torch.bfloat16)


REDHAT_NVFP4 = Recipe(
    "compressed-tensors", "RedHatAI Qwen3.5-35B-A3B-NVFP4 (nvfp4-pack-quantized)",
    write_redhat_nvfp4, "NVFP4 attention, shared and routed experts (compressed-tensors)")
NVIDIA_MIXED = Recipe(
    "modelopt", "nvidia/Qwen3.6-35B-A3B-NVFP4 (MIXED_PRECISION)", write_nvidia_mixed,
    "NVFP4 MLPs and lm_head, FP8 attention and GDN (ModelOpt mixed)")
QWEN_FP8 = Recipe(
    "fp8", "Qwen/Qwen3.5-35B-A3B-FP8 (block FP8, blocks 24x40 for the tiny dimensions)",
    write_qwen_block_fp8, "block FP8 24x40 (Qwen fp8)")
QWEN3_FP8 = Recipe(
    "fp8", "Qwen/Qwen3-1.7B-FP8 (block FP8, tied embeddings; blocks 24x40 for the tiny dimensions)",
    write_qwen_block_fp8, "block FP8 24x40 (Qwen fp8)")


def stored_formats(folder: Path) -> dict[str, list[str]]:
    """What the written folder stores, by format, for meta.json: each linear module (layer
    and expert indices written `*`) under `nvfp4`, `fp8-tensor`, `fp8-block` or `bf16`, read
    from its tensors' names and dtypes."""
    tensors = load_file(folder / "model.safetensors")
    found: dict[str, set[str]] = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if (suffix not in ("weight", "weight_packed") or t.dim() != 2
                or module.startswith("model.visual") or module.endswith("embed_tokens")):
            continue
        if t.dtype == torch.uint8:
            kind = "nvfp4"
        elif t.dtype == torch.float8_e4m3fn:
            kind = "fp8-block" if f"{module}.weight_scale_inv" in tensors else "fp8-tensor"
        else:
            kind = "bf16"
        found.setdefault(kind, set()).add(re.sub(r"\.\d+\.", ".*.", module))
    return {kind: sorted(found[kind]) for kind in sorted(found)}
