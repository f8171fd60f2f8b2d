"""NVFP4 checkpoints written from unquantized ones, in either producer's layout (ModelOpt:
`hf_quant_config.json`, packed `weight`, multiplier `weight_scale_2`; compressed-tensors:
config.json `quantization_config`, `weight_packed`, divisor `weight_global_scale`), for tests
and tiny cases. Which modules are quantized is the written config's answer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from freetoken.formats.nvfp4.checkpoint import to_checkpoint
from freetoken.formats.nvfp4.quantizer import quantize
from freetoken.formats.quant.format import COMPRESSED_TENSORS, NVFP4
from freetoken.formats.quant.producers import parse_quant_config

LINEAR = r".*_proj(_qkv|_z)?"


def write_nvfp4(src: str | Path, dst: str | Path, config: dict, modules: str = LINEAR,
                device: str = "cpu") -> Path:
    """Copy checkpoint `src` (one `model.safetensors`) to `dst` with every 2-D float `weight`
    of a module fully matching `modules` that `config` (a compressed-tensors
    `quantization_config`, or a ModelOpt `hf_quant_config.json` document) makes NVFP4 stored
    in NVFP4, and the config written where its producer puts it. `device`: where the
    quantizer runs (a GPU for real-dimension checkpoints). Returns `dst`."""
    src, dst = Path(src), Path(dst)
    scheme = parse_quant_config(config, "quantization config")
    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        fmt = scheme.format_of(module)
        if (suffix == "weight" and t.dim() == 2 and t.is_floating_point()
                and re.fullmatch(modules, module) and fmt.kind == NVFP4):
            tensors = to_checkpoint(quantize(t.to(device).float()), module, fmt.producer)
            out.update({k: v.cpu() for k, v in tensors.items()})
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    if scheme.producer == COMPRESSED_TENSORS:
        hf = json.loads((dst / "config.json").read_text())
        hf["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(hf, indent=2))
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps(config, indent=2))
    return dst
