"""NVFP4 bundled checkpoints: the routed experts of a saved HF Qwen3.5-MoE checkpoint
quantized by FreeToken's ModelOpt-rule quantizer, in the on-disk layout of NVIDIA's releases.

- `quantize_experts`: rewrite a folder `save_pretrained` wrote into ModelOpt's layout
  (per-expert `weight` uint8, `weight_scale` e4m3, `weight_scale_2` and `input_scale` float32,
  `hf_quant_config.json` with quant_algo NVFP4 and an exclude list), and overwrite the
  in-memory HF model's experts with dequant(quant(w)), so HF run on it is the reference.
- `to_compressed_tensors`: the same checkpoint in compressed-tensors' layout (`weight_packed`,
  `weight_scale`, reciprocal `weight_global_scale`, `quantization_config` in config.json).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.formats.nvfp4.checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    to_checkpoint,
)
from freetoken.formats.nvfp4.format import E2M1_MAX, E4M3_MAX, GROUP
from freetoken.formats.nvfp4.quantizer import NVFP4Tensor, quantize

_EXPERT = re.compile(r"(?P<p>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate|up|down)_proj\.weight")
# A calibrated activation amax of 8 (what ModelOpt stores as input_scale = amax / (6 * 448));
# W4A16 never reads it, the loader must still accept it.
INPUT_AMAX = 8.0
# NVIDIA's releases list the modules left unquantized; these patterns cover the same ones.
MODELOPT_EXCLUDE = [
    "lm_head", "model.visual*", "mtp*", "model.language_model.layers.*.self_attn*",
    "model.language_model.layers.*.linear_attn*", "model.language_model.layers.*.mlp.gate",
    "model.language_model.layers.*.mlp.shared_expert*",
]
CT_IGNORE = ["lm_head", r"re:model\.visual\..*", r"re:.*\.self_attn\..*",
             r"re:.*\.linear_attn\..*", r"re:.*\.mlp\.gate", r"re:.*\.mlp\.shared_expert.*"]


def _input_scale() -> torch.Tensor:
    return torch.tensor(INPUT_AMAX / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)


@torch.no_grad()
def quantize_experts(model: torch.nn.Module, folder: Path) -> None:
    """Quantize the per-expert tensors of `folder/model.safetensors` (written by
    `model.save_pretrained`) into ModelOpt's NVFP4 layout, write `hf_quant_config.json`, and
    set `model`'s fused in-memory experts to the dequantized weights."""

    path = folder / "model.safetensors"
    state = load_file(path)
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in state.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        q = quantize(tensor)
        module = name.removesuffix(".weight")
        out.update(to_checkpoint(q, module, MODELOPT))
        out[f"{module}.input_scale"] = _input_scale()
        _set_dequantized(params, m, tensor, q)
    save_file(dict(sorted(out.items())), path, metadata={"format": "pt"})
    quant = {"producer": {"name": "modelopt", "version": "0.35.0"},
             "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                              "group_size": GROUP, "exclude_modules": MODELOPT_EXCLUDE}}
    (folder / "hf_quant_config.json").write_text(json.dumps(quant, indent=2) + "\n")


def _set_dequantized(params: dict, m: re.Match, original: torch.Tensor, q: NVFP4Tensor) -> None:
    """HF fuses experts in memory: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I]. The slot must hold the checkpoint's original weight before it is replaced, which
    pins the mapping between the two layouts."""
    e, part = int(m["e"]), m["part"]
    fused = params[f"{m['p']}.{'down_proj' if part == 'down' else 'gate_up_proj'}"]
    rows = original.shape[0]
    slot = fused.data[e] if part == "down" else (
        fused.data[e, :rows] if part == "gate" else fused.data[e, rows:])
    if not torch.equal(slot, original.to(slot.dtype)):
        raise AssertionError(f"{m[0]}: HF's in-memory expert layout changed")
    slot.copy_(q.dequantize().to(slot.dtype))


def to_compressed_tensors(src: Path, dst: Path) -> Path:
    """Write the ModelOpt NVFP4 checkpoint `src` into `dst` as compressed-tensors stores it:
    same packed codes and block scales, reciprocal global scales (shape [1]), `ignore` list
    and `config_groups` in config.json's `quantization_config`."""

    dst.mkdir(parents=True, exist_ok=True)
    state, out = load_file(src / "model.safetensors"), {}
    for name, tensor in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight_scale_2":
            weight = NVFP4Tensor(state[f"{module}.weight"], state[f"{module}.weight_scale"],
                                 tensor)
            out.update(to_checkpoint(weight, module, COMPRESSED_TENSORS))
        elif suffix == "input_scale":
            out[f"{module}.input_global_scale"] = (1.0 / tensor.double()).float().reshape(1)
        elif suffix not in ("weight", "weight_scale") or f"{module}.weight_scale_2" not in state:
            out[name] = tensor
    save_file(dict(sorted(out.items())), dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct_nvfp4_config(CT_IGNORE)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def ct_nvfp4_config(ignore: list[str]) -> dict:
    """compressed-tensors' `quantization_config` for NVFP4 (`nvfp4-pack-quantized`): one
    group targeting every Linear, W4A4 (static input global scales, dynamic local ones),
    modules in `ignore` (names or `re:` patterns) left unquantized."""
    nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP,
             "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": nvfp4,
                                          "input_activations": dict(nvfp4, dynamic="local")}}}
