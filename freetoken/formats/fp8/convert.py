"""Block-FP8 checkpoints written from unquantized ones, the way Qwen's FP8 releases are laid
out (HF `quant_method: fp8`: `weight` e4m3, `weight_scale_inv` per block, `weight_block_size`
and `modules_to_not_convert` in config.json): for tests and tiny cases, with the block size
chosen to fit tiny dimensions (so that shards share blocks and last blocks are partial)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.formats.fp8.block import quantize
from freetoken.formats.fp8.tensor import quantize_per_tensor
from freetoken.formats.quant.format import FP8_TENSOR
from freetoken.formats.quant.producers import parse_quant_config

LINEAR = r".*_proj(_qkv|_z)?"
"""Which modules may be quantized: the projections (GDN in_proj_qkv and in_proj_z
included), never embeddings, norms or the LM head."""


def write_block_fp8(src: str | Path, dst: str | Path, block: tuple[int, int],
                    not_convert: tuple[str, ...] = ("lm_head",), modules: str = LINEAR,
                    scale_dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                    static_inputs: bool = False) -> Path:
    """Copy the checkpoint folder `src` (one `model.safetensors`) to `dst` with every 2-D
    `weight` of a module fully matching `modules` that the written config quantizes stored
    as block FP8. config.json gets `quantization_config` with `weight_block_size` `block`
    and `modules_to_not_convert` `not_convert` (transformers' matching: an entry matches a
    module from the start up to a boundary, or as a suffix). `static_inputs`: the
    `activation_scheme` is `static` and every quantized module stores a 0-d float32
    `activation_scale` (stand-ins, no calibration: positive, different per module).
    `device`: where the quantizer runs (a GPU for real-dimension checkpoints). Returns
    `dst`."""
    src, dst = Path(src), Path(dst)
    scheme_name = "static" if static_inputs else "dynamic"
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": scheme_name,
             "weight_block_size": list(block), "modules_to_not_convert": list(not_convert)}
    scheme = parse_quant_config(quant, "quantization_config")
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if (suffix == "weight" and t.dim() == 2 and re.fullmatch(modules, module)
                and scheme.is_quantized(module)):
            codes, scale = quantize(t.to(device), block, scale_dtype)
            out[name], out[f"{module}.weight_scale_inv"] = codes.cpu(), scale.cpu()
            if static_inputs:
                out[f"{module}.activation_scale"] = torch.tensor(0.01 * (1 + len(out) % 7))
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_modelopt_fp8(src: str | Path, dst: str | Path, layers: dict | None = None,
                       exclude: tuple[str, ...] = ("lm_head",), modules: str = LINEAR,
                       device: str = "cpu") -> Path:
    """Copy checkpoint `src` to `dst` with ModelOpt's FP8-per-tensor layout (`weight` e4m3,
    0-d float32 `weight_scale` = amax / 448 and `input_scale`, each module its own) and an
    `hf_quant_config.json`: `MIXED_PRECISION` with `layers` (module -> its entry, e.g.
    `{"quant_algo": "FP8"}`; entries in other formats must already be stored so in `src`)
    as `quantized_layers` when given, else `quant_algo: FP8` over every module not in
    `exclude`. The input scales are stand-ins (no calibration): positive, different per
    module. `device`: where the quantizer runs. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    if layers is None:
        quant = {"quant_algo": "FP8", "exclude_modules": list(exclude)}
    else:
        quant = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    doc = {"producer": {"name": "modelopt"}, "quantization": quant}
    scheme = parse_quant_config(doc, "hf_quant_config.json")
    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        if (suffix == "weight" and t.dim() == 2 and t.is_floating_point()
                and re.fullmatch(modules, module)
                and scheme.format_of(module).kind == FP8_TENSOR):
            codes, scale = quantize_per_tensor(t.to(device))
            out[name], out[f"{module}.weight_scale"] = codes.cpu(), scale.cpu()
            out[f"{module}.input_scale"] = torch.tensor(0.01 * (1 + len(out) % 7))
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    (dst / "hf_quant_config.json").write_text(json.dumps(doc, indent=2))
    return dst
